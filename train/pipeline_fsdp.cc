#include "train/pipeline_fsdp.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <optional>
#include <utility>

#include "fsdp/fsdp2/clip_grad_norm.h"

namespace fsdp::train {

FsdpStageDataParallel::FsdpStageDataParallel(fsdp2::FSDPModule root, std::vector<fsdp2::FSDPModule> modules)
    : root_(root), all_(std::move(modules)) {
  all_.push_back(root_);
}

void FsdpStageDataParallel::Unshard() {
  for (fsdp2::FSDPModule& m : all_) m.unshard(/*async_op=*/true);
}

void FsdpStageDataParallel::WaitUnshard() {
  for (fsdp2::FSDPModule& m : all_) m.wait_for_unshard();
}

void FsdpStageDataParallel::Reshard() {
  for (fsdp2::FSDPModule& m : all_) m.reshard();
}

void FsdpStageDataParallel::BeforeBackward() {
  root_.set_manual_backward_finalization(true);
  root_.set_reshard_after_backward(false);
  root_.set_requires_gradient_sync(false);
}

void FsdpStageDataParallel::ReduceGrad() {
  root_.set_requires_gradient_sync(true);
  root_.set_reshard_after_backward(true);
  root_.finalize_backward();
  root_.set_manual_backward_finalization(false);
}

double ClipGradNormAcrossStages(const std::vector<torch::nn::Module*>& stage_modules, const comm::ProcessGroupPtr& pp,
                                double max_norm, double norm_type) {
  TORCH_CHECK(pp != nullptr, "ClipGradNormAcrossStages: the pipeline group is null");
  TORCH_CHECK(max_norm >= 0, "ClipGradNormAcrossStages: max_norm must be >= 0, got ", max_norm);
  const bool inf = std::isinf(norm_type);
  TORCH_CHECK(norm_type > 0, "ClipGradNormAcrossStages: norm_type must be > 0 or +inf, got ", norm_type);
  // Each stage's norm over its own meshes (max_norm = inf: measure, clip nothing), combined.
  double local = 0;
  std::optional<c10::Device> device;  // the parameters', where the pipeline group moves tensors
  for (torch::nn::Module* m : stage_modules) {
    TORCH_CHECK(m != nullptr, "ClipGradNormAcrossStages: a stage module is null");
    if (!device) {
      const std::vector<at::Tensor> params = m->parameters();
      if (!params.empty()) device = params.front().device();
    }
    const double n = fsdp2::clip_grad_norm_(*m, std::numeric_limits<double>::infinity(), norm_type).item<double>();
    local = inf ? std::max(local, n) : local + std::pow(n, norm_type);
  }
  at::Tensor total = at::tensor({local}, at::kDouble).to(device.value_or(c10::kCPU));
  if (pp->size() > 1) pp->all_reduce(total, inf ? comm::ReduceOp::Max() : comm::ReduceOp::Sum())->wait();
  const double norm = inf ? total.item<double>() : std::pow(total.item<double>(), 1.0 / norm_type);
  // torch.nn.utils.clip_grads_with_norm_'s formula.
  const double coef = std::min(max_norm / (norm + 1e-6), 1.0);
  for (torch::nn::Module* m : stage_modules) {
    for (at::Tensor& p : m->parameters()) {
      if (p.grad().defined()) p.mutable_grad().mul_(coef);
    }
  }
  return norm;
}

}  // namespace fsdp::train
