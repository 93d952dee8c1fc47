// The hooked-module layer: forward pre/post hooks for torch::nn modules, the C++ stand-in for
// nn.Module.register_forward_pre_hook / register_forward_hook (LibTorch has neither).
//
//   struct BlockImpl : torch::nn::Module { at::Tensor forward(const at::Tensor& x); ... };
//   using Block = fsdp::Hooked<BlockImpl>;      // a BlockImpl whose forward runs hooks
//   Block block(5, 7);                            // no hooks: exactly BlockImpl::forward
//   fsdp::fsdp2::fully_shard(block.ptr(), {.mesh = mesh});   // FSDP2 adds its hook, or
//   fsdp::fsdp1::wrap_fsdp(block.ptr(), {.process_group = pg});   // FSDP1 does
//
// One model type serves FSDP2 (fully_shard), FSDP1 (wrap_fsdp), activation checkpointing and
// no wrapper at all: each attaches a ForwardHook to the module instead of needing its own
// wrapper class. HookedImpl<Impl> takes its forward's exact signature from &Impl::forward
// (const or not), so the module works in Sequential / AnyModule / ModuleHolder::operator(),
// and its parameter names are Impl's own (no wrapper level in FQNs).
//
// Order: hooks nest like wrappers. forward_hooks() lists them outermost first; PreForward runs
// outermost to innermost, then Impl::forward, then PostForward innermost to outermost. A hook
// added with HookPosition::kOutermost wraps every hook already there (PyTorch's prepend=True
// for the pre-hook together with a post-hook that runs last).
//
// Contract: adding or removing hooks is not thread-safe and must not happen from inside the
// module's own forward; forward itself may run concurrently only if every hook allows it
// (FSDP's do not). A hook's PreForward must return as many tensors as it received.
//
// Forward replacement: a module instance's own forward (the body between its hooks) can be
// replaced by a ForwardReplacement of the same signature. This is how
// float8::convert_to_float8_training turns a Linear into a float8 linear in place: PyTorch
// swaps the module object, but a C++ model's members are typed holders, so here the module,
// its parameters and FQNs stay and its forward changes.
// Forward arguments and outputs are searched for tensors with fsdp::ForwardTensors
// (fsdp/hooked_module/forward_tensors.h; specialize it for other types); with hooks attached the
// forward must return tensors (a static_assert says so).
#ifndef FSDP_FSDP_HOOKED_MODULE_HOOKED_MODULE_H_
#define FSDP_FSDP_HOOKED_MODULE_HOOKED_MODULE_H_

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/hooked_module/forward_tensors.h"

namespace fsdp {

// A pre/post-forward hook pair attached to a HookedModule.
class ForwardHook {
 public:
  virtual ~ForwardHook() = default;
  // Before the module's forward: the tensor arguments in order; returns them (same count),
  // possibly replaced (cast, wrapped in autograd Functions).
  virtual std::vector<at::Tensor> PreForward(std::vector<at::Tensor> args) { return args; }
  // After the module's forward: the output's tensors, which the hook may replace in place.
  virtual void PostForward(const std::vector<at::Tensor*>& outputs) {}
};

enum class HookPosition { kInnermost, kOutermost };

// The untyped base of a forward replacement (see the contract above).
class ForwardReplacementBase {
 public:
  virtual ~ForwardReplacementBase() = default;
};

// Replaces the forward `R forward(A...)` of one HookedImpl instance.
template <class R, class... A>
class ForwardReplacement : public ForwardReplacementBase {
 public:
  virtual R Forward(A... args) = 0;
};

// Mix-in base of every module that runs forward hooks (HookedImpl<Impl> derives from it).
class HookedModule {
 public:
  virtual ~HookedModule() = default;

  // Attaches `hook` (not null, not already attached: errors otherwise) at `position`.
  void AddForwardHook(std::shared_ptr<ForwardHook> hook, HookPosition position = HookPosition::kInnermost);
  // Detaches `hook`; false if it was not attached.
  bool RemoveForwardHook(const ForwardHook* hook);
  // Outermost first.
  const std::vector<std::shared_ptr<ForwardHook>>& forward_hooks() const { return hooks_; }
  bool has_forward_hooks() const { return !hooks_.empty(); }
  // The first attached hook whose dynamic type is (or derives from) H, or null.
  template <class H>
  std::shared_ptr<H> FindForwardHook() const {
    for (const auto& h : hooks_) {
      if (auto typed = std::dynamic_pointer_cast<H>(h)) return typed;
    }
    return nullptr;
  }

  // Replaces this module's own forward with `replacement` (null restores it). Errors if its
  // type is not ForwardReplacement<R, A...> for the module's forward `R forward(A...)`.
  void SetForwardReplacement(std::shared_ptr<ForwardReplacementBase> replacement);
  const std::shared_ptr<ForwardReplacementBase>& forward_replacement() const { return replacement_; }

