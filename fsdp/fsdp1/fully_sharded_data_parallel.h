// FSDP1 for torch::nn modules: PyTorch's FullyShardedDataParallel (flat-parameter FSDP).
//
//   using Block = fsdp::Hooked<BlockImpl>;   // forward runs hooks (fsdp/hooked_module/hooked_module.h)
//   auto model = std::make_shared<fsdp::HookedImpl<NetImpl>>(...);
//   FSDPOptions options{.process_group = pg};
//   for (auto& block : model->blocks) wrap_fsdp(block.ptr(), options);   // bottom-up
//   FullyShardedDataParallel fsdp = wrap_fsdp(model, options);            // the root last
//   torch::optim::AdamW opt(fsdp.parameters(), ...);   // flat params, or originals with
//                                                     // use_orig_params
//   loss.backward(); fsdp.clip_grad_norm(1.0); opt.step(); opt.zero_grad();
//
// Wrapping happens in place: C++ cannot replace a module inside its parent, so a module can be
// wrapped only if its type can run forward hooks, i.e. it was built as fsdp::Hooked<Impl> /
// HookedImpl<Impl> (the same type FSDP2 and no FSDP use) or derives from fsdp::HookedModule;
// FSDP1's hook is attached outermost. wrap_fsdp flattens the parameters of the module's tree that no wrapped
// descendant manages into one FlatParameter, sharded over the process group; call it
// bottom-up. Auto-wrap (options.auto_wrap_policy) follows PyTorch's _recursive_wrap over the
// children, but only modules that can run the hooks can be selected: a module the policy
// picks that cannot is left unwrapped and its parameters go to the nearest wrapped
// ancestor (its numel is not counted as wrapped).
//
// The parameters keep their tensor identity: without use_orig_params they hold no data
// between steps (0 elements) and views of the all-gathered flat parameter in forward /
// backward; with use_orig_params they hold flattened views of this rank's part of the flat
// parameter between steps (what optimizers see).
#ifndef FSDP_FSDP_FSDP1_FULLY_SHARDED_DATA_PARALLEL_H_
#define FSDP_FSDP_FSDP1_FULLY_SHARDED_DATA_PARALLEL_H_

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/common/fsdp_state_base.h"
#include "fsdp/fsdp1/fsdp_options.h"
#include "fsdp/hooked_module/forward_tensors.h"
#include "fsdp/hooked_module/hooked_module.h"

namespace fsdp::fsdp1 {

// The runtime's types (fsdp/fsdp1/fsdp_state.h, flat_param.h: //fsdp/fsdp1:runtime),
// which this API hands out only by pointer.
class FSDPState;
class FlatParamHandle;
class FullyShardedDataParallel;

// Restores every FSDP state's gradient sync flag on destruction (FSDP.no_sync()).
class [[nodiscard]] NoSyncGuard {
 public:
  NoSyncGuard(NoSyncGuard&& other) noexcept : old_flags_(std::move(other.old_flags_)) { other.old_flags_.clear(); }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;
  ~NoSyncGuard();

 private:
  friend class FullyShardedDataParallel;
  explicit NoSyncGuard(std::vector<std::pair<FSDPState*, bool>> old_flags) : old_flags_(std::move(old_flags)) {}
  std::vector<std::pair<FSDPState*, bool>> old_flags_;
};

// The handle wrap_fsdp returns (PyTorch's FullyShardedDataParallel methods). Cheap to copy;
// safe to hold: it refers to the module's state weakly, and any call after the module is
// destroyed (or on a default-constructed handle) throws a c10::Error saying so.
class FullyShardedDataParallel {
 public:
  FullyShardedDataParallel() = default;
  explicit FullyShardedDataParallel(FSDPState* state);

  FSDPState* state() const;
  torch::nn::Module& module() const;
  // This module's FlatParamHandle (null if it manages no parameters).
  FlatParamHandle* handle() const;
  // Every FlatParamHandle of this module's tree, in module pre-order.
  std::vector<FlatParamHandle*> handles() const;
  // Runs lazy initialization if needed (collective-free); true for the root.
  bool is_root() const;

  // What the optimizer should get: per handle of the tree, the flat parameter (or with
  // use_orig_params the original parameters, each once), then the tree's parameters no
  // handle manages.
  std::vector<at::Tensor> parameters() const;

  // Gradient accumulation without communication: backwards inside accumulate unsharded
  // gradients; the next backward outside reduces their sum. Root only.
  NoSyncGuard no_sync();

  // Clips the gradients of every parameter of the tree (sharded or not) so their total
  // norm_type-norm (inf: max-norm) over all ranks is at most max_norm; returns the total
  // norm (float32 computation, in the gradients' dtype). Collective over the process group;
  // root only, between backward and the optimizer step.
  at::Tensor clip_grad_norm(double max_norm, double norm_type = 2.0);

  // Replaces the default gradient reduction of every FSDP module of the tree (see CommHook).
  // Root only, before training; not with hybrid strategies; once.
  void register_comm_hook(CommHook hook);

 private:
  void CheckRoot(const char* what) const;
  ::fsdp::StateRef<FSDPState> state_;
};

// Wraps `module` (a fsdp::Hooked<Impl> or other fsdp::HookedModule) with FSDP1: with
// options.auto_wrap_policy first wraps the children it selects (same options), then flattens
// and shards the parameters no wrapped descendant manages. Once per module, bottom-up,
// before building the optimizer; parameters must already be on options.device.
FullyShardedDataParallel wrap_fsdp(const std::shared_ptr<torch::nn::Module>& module, FSDPOptions options);

// PyTorch's size_based_auto_wrap_policy: recurse into / wrap modules with at least
// min_num_params (unique, not yet wrapped) parameter elements.
AutoWrapPolicy SizeBasedAutoWrapPolicy(int64_t min_num_params = 100000000);
// PyTorch's ModuleWrapPolicy with a predicate: always recurse, wrap modules it accepts.
AutoWrapPolicy ModuleWrapPolicy(std::function<bool(const torch::nn::Module&)> predicate);
// ModuleWrapPolicy by type: wraps modules deriving from any of `Impls`.
template <class... Impls>
AutoWrapPolicy ModuleTypeWrapPolicy() {
  return ModuleWrapPolicy(
      [](const torch::nn::Module& m) { return (... || (dynamic_cast<const Impls*>(&m) != nullptr)); });
}

}  // namespace fsdp::fsdp1

#endif  // FSDP_FSDP_FSDP1_FULLY_SHARDED_DATA_PARALLEL_H_
