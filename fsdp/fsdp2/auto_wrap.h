// Auto-wrapping for FSDP2: fully_shard every selected submodule bottom-up, then the root.
// PyTorch 2.15's fully_shard has no auto_wrap_policy (users write the loop by hand, e.g.
// torchtitan's `for block in model.layers: fully_shard(block)`); this is the C++ loop, with
// the predicates of FSDP1's ModuleWrapPolicy / ModuleTypeWrapPolicy
// (fsdp/fsdp1/fully_sharded_data_parallel.h):
//
//   FSDPModule root = fully_shard_tree(model.ptr(), WrapModuleTypes<BlockImpl>(), {.mesh = mesh});
#ifndef FSDP_FSDP_FSDP2_AUTO_WRAP_H_
#define FSDP_FSDP_FSDP2_AUTO_WRAP_H_

#include <torch/nn/module.h>

#include <functional>
#include <memory>

#include "fsdp/fsdp2/fsdp_api.h"
#include "fsdp/fsdp2/fully_shard.h"

namespace fsdp::fsdp2 {

using WrapPredicate = std::function<bool(const torch::nn::Module&)>;

// fully_shard(m, options) for every strict descendant m of `root` that `wrap` accepts, in
// post-order (children before parents, siblings in registration order: the order a hand-
// written bottom-up loop uses, so the groups and hence the communication match it), then
// fully_shard(root, options), whose group takes every parameter no selected descendant took.
// Returns root's handle.
//
// Rules (c10::Error naming the module's path otherwise):
//  - A selected module must be able to run forward hooks (fsdp::Hooked<Impl> or another
//    fsdp::HookedModule), as fully_shard requires. It is an error, not a silent skip: a
//    skipped module's parameters would quietly fall into its parent's group, changing the
//    memory and communication plan the predicate asked for. Predicates that may match plain
//    modules can test fsdp::AsHooked(m) themselves.
//  - A module already fully_shard'ed (by hand before this call) is left as it is and its
//    subtree is not visited again; so is a module reached twice (shared submodule).
//  - `wrap` is not asked about `root`: the root is always fully_shard'ed (and must not be
//    already).
// Every call gets the same `options`; as with hand-written calls, the root keeps its
// parameters unsharded after forward unless options.reshard_after_forward is set.
FSDPModule fully_shard_tree(const std::shared_ptr<torch::nn::Module>& root, const WrapPredicate& wrap,
                            const FullyShardOptions& options);

// Selects modules deriving from any of `Impls` (FSDP1's ModuleTypeWrapPolicy<Impls...>):
// WrapModuleTypes<BlockImpl>() matches fsdp::Hooked<BlockImpl>, whose module is a
// HookedImpl<BlockImpl> deriving from BlockImpl.
template <class... Impls>
WrapPredicate WrapModuleTypes() {
  static_assert(sizeof...(Impls) > 0, "WrapModuleTypes needs at least one module type");
  return [](const torch::nn::Module& m) { return (... || (dynamic_cast<const Impls*>(&m) != nullptr)); };
}

}  // namespace fsdp::fsdp2

#endif  // FSDP_FSDP_FSDP2_AUTO_WRAP_H_
