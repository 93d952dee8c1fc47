// FSDPStateBase: what both FSDPs attach to a module (FSDP2's fsdp2::FSDPState, FSDP1's
// fsdp1::FSDPState): a forward hook on the hooked-module layer, plus the poisoning guard.
//
// Poisoning: after an error inside an FSDP hook (a failed or timed-out collective, a bad
// input seen in pre-forward, ...) parameters may be unsharded and gradients partially
// reduced, so every later FSDP call of the tree fails with the first error instead of
// computing garbage or hanging in a collective the other ranks never join. The record is a
// string shared by every state under one root (each FSDP keeps it in its root context).
//
// Ownership: the module's hook list owns the state (shared_ptr); handles (FSDPModule,
// FullyShardedDataParallel) keep weak references, so using a handle after its module is
// destroyed is a clear error. Not thread-safe (like the module it hooks).
#ifndef FSDP_FSDP_COMMON_FSDP_STATE_BASE_H_
#define FSDP_FSDP_COMMON_FSDP_STATE_BASE_H_

#include <c10/util/Exception.h>

#include <exception>
#include <memory>
#include <string>

#include "fsdp/hooked_module/hooked_module.h"

namespace fsdp {

class FSDPStateBase : public ForwardHook, public std::enable_shared_from_this<FSDPStateBase> {
 public:
  // "fully_shard" or "wrap_fsdp": which API attached the state (for messages).
  virtual const char* api_name() const = 0;

  // Throws if an earlier hook error poisoned this tree, naming `caller`, that error and how
  // to recover.
  void CheckNotPoisoned(const char* caller) const;

 protected:
  // `unsharded_what`: what may be left unsharded ("parameters", "flat parameters").
  explicit FSDPStateBase(const char* unsharded_what) : unsharded_what_(unsharded_what) {}

  // The poison record shared by this state's tree. It may be replaced by lazy init (the
  // root's context becomes shared), so it is looked up again after every hook body.
  virtual std::string& poison_record() const = 0;

  // Runs the hook body `fn` after CheckNotPoisoned(where); an exception poisons the tree
  // (the first error wins) and propagates.
  template <class Fn>
  auto Guard(const char* where, Fn&& fn) -> decltype(fn());

 private:
  void Poison(const char* where, const char* what) const;
  const char* unsharded_what_;
};

template <class Fn>
auto FSDPStateBase::Guard(const char* where, Fn&& fn) -> decltype(fn()) {
  CheckNotPoisoned(where);
  try {
    return fn();
  } catch (const c10::Error& e) {
    Poison(where, e.what_without_backtrace());
    throw;
  } catch (const std::exception& e) {
    Poison(where, e.what());
    throw;
  }
}

// A weak reference to the FSDP state of type State that a handle holds: Get() fails clearly
// once the module (which owns the state) is gone, or if the handle is empty.
template <class State>
class StateRef {
 public:
  StateRef() = default;
  explicit StateRef(State* state)
      : state_(state ? std::static_pointer_cast<State>(state->shared_from_this()) : nullptr), set_(state != nullptr) {}
  // `handle`: the handle's type for messages, e.g. "FSDPModule".
  State* Get(const char* handle) const {
    TORCH_CHECK(set_, handle, ": empty handle (use the one returned when the module was sharded)");
    auto locked = state_.lock();
    TORCH_CHECK(locked != nullptr, handle, ": the module this handle was returned for has been destroyed");
    return locked.get();
  }
  bool empty() const { return !set_; }

 private:
  std::weak_ptr<State> state_;
  bool set_ = false;
};

}  // namespace fsdp

#endif  // FSDP_FSDP_COMMON_FSDP_STATE_BASE_H_
