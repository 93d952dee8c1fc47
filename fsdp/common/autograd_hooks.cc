#include "fsdp/common/autograd_hooks.h"

#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <utility>

namespace fsdp {
namespace {

// Carries the callback through the autograd context (saved_data holds IValues).
struct CallbackRef : torch::CustomClassHolder {
  explicit CallbackRef(std::function<void()> f) : fn(std::move(f)) {}
  std::function<void()> fn;
};

// Identity on its tensor inputs; its backward runs once all of them have gradients.
struct PostBackwardFunction : torch::autograd::Function<PostBackwardFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<CallbackRef> callback, at::TensorList inputs) {
    ctx->saved_data["callback"] = c10::IValue::make_capsule(std::move(callback));
    return inputs.vec();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto ref = c10::static_intrusive_pointer_cast<CallbackRef>(ctx->saved_data["callback"].toCapsule());
    ref->fn();
    grads.insert(grads.begin(), at::Tensor());  // no gradient for the callback argument
    return grads;
  }
};

}  // namespace

std::vector<at::Tensor> RegisterPostBackwardCallback(const std::vector<at::Tensor>& inputs,
                                                     std::function<void()> callback) {
  if (!at::GradMode::is_enabled()) return inputs;
  std::vector<size_t> indices;
  std::vector<at::Tensor> needing;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined() && inputs[i].requires_grad()) {
      indices.push_back(i);
      needing.push_back(inputs[i]);
    }
  }
  if (needing.empty()) return inputs;
  // at::TensorList (not std::vector) so Function::apply treats them as autograd inputs.
  auto wrapped =
      PostBackwardFunction::apply(c10::make_intrusive<CallbackRef>(std::move(callback)), at::TensorList(needing));
  std::vector<at::Tensor> out = inputs;
  for (size_t k = 0; k < indices.size(); ++k) out[indices[k]] = wrapped[k];
  return out;
}

void QueueEndOfBackwardCallback(std::function<void()> callback) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

}  // namespace fsdp
