#include "tensor_parallel/tensor_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <ostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/dtensor.h"
#include "dtensor/placement.h"

namespace fsdp::dtensor {
namespace {

// AutogradContext::saved_data holds IValues; a capsule carries the group to backward.
struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(comm::ProcessGroupPtr g) : group(std::move(g)) {}
  comm::ProcessGroupPtr group;
};

// Identity forward, sum all-reduce of the gradient in backward: a replicated input feeds
// every rank's column shard, so its gradient is the sum of the ranks' partial gradients
// (what PyTorch gets from DTensor.from_local(Replicate) in ColwiseParallel).
struct AllReduceGradient : torch::autograd::Function<AllReduceGradient> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, comm::ProcessGroupPtr group) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(std::move(group)));
    return x;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const auto holder = c10::static_intrusive_pointer_cast<GroupCapsule>(ctx->saved_data["group"].toCapsule());
    // The engine may share the incoming buffer with other consumers: reduce a copy.
    at::Tensor grad = grads[0].clone(at::MemoryFormat::Contiguous);
    holder->group->all_reduce(grad)->wait();
    return {grad, at::Tensor()};
  }
};

}  // namespace

const char* TensorParallelStyleName(TensorParallelStyle style) {
  switch (style) {
    case TensorParallelStyle::kColwise: return "colwise";
    case TensorParallelStyle::kRowwise: return "rowwise";
  }
  return "?";
}

TensorParallelLinearImpl::TensorParallelLinearImpl(const torch::nn::Linear& linear, mesh::DeviceMeshPtr tp_mesh,
                                                   TensorParallelStyle style)
    : style_(style), mesh_(std::move(tp_mesh)) {
  TORCH_CHECK(!linear.is_empty(), "TensorParallelLinear: the Linear is empty (no module)");
  TORCH_CHECK(mesh_ != nullptr, "TensorParallelLinear: tp_mesh is null");
  TORCH_CHECK(mesh_->ndim() == 1, "TensorParallelLinear: tp_mesh must be 1-D, got ", mesh_->ToString(),
              " (slice the tensor-parallel dimension, e.g. mesh[\"tp\"])");
  const at::Tensor& full_weight = linear->weight;
  TORCH_CHECK(full_weight.defined() && full_weight.dim() == 2,
              "TensorParallelLinear: the Linear's weight must be 2-D [out, in]");
  out_features_ = full_weight.size(0);
  in_features_ = full_weight.size(1);

  const bool colwise = style_ == TensorParallelStyle::kColwise;
  const Placements weight_placements{Placement::Shard(colwise ? 0 : 1)};
  const Placements bias_placements{colwise ? Placement::Shard(0) : Placement::Replicate()};

  const DTensor w = distribute_tensor(full_weight, mesh_, weight_placements);
  weight = register_parameter("weight", w.to_local(), full_weight.requires_grad());
  specs_.emplace_back("weight", w.spec());
  const at::Tensor& full_bias = linear->bias;
  if (full_bias.defined()) {
    const DTensor b = distribute_tensor(full_bias, mesh_, bias_placements);
    bias = register_parameter("bias", b.to_local(), full_bias.requires_grad());
    specs_.emplace_back("bias", b.spec());
  }
}

int64_t TensorParallelLinearImpl::local_in_features() const { return weight.size(1); }

at::Tensor TensorParallelLinearImpl::forward(const at::Tensor& x) {
  const bool colwise = style_ == TensorParallelStyle::kColwise;
  TORCH_CHECK(x.defined() && x.dim() >= 1, "TensorParallelLinear (", TensorParallelStyleName(style_),
              "): input must be a tensor of at least 1 dimension");
  TORCH_CHECK(x.size(-1) == local_in_features(), "TensorParallelLinear (", TensorParallelStyleName(style_),
              ", tp rank ", mesh_->coordinate()[0], " of ", mesh_->size(), "): input's last dimension is ", x.size(-1),
              " but expected ", local_in_features(),
              colwise ? " (in_features; colwise takes the replicated input)"
                      : absl::StrCat(" (this rank's Shard(-1) chunk of in_features=", in_features_, ")"));
  if (colwise) {
    at::Tensor input = x;
    if (mesh_->size() > 1 && x.requires_grad() && at::GradMode::is_enabled()) {
      input = AllReduceGradient::apply(x, mesh_->group(0));
    }
    return at::linear(input, weight, bias);
  }
  // Each rank multiplies its columns of x by its columns of W: the sum over ranks is x W^T.
  const at::Tensor partial = at::linear(x, weight);
  const DTensorSpec spec =
      DTensorSpec::Make(mesh_, {Placement::Partial()}, partial.sizes().vec(), partial.scalar_type());
  // Autograd-aware: the gradient of each partial term is the replicated output gradient.
  at::Tensor y = RedistributeLocal(partial, spec, {Placement::Replicate()});
  return bias.defined() ? y + bias : y;
}

const DTensorSpec& TensorParallelLinearImpl::parameter_spec(const std::string& name) const {
  const auto it = std::find_if(specs_.begin(), specs_.end(), [&](const auto& entry) { return entry.first == name; });
  if (it != specs_.end()) return it->second;
  std::vector<std::string> known;
  for (const auto& entry : specs_) known.push_back(entry.first);
  TORCH_CHECK(false, "TensorParallelLinear: no distributed parameter named '", name, "'; known: [",
              absl::StrJoin(known, ", "), "]");
  return it->second;  // unreachable
}

std::vector<std::pair<std::string, DTensorSpec>> TensorParallelLinearImpl::named_parameter_specs() const {
  return specs_;
}

void TensorParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "fsdp::dtensor::TensorParallelLinear(in_features=" << in_features_ << ", out_features=" << out_features_
         << ", style=" << TensorParallelStyleName(style_) << ", tp=" << mesh_->size()
         << ", bias=" << (bias.defined() ? "true" : "false") << ")";
}

TensorParallelLinear ParallelizeLinear(const torch::nn::Linear& linear, mesh::DeviceMeshPtr tp_mesh,
                                       TensorParallelStyle style) {
  return TensorParallelLinear(linear, std::move(tp_mesh), style);
}

}  // namespace fsdp::dtensor