  // Runs the hooks around `body` (the wrapped forward, called with copies of `args` whose
  // tensors went through the PreForwards) and hands the output's tensors to the PostForwards.
  template <class R, class Body, class... Args>
  R RunForwardHooks(Body&& body, Args&&... args) const;

 private:
  std::vector<at::Tensor> RunPreForward(std::vector<at::Tensor> args) const;
  void RunPostForward(const std::vector<at::Tensor*>& outputs) const;

  // Whether `replacement` has the ForwardReplacement type of this module's forward.
  virtual bool AcceptsReplacement(const ForwardReplacementBase& replacement) const = 0;

  std::vector<std::shared_ptr<ForwardHook>> hooks_;

 protected:
  std::shared_ptr<ForwardReplacementBase> replacement_;
};

// The HookedModule base of `module`, or null if its type cannot run hooks.
inline HookedModule* AsHooked(torch::nn::Module& module) { return dynamic_cast<HookedModule*>(&module); }
// The forward replacement of `module` if it has one of type T, or null.
template <class T>
std::shared_ptr<T> FindForwardReplacement(torch::nn::Module& module) {
  HookedModule* hooked = AsHooked(module);
  return hooked ? std::dynamic_pointer_cast<T>(hooked->forward_replacement()) : nullptr;
}
// The first hook of type H attached to `module`, or null.
template <class H>
std::shared_ptr<H> FindForwardHook(torch::nn::Module& module) {
  HookedModule* hooked = AsHooked(module);
  return hooked ? hooked->template FindForwardHook<H>() : nullptr;
}

// The hooks of type H attached to the modules of `root`'s tree (root included), in module
// pre-order (torch::nn::Module::named_modules order): each FSDP's CollectStates.
template <class H>
std::vector<H*> CollectForwardHooks(torch::nn::Module& root) {
  std::vector<H*> found;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    if (auto hook = FindForwardHook<H>(*item.value())) found.push_back(hook.get());
  }
  return found;
}

template <class R, class Body, class... Args>
R HookedModule::RunForwardHooks(Body&& body, Args&&... args) const {
  return RunForwardAround<R>([this](std::vector<at::Tensor> a) { return RunPreForward(std::move(a)); },
                             [this](const std::vector<at::Tensor*>& outs) { RunPostForward(outs); },
                             std::forward<Body>(body), std::forward<Args>(args)...);
}

// `Impl` whose forward (same signature, const or not) runs the attached hooks; with none it
// is exactly Impl::forward.
template <class Impl, class Signature = decltype(&Impl::forward)>
class HookedImpl;

template <class Impl, class R, class C, class... A>
class HookedImpl<Impl, R (C::*)(A...)> : public Impl, public HookedModule {
 public:
  using Impl::Impl;
  using Replacement = ForwardReplacement<R, A...>;
  R forward(A... args) {
    if (!has_forward_hooks()) return Body(std::forward<A>(args)...);
    return RunForwardHooks<R>([this](auto&... a) -> R { return Body(a...); }, std::forward<A>(args)...);
  }

 private:
  template <class... B>
  R Body(B&&... args) {
    if (replacement_) return static_cast<Replacement&>(*replacement_).Forward(std::forward<B>(args)...);
    return Impl::forward(std::forward<B>(args)...);
  }
  bool AcceptsReplacement(const ForwardReplacementBase& r) const override {
    return dynamic_cast<const Replacement*>(&r) != nullptr;
  }
};

template <class Impl, class R, class C, class... A>
class HookedImpl<Impl, R (C::*)(A...) const> : public Impl, public HookedModule {
 public:
  using Impl::Impl;
  using Replacement = ForwardReplacement<R, A...>;
  R forward(A... args) const {
    if (!has_forward_hooks()) return Body(std::forward<A>(args)...);
    return RunForwardHooks<R>([this](auto&... a) -> R { return Body(a...); }, std::forward<A>(args)...);
  }

 private:
  template <class... B>
  R Body(B&&... args) const {
    if (replacement_) return static_cast<Replacement&>(*replacement_).Forward(std::forward<B>(args)...);
    return Impl::forward(std::forward<B>(args)...);
  }
  bool AcceptsReplacement(const ForwardReplacementBase& r) const override {
    return dynamic_cast<const Replacement*>(&r) != nullptr;
  }
};

// The module holder of HookedImpl<Impl> (as TORCH_MODULE makes one for an Impl).
template <class Impl>
class Hooked : public torch::nn::ModuleHolder<HookedImpl<Impl>> {
 public:
  using torch::nn::ModuleHolder<HookedImpl<Impl>>::ModuleHolder;
};

}  // namespace fsdp

#endif  // FSDP_FSDP_HOOKED_MODULE_HOOKED_MODULE_H_
