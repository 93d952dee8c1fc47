// Checkpointing a module: the C++ counterpart of PyTorch's CheckpointWrapper /
// apply_activation_checkpointing (torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py).
//
//   using CkptBlock = fsdp::activation_checkpointing::Checkpointed<BlockImpl>;   // a module type
//   CkptBlock block(5, 7);            // forward = checkpoint(BlockImpl::forward), same signature
//   fsdp::fsdp2::fully_shard(block.ptr(), {.mesh = mesh});   // FSDP2 hooks wrap the checkpoint
//   fsdp::activation_checkpointing::apply_activation_checkpointing(*model, pred, /*enabled=*/false);
//
// Checkpointed<Impl> is fsdp::Hooked<CheckpointedImpl<Impl>>: the checkpoint sits inside the
// hooked-module layer, so every forward hook (FSDP2's fully_shard, FSDP1's wrap_fsdp) runs
// outside it, which is the order PyTorch users get from checkpoint_wrapper(block) followed by
// fully_shard(wrapper) (torchtitan's apply_ac then apply_fsdp):
//   forward:  FSDP pre-forward (all-gather, arms the post-backward)
//             -> checkpoint(Impl::forward) under no-grad -> FSDP post-forward (reshard,
//             pre-backward hooks on the outputs, which require grad through the checkpoint)
//   backward: FSDP pre-backward (all-gather) -> checkpoint backward: Impl::forward again on the
//             unsharded parameters, no FSDP hook involved, nested backward accumulates the
//             unsharded gradients -> FSDP post-backward (reduce-scatter) once every
//             parameter's gradient is accumulated (fsdp/common/autograd_hooks.h).
// So checkpointing adds no collective: the recomputation reuses the all-gather of the
// pre-backward (fsdp2_checkpoint_test.cc counts them).
// The other order, checkpoint() around fully_shard'ed modules, trains correctly too: the first
// forward's FSDP hooks run under no-grad (no pre-backward hooks registered), the recomputation
// runs FSDP's pre/post-forward again in state IDLE (fsdp_state.cc's PRE_BACKWARD early return
// does not apply: the module's pre-backward fires only on the recomputed outputs), so with
// reshard_after_forward each such module all-gathers once more per step than without
// checkpointing. Avoiding that needs fsdp/fsdp2 to skip the post-forward reshard during a
// recomputation (PyTorch's non-reentrant checkpoint pays it too, for all but the last module). Parameter names are
// Impl's own (PyTorch's wrapper adds
// "_checkpoint_wrapped_module." and strips it again in its state-dict hooks).
//
// Why a module type and not a ForwardHook: a hook sees tensors before and after the body but
// cannot run the body itself (no arguments to recompute with, no way to run it under no-grad
// exception-safely); an "around" hook in fsdp/hooked_module/hooked_module.h would allow attaching
// checkpointing to any Hooked module at run time.
#ifndef FSDP_FSDP_ACTIVATION_CHECKPOINTING_CHECKPOINT_WRAPPER_H_
#define FSDP_FSDP_ACTIVATION_CHECKPOINTING_CHECKPOINT_WRAPPER_H_

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/activation_checkpointing/checkpoint.h"
#include "fsdp/hooked_module/forward_tensors.h"
#include "fsdp/hooked_module/hooked_module.h"

namespace fsdp::activation_checkpointing {

// Mix-in of every checkpointed module: the switch and the options of its checkpoint.
class CheckpointableModule {
 public:
  virtual ~CheckpointableModule() = default;
  bool checkpointing_enabled() const { return enabled_; }
  void set_checkpointing_enabled(bool enabled) { enabled_ = enabled; }
  // preserve_rng_state / determinism_check of every call (params is filled in per call with
  // the module's parameters, so outputs require grad exactly when something upstream does).
  const CheckpointOptions& checkpoint_options() const { return options_; }
  void set_checkpoint_options(CheckpointOptions options) { options_ = std::move(options); }

