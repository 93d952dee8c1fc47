#include "dcp/adapter.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <mutex>
#include <set>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_join.h"
#include "dcp/tp_adapter.h"
#include "fsdp/common/fsdp_state_base.h"
#include "fsdp/hooked_module/hooked_module.h"

namespace fsdp::dcp::internal {
namespace {

// The kinds this repository has adapters for: what a binary that lacks one must link.
struct KnownKind {
  const char* kind;
  const char* name;
  const char* target;
};
constexpr KnownKind kKnownKinds[] = {
    {"fully_shard", "FSDP2 (fully_shard)", "//dcp:fsdp2"},
    {"wrap_fsdp", "FSDP1 (wrap_fsdp)", "//dcp:fsdp1"},
};

struct Registry {
  std::mutex mu;
  std::map<std::string, AdapterFactory> factories;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();  // never destroyed: static initializers use it
  return *registry;
}

// The kinds of FSDP state attached anywhere in `model`'s tree.
std::set<std::string> ModelKindsOf(torch::nn::Module& model) {
  std::set<std::string> kinds;
  for (const auto& module : model.modules(/*include_self=*/true)) {
    const HookedModule* hooked = AsHooked(*module);
    if (hooked == nullptr) continue;
    for (const auto& hook : hooked->forward_hooks()) {
      if (const auto* state = dynamic_cast<const FSDPStateBase*>(hook.get())) kinds.insert(state->api_name());
    }
  }
  return kinds;
}

std::string MissingAdapter(const std::string& kind, const char* caller) {
  for (const KnownKind& k : kKnownKinds) {
    if (kind == k.kind) {
      return c10::str(caller, ": this model is ", k.name, ": link ", k.target,
                      " (its checkpoint adapter; //dcp links every adapter)");
    }
  }
  return c10::str(caller, ": this model is sharded by '", kind, "', and no checkpoint adapter for it is linked");
}

// A plain module: every tensor whole, the same on every rank.
class PlainAdapter : public ModelAdapter {
 public:
  comm::ProcessGroupPtr world() const override { return nullptr; }
  const ShardedParam* Sharded(const std::string&) const override { return nullptr; }
};

}  // namespace

at::Tensor ShardedParam::Staging(at::ScalarType dtype) const {
  return at::empty(local_size_, at::TensorOptions().dtype(dtype));
}

optim_state::OptimStateDict ModelAdapter::GetOptimState(torch::nn::Module& model,
                                                        const torch::optim::Optimizer& optimizer) const {
  return optim_state::GetOptimStateDict(optimizer, UniqueParameters(model));
}

void ModelAdapter::CheckOptimState(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                   const optim_state::OptimStateDict& state) const {
  optim_state::CheckOptimStateDict(optimizer, UniqueParameters(model), state);
}

void ModelAdapter::LoadOptimState(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                  const optim_state::OptimStateDict& state, const char* caller) const {
  optim_state::SetOptimStateDict(optimizer, UniqueParameters(model), state, optim_state::StateTensors::kAdopt);
}

bool RegisterModelAdapter(const std::string& kind, AdapterFactory factory) {
  Registry& registry = GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mu);
  registry.factories.emplace(kind, factory);
  return true;
}

std::unique_ptr<ModelAdapter> AdapterFor(torch::nn::Module& model, const char* caller) {
  const std::set<std::string> kinds = ModelKindsOf(model);
  TORCH_CHECK(kinds.size() <= 1, caller, ": the model mixes ", absl::StrJoin(kinds, " and "),
              " modules; a checkpoint covers models of one kind");
  if (kinds.empty()) {
    if (std::unique_ptr<ModelAdapter> tp = MakeTensorParallelAdapter(model, caller)) return tp;
    return std::make_unique<PlainAdapter>();
  }
  AdapterFactory factory = nullptr;
  {
    Registry& registry = GetRegistry();
    std::lock_guard<std::mutex> lock(registry.mu);
    auto it = registry.factories.find(*kinds.begin());
    if (it != registry.factories.end()) factory = it->second;
  }
  TORCH_CHECK(factory != nullptr, MissingAdapter(*kinds.begin(), caller));
  return factory(model, caller);
}

optim_state::NamedParams UniqueParameters(torch::nn::Module& model) {
  optim_state::NamedParams out;
  absl::flat_hash_set<const c10::TensorImpl*> seen;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = item.value();
    if (t.defined() && seen.insert(t.unsafeGetTensorImpl()).second) out.emplace_back(item.key(), t);
  }
  return out;
}

}  // namespace fsdp::dcp::internal
