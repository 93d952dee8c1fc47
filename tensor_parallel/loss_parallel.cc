#include "tensor_parallel/loss_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <vector>

namespace fsdp::tensor_parallel {

using ::fsdp::dtensor::DTensor;
using ::fsdp::dtensor::Placement;
using ::fsdp::dtensor::Placements;
using ::fsdp::dtensor::ToString;
namespace {

at::Tensor AllReduceOverClasses(at::Tensor t, const comm::ProcessGroupPtr& group, comm::ReduceOp op) {
  t = t.contiguous();
  if (group->size() > 1) group->all_reduce(t, op)->wait();
  return t;
}

// The target's class index on this rank's classes, and where it is another rank's.
struct LocalTarget {
  at::Tensor index;  // in [0, local classes), 0 where masked
  at::Tensor mask;   // true where the class is not on this rank
};
LocalTarget Localize(const at::Tensor& safe_target, int64_t begin, int64_t count) {
  at::Tensor local = safe_target - begin;
  at::Tensor mask = at::logical_or(local < 0, local >= count);
  return {local.masked_fill(mask, 0), mask};
}

struct CrossEntropy : torch::autograd::Function<CrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            comm::ProcessGroupPtr group, int64_t class_dim, int64_t class_begin, int64_t reduction,
                            int64_t ignore_index) {
    // torch/distributed/tensor/parallel/loss.py _log_softmax: in the computation dtype
    // (float for half and bfloat16), the result back in the input's.
    const c10::ScalarType result_dtype = logits.scalar_type();
    const bool low = result_dtype == at::kHalf || result_dtype == at::kBFloat16;
    at::Tensor x = logits.to(low ? at::kFloat : result_dtype).contiguous();
    at::Tensor shifted = x;
    if (x.numel() > 0) {
      at::Tensor max = AllReduceOverClasses(at::amax(x, {class_dim}, /*keepdim=*/true), group, comm::ReduceOp::Max());
      shifted = x - max;
    }
    at::Tensor sumexp =
        AllReduceOverClasses(at::sum(at::exp(shifted), {class_dim}, /*keepdim=*/true), group, comm::ReduceOp::Sum());
    at::Tensor log_softmax = (shifted - at::log(sumexp)).to(result_dtype);

    const at::Tensor valid = target != ignore_index;
    const at::Tensor safe_target = at::where(valid, target, 0);
    const LocalTarget local = Localize(safe_target, class_begin, log_softmax.size(class_dim));
    at::Tensor picked = at::gather(log_softmax, class_dim, local.index.unsqueeze(class_dim))
                            .masked_fill(local.mask.unsqueeze(class_dim), 0);
    picked = AllReduceOverClasses(picked, group, comm::ReduceOp::Sum());
    at::Tensor result = at::where(valid, -picked.squeeze(class_dim), 0);
    at::Tensor total_weight = valid.sum().to(log_softmax.scalar_type());
    if (reduction == static_cast<int64_t>(LossReduction::kSum)) {
      result = result.sum();
    } else if (reduction == static_cast<int64_t>(LossReduction::kMean)) {
      result = result.sum() / total_weight;
    }
    ctx->save_for_backward({log_softmax, target, total_weight});
    ctx->saved_data["class_dim"] = class_dim;
    ctx->saved_data["class_begin"] = class_begin;
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["ignore_index"] = ignore_index;
    return result;
  }