 private:
  bool enabled_ = true;
  CheckpointOptions options_;
};

namespace internal {

// Runs `body` (Impl::forward on a tuple of argument copies) through checkpoint_multi: the
// tensors among the arguments are the checkpoint's inputs; the non-tensor arguments and the
// output's non-tensor parts are those of the first forward.
template <class R, class Body, class... Args>
R CheckpointForward(const CheckpointableModule& ckpt, const torch::nn::Module& module, Body body, Args&&... args) {
  static_assert(ForwardTensors<std::decay_t<R>>::kHasTensors,
                "a checkpointed module's forward must return tensors (specialize fsdp::ForwardTensors)");
  using Tuple = std::tuple<std::decay_t<Args>...>;
  auto copies = std::make_shared<Tuple>(std::forward<Args>(args)...);
  std::vector<at::Tensor> inputs;
  for (at::Tensor* t : CollectForwardTensors(*copies)) inputs.push_back(*t);
  // The first forward's output, whose tensors are then replaced by the checkpoint's outputs.
  struct FirstOutput {
    std::optional<std::decay_t<R>> value;
    bool taken = false;  // by this call: a recomputation's output is not kept
  };
  auto first = std::make_shared<FirstOutput>();
  CheckpointMultiFn fn = [copies, first, body](const std::vector<at::Tensor>& in) {
    Tuple local = *copies;  // recomputations never see the tensors of an earlier call
    const std::vector<at::Tensor*> slots = CollectForwardTensors(local);
    for (size_t i = 0; i < slots.size(); ++i) *slots[i] = in[i];
    std::decay_t<R> out = std::apply(body, local);
    std::vector<at::Tensor*> outs;
    ForwardTensors<std::decay_t<R>>::Collect(out, outs);
    std::vector<at::Tensor> result;
    for (at::Tensor* t : outs) result.push_back(*t);
    if (!first->taken) first->value.emplace(std::move(out));
    return result;
  };
  CheckpointOptions options = ckpt.checkpoint_options();
  options.params = module.parameters(/*recurse=*/true);
  std::vector<at::Tensor> outs = checkpoint_multi(std::move(fn), inputs, std::move(options));
  std::decay_t<R> result = std::move(*first->value);
  // `fn` lives as long as the autograd node, whose saved data outlives its backward: keeping a
  // recomputed output there, or the tensors of `copies` (the recomputation takes them from the
  // checkpoint's saved inputs, which backward releases), would keep each checkpointed module's
  // input and recomputed activations until the whole graph is freed.
  first->value.reset();
  first->taken = true;
  for (at::Tensor* t : CollectForwardTensors(*copies)) *t = at::Tensor();
  std::vector<at::Tensor*> slots;
  ForwardTensors<std::decay_t<R>>::Collect(result, slots);
  TORCH_CHECK(slots.size() == outs.size(), "checkpointed forward: ", outs.size(), " outputs for ", slots.size(),
              " output tensors");
  for (size_t i = 0; i < slots.size(); ++i) *slots[i] = std::move(outs[i]);
  return result;
}

}  // namespace internal

// `Impl` whose forward (same signature, const or not) runs through checkpoint() while
// checkpointing is enabled and grad mode is on; otherwise exactly Impl::forward.
template <class Impl, class Signature = decltype(&Impl::forward)>
class CheckpointedImpl;

template <class Impl, class R, class C, class... A>
class CheckpointedImpl<Impl, R (C::*)(A...)> : public Impl, public CheckpointableModule {
 public:
  using Impl::Impl;
  R forward(A... args) {
    if (!checkpointing_enabled() || !at::GradMode::is_enabled()) return Impl::forward(std::forward<A>(args)...);
    return internal::CheckpointForward<R>(
        *this, *this, [this](auto&... a) -> R { return Impl::forward(a...); }, std::forward<A>(args)...);
  }
};

template <class Impl, class R, class C, class... A>
class CheckpointedImpl<Impl, R (C::*)(A...) const> : public Impl, public CheckpointableModule {
 public:
  using Impl::Impl;
  R forward(A... args) const {
    if (!checkpointing_enabled() || !at::GradMode::is_enabled()) return Impl::forward(std::forward<A>(args)...);
    return internal::CheckpointForward<R>(
        *this, *this, [this](auto&... a) -> R { return Impl::forward(a...); }, std::forward<A>(args)...);
  }
};

// The module holder: a Hooked module (FSDP can attach to it) whose forward is checkpointed.
template <class Impl>
class Checkpointed : public Hooked<CheckpointedImpl<Impl>> {
 public:
  using Hooked<CheckpointedImpl<Impl>>::Hooked;
};

// The checkpointed module `module` is (null if it is no Checkpointed<...>).
inline CheckpointableModule* AsCheckpointable(torch::nn::Module& module) {
  return dynamic_cast<CheckpointableModule*>(&module);
}

// Enables (or disables) checkpointing on every Checkpointed module of `root`'s tree (root
// included) for which `predicate(qualified name, module)` holds (PyTorch's check_fn; an empty
// predicate selects all). Returns how many modules it set. A module type cannot change at run
// time in C++, so this switches modules built as Checkpointed<Impl> rather than wrapping any.
int apply_activation_checkpointing(
    torch::nn::Module& root,
    const std::function<bool(const std::string& name, torch::nn::Module& module)>& predicate = nullptr,
    bool enabled = true);

}  // namespace fsdp::activation_checkpointing

#endif  // FSDP_FSDP_ACTIVATION_CHECKPOINTING_CHECKPOINT_WRAPPER_H_
