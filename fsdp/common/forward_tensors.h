// ForwardTensors<T>: finds the tensors inside a module's forward arguments and outputs, so
// the forward wrappers of both FSDPs (FSDP2's FullyShardedImpl, FSDP1's FSDPWrappedImpl) can
// hook them. Specialize it for other argument / output types.
#ifndef FSDP_FSDP_COMMON_FORWARD_TENSORS_H_
#define FSDP_FSDP_COMMON_FORWARD_TENSORS_H_

#include <ATen/core/Tensor.h>

#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp {

template <class T, class = void>
struct ForwardTensors {  // types without tensors pass through untouched
  static constexpr bool kHasTensors = false;
  static void Collect(T&, std::vector<at::Tensor*>&) {}
};
template <>
struct ForwardTensors<at::Tensor> {
  static constexpr bool kHasTensors = true;
  static void Collect(at::Tensor& t, std::vector<at::Tensor*>& out) { out.push_back(&t); }
};
template <>
struct ForwardTensors<std::vector<at::Tensor>> {
  static constexpr bool kHasTensors = true;
  static void Collect(std::vector<at::Tensor>& v, std::vector<at::Tensor*>& out) {
    for (auto& t : v) out.push_back(&t);
  }
};
template <class... Ts>
struct ForwardTensors<std::tuple<Ts...>> {
  static constexpr bool kHasTensors = true;
  static void Collect(std::tuple<Ts...>& t, std::vector<at::Tensor*>& out) {
    std::apply([&](auto&... e) { (ForwardTensors<std::decay_t<decltype(e)>>::Collect(e, out), ...); }, t);
  }
};
template <class A, class B>
struct ForwardTensors<std::pair<A, B>> {
  static constexpr bool kHasTensors = true;
  static void Collect(std::pair<A, B>& p, std::vector<at::Tensor*>& out) {
    ForwardTensors<A>::Collect(p.first, out);
    ForwardTensors<B>::Collect(p.second, out);
  }
};

// Pointers to the tensors among `args` (a tuple of forward arguments), in order.
template <class... Ts>
std::vector<at::Tensor*> CollectForwardTensors(std::tuple<Ts...>& args) {
  std::vector<at::Tensor*> slots;
  std::apply([&](auto&... a) { (ForwardTensors<std::decay_t<decltype(a)>>::Collect(a, slots), ...); }, args);
  return slots;
}

// The body of both FSDPs' forward wrappers: runs `body` (the wrapped module's forward) on
// copies of `args` whose tensors went through state->PreForward (casts, autograd hooks), and
// hands the output's tensors to state->PostForward (which may replace them in place).
template <class R, class State, class Body, class... Args>
R RunForwardWithHooks(State* state, Body&& body, Args&&... args) {
  std::tuple<std::decay_t<Args>...> copies(std::forward<Args>(args)...);
  const std::vector<at::Tensor*> slots = CollectForwardTensors(copies);
  std::vector<at::Tensor> inputs;
  for (at::Tensor* t : slots) inputs.push_back(*t);
  inputs = state->PreForward(std::move(inputs));
  for (size_t i = 0; i < slots.size(); ++i) *slots[i] = inputs[i];
  R output = std::apply(std::forward<Body>(body), copies);
  static_assert(ForwardTensors<std::decay_t<R>>::kHasTensors,
                "an FSDP module's forward must return tensors (specialize fsdp::ForwardTensors)");
  std::vector<at::Tensor*> outs;
  ForwardTensors<std::decay_t<R>>::Collect(output, outs);
  state->PostForward(outs);
  return output;
}

}  // namespace fsdp

#endif  // FSDP_FSDP_COMMON_FORWARD_TENSORS_H_
