// fully_shard: per-parameter FSDP (FSDP2) for torch::nn modules.
//
//   using Block = fsdp::Hooked<BlockImpl>;   // forward runs hooks (fsdp/hooked_module/hooked_module.h)
//   auto model = std::make_shared<fsdp::HookedImpl<NetImpl>>(...);
//   for (auto& block : model->blocks) fully_shard(block.ptr(), {.mesh = mesh});
//   fsdp::fsdp2::FSDPModule root = fully_shard(model, {.mesh = mesh});
//   torch::optim::AdamW opt(model->parameters(), ...);   // sees the sharded parameters
//   fully_shard({attn->q.ptr(), attn->k.ptr()}, {.mesh = mesh});   // one group for both
//
// Parameters keep their tensor identity: between steps each holds its shard (a view into
// storage FSDP owns); inside forward/backward its data is swapped to the unsharded view.
#ifndef FSDP_FSDP_FSDP2_FULLY_SHARD_H_
#define FSDP_FSDP_FSDP2_FULLY_SHARD_H_

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "dtensor/dtensor_spec.h"
#include "fsdp/common/fsdp_state_base.h"
#include "fsdp/fsdp2/fsdp_api.h"
#include "fsdp/hooked_module/forward_tensors.h"
#include "fsdp/hooked_module/hooked_module.h"

namespace fsdp::fsdp2 {

// The runtime (fsdp_state.h, fsdp_param_group.h: //fsdp/fsdp2:runtime) stays out of this
// header; tests reach a handle's runtime through fsdp/fsdp2/testing_access.h.
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
  // PyTorch 2.15's manual backward finalization (on the root; set before the backward): no
  // backward reduce-scatters or ends the iteration on its own; finalize_backward() does, with
  // the gradient-sync and reshard settings current then. A pipeline stage accumulates its
  // microbatches' gradients with set_requires_gradient_sync(false) and reduces them once
  // (torch/distributed/pipelining/stage.py start_gradient_reduction). finalize_backward is
  // synchronous (PyTorch's async_op=False) and a no-op before the first forward.
  void set_manual_backward_finalization(bool enabled);
  void finalize_backward();
  void set_gradient_divide_factor(double factor);
  // PyTorch 2.15 keeps this older name as an alias of set_gradient_divide_factor.
  void set_reduce_scatter_divide_factor(double factor) { set_gradient_divide_factor(factor); }
  // Only SUM reductions in the collectives (the division becomes a separate pre/post
  // scaling), e.g. for zero-copy NCCL; this module's group only, as PyTorch 2.15's
  // FSDPModule.set_force_sum_reduction_for_comms.
  void set_force_sum_reduction_for_comms(bool enable);
  void set_unshard_in_backward(bool unshard_in_backward);
  // PyTorch 2.15's FSDPModule._set_unshard_async_op, for this module and every FSDP module
  // under it: true issues the implicit pre-forward / pre-backward all-gathers with
  // async_op=True (on the compute stream, waited at use). On the CPU that keeps them in
  // flight while the host computes, which the default (false) does not: PyTorch's Gloo call
  // with async_op=False returns finished, and so do ours (ProcessGroupGloo's temporary copy
  // of the whole output is then gone before the next module's gradients exist).
  void set_unshard_async_op(bool async_op);
  // PyTorch 2.15's FSDPModule.set_all_reduce_hook: `hook` gets this group's reduced gradient
  // buffer (the flat reduce-dtype output, padded shards of every parameter in group order)
  // and may change it in place: with HSDP / replicate after the native replicate all-reduce,
  // with FSDP after the reduce-scatter (e.g. a custom all-reduce over another group). It runs
  // on the all-reduce stream, before the post-division and the gradient accumulation; not
  // during HSDP partial accumulation (set_requires_all_reduce(false)). An empty hook removes
  // it. PyTorch's `stream` argument has no counterpart: the hook always runs on FSDP's
  // all-reduce stream. Not recursive (this module's group only, as PyTorch). A collective
  // inside the hook is issued from that stream outside FSDP's collective sequencer: give it
  // a group FSDP does not use from another stream (e.g. the replicate group with 1-D FSDP
  // over the shard group), or ranks may order it differently.
  void set_all_reduce_hook(std::function<void(const at::Tensor& reduce_output)> hook);
  // PyTorch 2.15's FSDPModule.set_post_optim_event: the root's next forward makes the
  // all-gather streams wait for `event` (recorded after the optimizer step, e.g. on the
  // stream the step ran on) instead of for the whole compute stream, then drops it: set a
  // new one each iteration. On the CPU build with inline streams a wait is a host wait; any
  // device::Event works (device/stream.h). Null clears a pending event.
  void set_post_optim_event(device::EventPtr event);

  // This module's FSDP pre/post-forward hook pair (what run_fsdp_forward_method runs).
  ::fsdp::ForwardHook& forward_hook() const;