  // _nll_loss_and_log_softmax_backward: (softmax - one-hot) * grad, this rank's classes.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& log_softmax = saved[0];
    const at::Tensor& target = saved[1];
    const int64_t class_dim = ctx->saved_data["class_dim"].toInt();
    const int64_t class_begin = ctx->saved_data["class_begin"].toInt();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    at::Tensor grad = grads[0];
    if (ctx->saved_data["reduction"].toInt() == static_cast<int64_t>(LossReduction::kMean)) grad = grad / saved[2];
    const at::Tensor valid = (target != ignore_index).unsqueeze(class_dim);
    const LocalTarget local =
        Localize(at::where(target != ignore_index, target, 0), class_begin, log_softmax.size(class_dim));
    // softmax - one_hot(target), times the incoming gradient, in one logits-sized buffer: the
    // -1 is added where this rank holds the target class (0.0 elsewhere leaves the value as it
    // is), the same values as (one_hot + softmax) * grad without two more such buffers.
    at::Tensor out = at::exp(log_softmax);
    out.scatter_add_(class_dim, local.index.unsqueeze(class_dim),
                     at::where(local.mask, 0.0, -1.0).unsqueeze(class_dim).to(out.scalar_type()));
    if (grad.dim() > 0 && log_softmax.dim() > grad.dim()) grad = grad.unsqueeze(class_dim);
    out.mul_(at::where(valid, grad, 0));
    return {out, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor loss_parallel_cross_entropy(const DTensor& logits, const at::Tensor& target,
                                       const LossParallelOptions& options) {
  TORCH_CHECK(logits.defined(), "loss_parallel_cross_entropy: logits is an undefined DTensor");
  const at::Tensor& local = logits.to_local();
  const int64_t ndim = static_cast<int64_t>(logits.sizes().size());
  TORCH_CHECK(ndim >= 1, "loss_parallel_cross_entropy: logits must have at least 1 dimension, got 0");
  const int64_t class_dim = ndim >= 2 ? 1 : 0;
  const Placements& placements = logits.placements();
  int mesh_dim = -1;
  int shard_dims = 0;
  for (size_t m = 0; m < placements.size(); ++m) {
    if (placements[m].is_shard(class_dim) && !placements[m].is_strided_shard()) {
      mesh_dim = static_cast<int>(m);
      ++shard_dims;
    }
  }
  TORCH_CHECK(shard_dims == 1, "loss_parallel_cross_entropy: requires exactly one mesh dim to shard tensor dimension ",
              class_dim, " (the class dim), but got placements ", ToString(placements), " with ", shard_dims,
              " such mesh dim(s)");
  for (size_t m = 0; m < placements.size(); ++m) {
    TORCH_CHECK(static_cast<int>(m) == mesh_dim || placements[m].is_replicate(),
                "loss_parallel_cross_entropy: mesh dims other than the class dim's must be Replicate, got ",
                placements[m].ToString(), " at mesh dim ", m);
  }
  TORCH_CHECK(options.reduction != LossReduction::kMean || placements.size() == 1,
              "loss_parallel_cross_entropy: reduction mean is only supported on a one-dimensional mesh; got a ",
              placements.size(), "-D mesh (use sum or none)");
  TORCH_CHECK(at::isFloatingType(local.scalar_type()), "loss_parallel_cross_entropy: logits must be floating, got ",
              local.scalar_type());
  TORCH_CHECK(target.defined() && target.scalar_type() == at::kLong,
              "loss_parallel_cross_entropy: target must be an int64 tensor of class indices, got ",
              target.defined() ? c10::toString(target.scalar_type()) : "undefined");
  std::vector<int64_t> expected = logits.sizes();
  expected.erase(expected.begin() + class_dim);
  TORCH_CHECK(target.sizes().vec() == expected, "loss_parallel_cross_entropy: target has shape ", target.sizes(),
              " but logits of shape ", c10::IntArrayRef(logits.sizes()), " need ", c10::IntArrayRef(expected));
  const int64_t classes = logits.sizes()[class_dim];
  const at::Tensor bad = at::logical_and(target != options.ignore_index, at::logical_or(target < 0, target >= classes));
  TORCH_CHECK(!bad.any().item<bool>(), "loss_parallel_cross_entropy: target holds class indices outside [0, ", classes,
              ") (ignore_index=", options.ignore_index, "), e.g. ", target.masked_select(bad)[0].item<int64_t>());
  const int64_t class_begin = logits.spec().local_shape_and_offset().offset[class_dim];
  return CrossEntropy::apply(local, target.to(local.device()), logits.device_mesh()->group(mesh_dim), class_dim,
                             class_begin, static_cast<int64_t>(options.reduction), options.ignore_index);
}

}  // namespace fsdp::tensor_parallel
