// Creating a custom autograd Node the same way on every supported LibTorch.
//
//   auto node = fsdp::torch_compat::MakeNode<MyBackward>(args...);
//   node->set_next_edges(torch::autograd::collect_next_edges(inputs));
//   torch::autograd::set_history(output, node);
//
// Contract: MakeNode returns the owning pointer type that torch::autograd::set_history and
// Node::set_next_edges take on the LibTorch being compiled against. PyTorch 2.15's Node is a
// c10::intrusive_ptr_target (set_history takes c10::intrusive_ptr<Node>); 2.11's is owned by
// std::shared_ptr (set_history takes std::shared_ptr<Node>). The choice is made from the
// class hierarchy, so a release in between compiles either way. No runtime cost.
// Thread-safety: as the pointer types themselves.
#pragma once

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace fsdp::torch_compat {

// True where autograd nodes are reference-counted intrusively (PyTorch 2.15).
inline constexpr bool kIntrusiveAutogradNodes = std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>;

// The owning pointer to a Node on this LibTorch.
using NodePtr = std::conditional_t<kIntrusiveAutogradNodes, c10::intrusive_ptr<torch::autograd::Node>,
                                   std::shared_ptr<torch::autograd::Node>>;

// A new T (a subclass of torch::autograd::Node) as the pointer set_history takes.
template <class T, class... Args>
NodePtr MakeNode(Args&&... args) {
  static_assert(std::is_base_of_v<torch::autograd::Node, T>, "MakeNode<T>: T must derive from torch::autograd::Node");
  if constexpr (kIntrusiveAutogradNodes) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    return std::make_shared<T>(std::forward<Args>(args)...);
  }
}

}  // namespace fsdp::torch_compat
