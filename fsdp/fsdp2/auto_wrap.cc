#include "fsdp/fsdp2/auto_wrap.h"

#include <c10/util/Exception.h>

#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "fsdp/common/fsdp_state_base.h"
#include "fsdp/hooked_module/hooked_module.h"

namespace fsdp::fsdp2 {
namespace {

bool HasFsdpState(torch::nn::Module& m) { return ::fsdp::FindForwardHook<::fsdp::FSDPStateBase>(m) != nullptr; }

// Post-order over the strict descendants of `module` (torch::nn::Module::named_children
// order), collecting the selected ones; `path` is the module's dotted name for messages.
void CollectPostOrder(torch::nn::Module& module, const std::string& path, const WrapPredicate& wrap,
                      absl::flat_hash_set<const torch::nn::Module*>& visited,
                      std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& out) {
  for (const auto& item : module.named_children()) {
    const std::shared_ptr<torch::nn::Module>& child = item.value();
    if (!visited.insert(child.get()).second) continue;  // shared submodule: once
    const std::string child_path = path.empty() ? item.key() : path + "." + item.key();
    // Already fully_shard'ed (or FSDP1-wrapped) by hand: its subtree is settled.
    if (HasFsdpState(*child)) continue;
    CollectPostOrder(*child, child_path, wrap, visited, out);
    if (wrap(*child)) out.emplace_back(child_path, child);
  }
}

}  // namespace

FSDPModule fully_shard_tree(const std::shared_ptr<torch::nn::Module>& root, const WrapPredicate& wrap,
                            const FullyShardOptions& options) {
  TORCH_CHECK(root != nullptr, "fully_shard_tree: root is null");
  TORCH_CHECK(static_cast<bool>(wrap), "fully_shard_tree: wrap (the predicate) is empty");
  absl::flat_hash_set<const torch::nn::Module*> visited{root.get()};
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> selected;
  CollectPostOrder(*root, "", wrap, visited, selected);
  // Check every selection before sharding anything, so that a bad predicate leaves the
  // model untouched.
  for (const auto& [path, m] : selected) {
    TORCH_CHECK(
        ::fsdp::AsHooked(*m) != nullptr, "fully_shard_tree: wrap selected '", path, "' (", m->name(),
        "), which cannot run forward hooks; construct it as fsdp::Hooked<Impl> (fsdp/hooked_module/hooked_module.h) "
        "or exclude it from the predicate");
  }
  TORCH_CHECK(::fsdp::AsHooked(*root) != nullptr, "fully_shard_tree: root (", root->name(),
              ") cannot run forward hooks; construct it as fsdp::Hooked<Impl>");
  for (const auto& [path, m] : selected) fully_shard(m, options);
  return fully_shard(root, options);
}

}  // namespace fsdp::fsdp2