 private:
  // Tests reach the runtime through FSDPModuleTestAccess (fsdp/fsdp2/testing_access.h,
  // testonly); the runtime internals are no API.
  friend struct FSDPModuleTestAccess;
  FSDPState* state() const;
  FSDPParamGroup* param_group() const;
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

// PyTorch 2.15's fully_shard(list[nn.Module]): ONE FSDP group over the parameters of all of
// `modules` (one all-gather and one reduce-scatter for them together), e.g. an attention's
// q/k/v projections, or fully_shard({norm, head}) for chunked loss. The state is shared: each
// listed module gets FSDP's hooks. The first of them to run forward in a pass unshards (and
// registers the post-backward on its inputs); the group reshards after the last of them
// finished forward. A module of the list may not run at all (or run again later, per chunk):
// the iteration's forward root completes the group in its post-forward. Returns one handle
// per listed module (all the same group, as PyTorch returns the list). Listed modules nested
// in another listed module are managed through it and get no hooks (PyTorch's
// _get_root_modules). Errors: an empty list, a null or repeated entry, a listed module that
// cannot run hooks or is already fully_shard'ed. A group of several modules cannot be the
// root: fully_shard their common parent too ("FSDP requires a single root module").
std::vector<FSDPModule> fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                                    FullyShardOptions options);
// fully_shard({a.ptr(), b.ptr()}, options): a braced list is the list form (without this
// overload, {m.ptr()} would be ambiguous with the single-module form).
std::vector<FSDPModule> fully_shard(std::initializer_list<std::shared_ptr<torch::nn::Module>> modules,
                                    FullyShardOptions options);

// Forward arguments and outputs are searched for tensors with fsdp::ForwardTensors
// (fsdp/hooked_module/forward_tensors.h; specialize it there for other types).
using ::fsdp::ForwardTensors;

// The handle of a module fully_shard'ed earlier (PyTorch's isinstance(m, FSDPModule)), or
// nullopt.
std::optional<FSDPModule> AsFSDPModule(torch::nn::Module& module);

// What one fully_shard call manages, for logs and checks: FSDP2's counterpart of printing
// `model` in Python, where each FSDPModule's parameters show as DTensors.
struct FSDPParamInfo {
  std::string fqn;                   // the parameter's name in root.named_parameters()
  std::vector<int64_t> shard_shape;  // this rank's shard (unpadded)
  c10::ScalarType dtype;             // the sharded parameter's (the optimizer's) dtype
  // The sharded parameter's DTensor layout: the FSDP mesh (and tensor-parallel dims) and the
  // global shape (unsharded, and across tensor parallelism), e.g. for a reduction over all its
  // shards (float8's scale precompute).
  dtensor::DTensorSpec sharding_spec;
};
struct FSDPGroupInfo {
  // The FQN of each module of the call (one; several for fully_shard(list)); "" is root.
  std::vector<std::string> module_fqns;
  std::vector<FSDPParamInfo> params;  // in the group's order (the all-gather's)
};
// The FSDP groups of `root`'s module tree (root included), in module order, each once.
// Names come from root's module tree, so they are right before the first forward too; a
// parameter shared by several modules is listed once under its first name. Local, no
// communication; call between steps (not inside forward / backward). Throws a c10::Error
// when a fully_shard(list) call spans modules outside root's tree.
std::vector<FSDPGroupInfo> ListFSDPGroups(torch::nn::Module& root);

// PyTorch 2.15's register_fsdp_forward_method (_fully_shard.py), without monkey-patching:
// runs `body` (a method other than forward, e.g. generate / encode) between the module's FSDP
// pre-forward and post-forward, exactly as forward runs: all-gather (and the root's lazy
// init), input casts, post-backward registration before; reshard per reshard_after_forward,
// output cast and pre-backward hooks after. `body` is called with copies of `args` whose
// tensors went through the pre-forward; R is its result type (tensors, per ForwardTensors).
// Only FSDP's hooks run, not the module's other forward hooks (as PyTorch's patch calls
// fsdp_state._pre_forward / _post_forward only). `body` must not call this module's own
// hooked forward (that would run the hooks twice); it may call submodules normally.
//
//   at::Tensor y = run_fsdp_forward_method<at::Tensor>(
//       *model, [&](const at::Tensor& x) { return model->encode(x); }, x);
template <class R, class Body, class... Args>
R run_fsdp_forward_method(const FSDPModule& module, Body&& body, Args&&... args) {
  ::fsdp::ForwardHook& hook = module.forward_hook();
  return ::fsdp::RunForwardAround<R>([&hook](std::vector<at::Tensor> a) { return hook.PreForward(std::move(a)); },
                                     [&hook](const std::vector<at::Tensor*>& outs) { hook.PostForward(outs); },
                                     std::forward<Body>(body), std::forward<Args>(args)...);
}
// The same for a module that may not be fully_shard'ed: without FSDP it just calls `body`
// (PyTorch's register_fsdp_forward_method is a no-op on a module that is not an FSDPModule,
// so one code path serves both).
template <class R, class Body, class... Args>
R run_fsdp_forward_method(torch::nn::Module& module, Body&& body, Args&&... args) {
  std::optional<FSDPModule> handle = AsFSDPModule(module);
  if (!handle) return std::forward<Body>(body)(args...);
  return run_fsdp_forward_method<R>(*handle, std::forward<Body>(body), std::forward<Args>(args)...);
}

}  // namespace fsdp::fsdp2

#endif  // FSDP_FSDP_FSDP2_FULLY_SHARD_H_
