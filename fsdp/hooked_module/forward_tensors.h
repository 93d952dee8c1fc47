// ForwardTensors<T>: finds the tensors inside a module's forward arguments and outputs, so
// forward hooks (fsdp/hooked_module/hooked_module.h) can see and replace them. Specialize it for
// other argument / output types.
#ifndef FSDP_FSDP_HOOKED_MODULE_FORWARD_TENSORS_H_
#define FSDP_FSDP_HOOKED_MODULE_FORWARD_TENSORS_H_

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

// Runs `body` (a module's forward) on copies of `args` whose tensors went through `pre`
// (std::vector<at::Tensor> in argument order -> the same count, possibly replaced), and hands
// the output's tensors to `post` (which may replace them in place). The one implementation
// behind the hooked-module layer (HookedModule::RunForwardHooks) and FSDP2's
// run_fsdp_forward_method.
template <class R, class Pre, class Post, class Body, class... Args>
R RunForwardAround(Pre&& pre, Post&& post, Body&& body, Args&&... args) {
  static_assert(ForwardTensors<std::decay_t<R>>::kHasTensors,
                "a hooked module's forward must return tensors (specialize fsdp::ForwardTensors)");
  std::tuple<std::decay_t<Args>...> copies(std::forward<Args>(args)...);
  const std::vector<at::Tensor*> slots = CollectForwardTensors(copies);
  std::vector<at::Tensor> inputs;
  inputs.reserve(slots.size());
  for (at::Tensor* t : slots) inputs.push_back(*t);
  inputs = pre(std::move(inputs));
  for (size_t i = 0; i < slots.size(); ++i) *slots[i] = std::move(inputs[i]);
  R output = std::apply(std::forward<Body>(body), copies);
  std::vector<at::Tensor*> outs;
  ForwardTensors<std::decay_t<R>>::Collect(output, outs);
  post(outs);
  return output;
}

}  // namespace fsdp

#endif  // FSDP_FSDP_HOOKED_MODULE_FORWARD_TENSORS_H_
