// fully_shard: per-parameter FSDP (FSDP2) for torch::nn modules.
//
//   using Block = fsdp::Hooked<BlockImpl>;   // forward runs hooks (fsdp/common/hooked_module.h)
//   auto model = std::make_shared<fsdp::HookedImpl<NetImpl>>(...);
//   for (auto& block : model->blocks) fully_shard(block.ptr(), {.mesh = mesh});
//   fsdp::per_param::FSDPModule root = fully_shard(model, {.mesh = mesh});
//   torch::optim::AdamW opt(model->parameters(), ...);   // sees the sharded parameters
//
// Parameters keep their tensor identity: between steps each holds its shard (a view into
// storage FSDP owns); inside forward/backward its data is swapped to the unsharded view.
#ifndef FSDP_FSDP_PER_PARAM_FULLY_SHARD_H_
#define FSDP_FSDP_PER_PARAM_FULLY_SHARD_H_

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "fsdp/common/forward_tensors.h"
#include "fsdp/common/fsdp_state_base.h"
#include "fsdp/common/hooked_module.h"
#include "fsdp/per_param/fsdp_api.h"

namespace fsdp::per_param {

// The runtime (fsdp_state.h, fsdp_param_group.h: //fsdp/per_param:runtime) stays out of this
// header; tests and tools include it for introspection.
class FSDPState;
class FSDPParamGroup;

// The handle fully_shard returns (PyTorch's FSDPModule methods). Cheap to copy; safe to
// hold: it refers to the module's state weakly, and any call after the module is destroyed
// (or on a default-constructed handle) throws a c10::Error saying so.
class FSDPModule {
 public:
  FSDPModule() = default;
  explicit FSDPModule(FSDPState* state);

  // All-gathers this module's parameters now (async_op: issue only; then wait_for_unshard).
  void unshard(bool async_op = false);
  void wait_for_unshard();
  void reshard();
  // false: accumulate unsharded gradients without communication (no_sync).
  void set_requires_gradient_sync(bool requires_gradient_sync, bool recurse = true);
  // HSDP: false reduce-scatters but skips the replicate all-reduce (partial accumulation).
  void set_requires_all_reduce(bool requires_all_reduce, bool recurse = true);
  void set_reshard_after_forward(bool reshard_after_forward, bool recurse = true);
  void set_reshard_after_backward(bool reshard_after_backward, bool recurse = true);
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules);
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules);
  void set_is_last_backward(bool is_last_backward);
  void set_gradient_divide_factor(double factor);
  // Only SUM reductions in the collectives (the division becomes a separate pre/post
  // scaling), e.g. for zero-copy NCCL; this module's group only, as PyTorch 2.15's
  // FSDPModule.set_force_sum_reduction_for_comms.
  void set_force_sum_reduction_for_comms(bool enable);
  void set_unshard_in_backward(bool unshard_in_backward);

  // Runtime internals (fsdp_state.h), for tests and tools.
  FSDPState* state() const;
  FSDPParamGroup* param_group() const;

 private:
  std::vector<FSDPState*> States(bool recurse) const;
  ::fsdp::StateRef<FSDPState> state_;
};

// Shards the parameters of `module` that no fully_shard'ed submodule manages. `module`
// must be able to run forward hooks (fsdp::Hooked<Impl> / HookedImpl<Impl>, or any type
// deriving from fsdp::HookedModule whose forward calls RunForwardHooks); FSDP's hook is
// attached outermost (its pre-forward runs first, its post-forward last, as PyTorch's
// prepended pre-hook and appended post-hook).
// Call bottom-up (blocks, then the root), once per module, before building the optimizer.
FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, FullyShardOptions options);

// Forward arguments and outputs are searched for tensors with fsdp::ForwardTensors
// (fsdp/common/forward_tensors.h; specialize it there for other types).
using ::fsdp::ForwardTensors;

// Deprecated (kept so existing code compiles): derive from fsdp::HookedModule, or build the
// module as fsdp::Hooked<Impl>. fsdp_state() is the attached FSDP2 state, if any.
class FSDPHooks : public ::fsdp::HookedModule {
 public:
  FSDPState* fsdp_state() const;
};

// The wrapper names of earlier versions: the hooked-module layer's types (one model type
// for FSDP2, FSDP1 and no FSDP at all).
template <class Impl, class Signature = decltype(&Impl::forward)>
using FullyShardedImpl = ::fsdp::HookedImpl<Impl, Signature>;
template <class Impl>
using FullySharded = ::fsdp::Hooked<Impl>;

}  // namespace fsdp::per_param

#endif  // FSDP_FSDP_PER_PARAM_FULLY_SHARD_H_
