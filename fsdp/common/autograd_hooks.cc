#include "fsdp/common/autograd_hooks.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "torch_compat/autograd_node.h"

namespace fsdp {
namespace {

// Identity on its inputs; runs the callback when autograd reaches it, i.e. once every
// output's gradient is computed, then passes the gradients on. A purpose-built Node where
// PyTorch uses an autograd.Function (RegisterPostBackwardFunction in
// torch/distributed/fsdp/_fully_shard/_fsdp_state.py): the C++ Function machinery
// (saved_data map, output wrapping through view_as, CppNode's argument checks) costs several
// times this node per module per step (docs/design/measured-choices.md).
class PostBackwardNode final : public torch::autograd::Node {
 public:
  explicit PostBackwardNode(std::function<void()> callback) : callback_(std::move(callback)) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    // As autograd.Function's default materialize_grads: an output that got no gradient
    // passes zeros on (PyTorch's FSDP2 sees the same).
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) grads[i] = input_metadata(i).zeros_like();
    }
    callback_();
    return std::move(grads);
  }

  std::string name() const override { return "fsdp::PostBackwardNode"; }

 private:
  std::function<void()> callback_;
};

// The tensor's one post-accumulate-grad hook slot (AutogradMeta::post_acc_grad_hooks_, which
// AccumulateGrad::apply calls after updating .grad), chaining to what was there before.
class ChainedPostAccumulateGradHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  ChainedPostAccumulateGradHook(std::unique_ptr<torch::autograd::PostAccumulateGradHook> previous,
                                std::shared_ptr<std::function<void()>> callback)
      : previous_(std::move(previous)), callback_(std::move(callback)) {}

  void operator()(const torch::autograd::Variable& tensor) override {
    if (previous_) (*previous_)(tensor);
    if (*callback_) (*callback_)();
  }

 private:
  std::unique_ptr<torch::autograd::PostAccumulateGradHook> previous_;
  std::shared_ptr<std::function<void()>> callback_;  // empty once disarmed
};

// A tensor pre-hook on the node that produced one output: runs the callback when that
// output's gradient is defined (CppFunctionTensorPreHook's rule), passes the gradients on.
class OutputGradientPreHook final : public torch::autograd::FunctionPreHook {
 public:
  OutputGradientPreHook(uint32_t output_nr, std::function<void()> callback)
      : output_nr_(output_nr), callback_(std::move(callback)) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (output_nr_ < grads.size() && grads[output_nr_].defined()) callback_();
    return grads;
  }

 private:
  uint32_t output_nr_;
  std::function<void()> callback_;
};

}  // namespace

void RunWhenGradientComputed(const at::Tensor& output, std::function<void()> callback) {
  TORCH_CHECK(output.defined() && output.requires_grad(),
              "RunWhenGradientComputed: `output` must be a defined tensor that requires grad");
  const auto& grad_fn = output.grad_fn();
  if (!grad_fn) {  // a leaf: its AccumulateGrad runs the tensor's own hooks
    output.register_hook([callback = std::move(callback)](const at::Tensor&) { callback(); });
    return;
  }
  grad_fn->add_tensor_pre_hook(std::make_unique<OutputGradientPreHook>(output.output_nr(), std::move(callback)));
}

PostAccumulateGradCallback::PostAccumulateGradCallback(const at::Tensor& param, std::function<void()> callback)
    : callback_(std::make_shared<std::function<void()>>(std::move(callback))) {
  TORCH_CHECK(param.defined(), "PostAccumulateGradCallback: `param` is undefined");
  TORCH_CHECK(param.is_leaf(), "PostAccumulateGradCallback: `param` must be a leaf tensor (autograd accumulates ",
              "gradients only into leaves)");
  std::unique_ptr<torch::autograd::PostAccumulateGradHook>& slot = torch::autograd::impl::post_acc_grad_hooks(param);
  torch::autograd::impl::set_post_acc_grad_hooks(
      param, std::make_unique<ChainedPostAccumulateGradHook>(std::move(slot), callback_));
}

PostAccumulateGradCallback::~PostAccumulateGradCallback() { *callback_ = nullptr; }

void GradientCountdown::Install(std::vector<at::Tensor> params, std::function<void()> on_all) {
  TORCH_CHECK(!installed(), "GradientCountdown::Install: already installed");
  params_ = std::move(params);
  on_all_ = std::move(on_all);
  hooks_.reserve(params_.size());
  for (const at::Tensor& p : params_) {
    hooks_.push_back(std::make_unique<PostAccumulateGradCallback>(p, [this] { OnGradient(); }));
  }
}

bool GradientCountdown::AllRequireGrad() const {
  if (params_.empty()) return false;
  for (const at::Tensor& p : params_) {
    if (!p.requires_grad()) return false;
  }
  return true;
}

void GradientCountdown::OnGradient() {
  if (pending_ > 0 && --pending_ == 0) on_all_();
}

std::vector<at::Tensor> RegisterPostBackwardCallback(const std::vector<at::Tensor>& inputs,
                                                     std::function<void()> callback) {
  if (!at::GradMode::is_enabled()) return inputs;
  std::vector<at::Tensor> out = inputs;
  std::vector<size_t> indices;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined() && inputs[i].requires_grad()) indices.push_back(i);
  }
  if (indices.empty()) return out;
  std::vector<at::Tensor> needing;
  needing.reserve(indices.size());
  for (size_t i : indices) needing.push_back(inputs[i]);
  const torch_compat::NodePtr node = torch_compat::MakeNode<PostBackwardNode>(std::move(callback));
  node->set_next_edges(torch::autograd::collect_next_edges(needing));
  for (size_t i : indices) {
    // The output: the input's data under a new autograd identity (what detach() makes,
    // sharing the version counter so that an in-place change of either is seen by the
    // other's saved-tensor checks), whose gradient flows into the node.
    c10::TensorImpl* impl = inputs[i].unsafeGetTensorImpl();
    at::Tensor alias(impl->shallow_copy_and_detach(impl->version_counter(), impl->allow_tensor_metadata_change()));
    torch::autograd::set_history(alias, node);
    out[i] = std::move(alias);
  }
  return out;
}

void QueueEndOfBackwardCallback(std::function<void()> callback) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

}  // namespace fsdp
