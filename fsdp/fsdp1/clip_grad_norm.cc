// FullyShardedDataParallel::clip_grad_norm (PyTorch's FSDP.clip_grad_norm_): the total
// gradient norm over sharded gradients of every rank plus the unsharded ones, then clipping.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <set>

#include "absl/container/flat_hash_set.h"
#include "fsdp/fsdp1/fsdp_state.h"
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"

namespace fsdp::fsdp1 {
namespace {

// _get_grad_norm: the norm of the gradients as one vector, computed in float32.
at::Tensor GetGradNorm(const std::vector<at::Tensor>& params, double norm_type, const c10::Device& device) {
  std::vector<at::Tensor> norms;
  std::set<c10::ScalarType> dtypes;
  for (const at::Tensor& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    dtypes.insert(g.scalar_type());
    norms.push_back(at::linalg_vector_norm(g.detach(), norm_type, c10::nullopt, false, at::kFloat));
  }
  if (norms.empty()) return at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
  TORCH_CHECK(dtypes.size() == 1, "clip_grad_norm requires uniform dtype across all gradients but got ", dtypes.size(),
              " dtypes");
  return at::linalg_vector_norm(at::stack(norms), norm_type, c10::nullopt, false, at::kFloat).to(device);
}

}  // namespace

at::Tensor FullyShardedDataParallel::clip_grad_norm(double max_norm, double norm_type) {
  CheckRoot("clip_grad_norm");
  FSDPState* root = state();
  root->CheckNotPoisoned("clip_grad_norm");
  TORCH_CHECK(root->training_state() == FSDPTrainingState::IDLE, "clip_grad_norm expects the root to be IDLE but got ",
              ToString(root->training_state()), " (call it after backward)");
  TORCH_CHECK(std::isfinite(max_norm) && max_norm >= 0, "clip_grad_norm: max_norm must be finite and >= 0, got ",
              max_norm);
  TORCH_CHECK(norm_type > 0, "clip_grad_norm: norm_type must be > 0 (or inf), got ", norm_type);
  const c10::Device& device = root->options().device;
  const std::vector<FlatParamHandle*> all_handles = handles();
  // Sharded and non-sharded (NO_SHARD, unmanaged) parameters, in a deterministic order.
  std::vector<at::Tensor> sharded_params, nonsharded_params, grads;
  absl::flat_hash_set<const c10::TensorImpl*> sharded_set, nonsharded_set, managed;
  for (FlatParamHandle* h : all_handles) {
    auto& target_set = h->uses_sharded_strategy() ? sharded_set : nonsharded_set;
    auto& target_list = h->uses_sharded_strategy() ? sharded_params : nonsharded_params;
    for (const at::Tensor& p : h->orig_params()) managed.insert(p.unsafeGetTensorImpl());
    std::vector<at::Tensor> candidates =
        h->use_orig_params() ? h->orig_params() : std::vector<at::Tensor>{h->flat_param().param};
    for (const at::Tensor& p : candidates) {
      if (!target_set.insert(p.unsafeGetTensorImpl()).second) continue;
      target_list.push_back(p);
      if (p.grad().defined()) grads.push_back(p.grad());
    }
  }
  for (const at::Tensor& p : module().parameters()) {
    if (!p.defined() || managed.contains(p.unsafeGetTensorImpl()) || sharded_set.contains(p.unsafeGetTensorImpl())) {
      continue;
    }
    if (!nonsharded_set.insert(p.unsafeGetTensorImpl()).second) continue;
    nonsharded_params.push_back(p);
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  const bool all_no_shard = sharded_params.empty();
  const bool is_inf = std::isinf(norm_type);
  at::Tensor total_norm;
  if (all_no_shard) {
    // Every gradient is already reduced on every rank (nn.utils.clip_grad_norm_).
    total_norm = GetGradNorm(nonsharded_params, norm_type, device);
  } else {
    const at::Tensor local_sharded_norm = GetGradNorm(sharded_params, norm_type, device);
    std::optional<at::Tensor> local_nonsharded_norm;
    if (!nonsharded_params.empty()) local_nonsharded_norm = GetGradNorm(nonsharded_params, norm_type, device);
    if (is_inf) {
      total_norm =
          local_nonsharded_norm ? at::maximum(local_sharded_norm, *local_nonsharded_norm) : local_sharded_norm.clone();
      root->process_group()->all_reduce(total_norm, comm::ReduceOp::Max())->wait();
    } else {
      total_norm = local_sharded_norm.pow(norm_type);
      root->process_group()->all_reduce(total_norm, comm::ReduceOp::Sum())->wait();
      // All-reducing the non-sharded norm would count it world-size times.
      if (local_nonsharded_norm) total_norm = total_norm + local_nonsharded_norm->pow(norm_type);
      total_norm = total_norm.pow(1.0 / norm_type);
    }
  }
  if (root->options().cpu_offload.offload_params) total_norm = total_norm.cpu();
  const at::Tensor clip_coef = max_norm / (total_norm + 1e-6);
  // Multiplying by a coefficient clamped to 1 avoids a data-dependent branch.
  const at::Tensor clip_coef_clamped = at::clamp(clip_coef, c10::nullopt, 1.0);
  {
    at::NoGradGuard no_grad;
    for (at::Tensor& g : grads) g.mul_(clip_coef_clamped.to(g.device(), g.scalar_type()));
  }
  if (grads.empty()) return total_norm.to(at::typeMetaToScalarType(at::get_default_dtype()));
  c10::ScalarType dtype = grads.front().scalar_type();
  for (const at::Tensor& g : grads) dtype = c10::promoteTypes(dtype, g.scalar_type());
  return total_norm.to(dtype);
}

}  // namespace fsdp::fsdp1
