// Gradient-norm clipping over FSDP2's sharded gradients: PyTorch 2.15's
// torch.nn.utils.clip_grad_norm_ (torch/nn/utils/clip_grad.py) applied to DTensor gradients,
// whose norm reductions become Partial placements that one all-reduce per sharding mesh dim
// resolves (torch/distributed/tensor/_ops/_math_ops.py: _NormPartial for finite p, "max" for
// inf).
//
// torch::nn::utils::clip_grad_norm_ on fully_shard'ed parameters only sees each rank's shard,
// so it returns a different, too small norm on every rank. These functions find each
// parameter's layout through the FSDP runtime instead: a managed parameter's gradient is its
// sharded gradient (the real shard, no padding) laid out by FSDPParam::sharding_spec(), and
// the rest (ignored parameters, modules no fully_shard covers) hold whole gradients on every
// rank. Then
//   1. per gradient, the local p-norm (torch._foreach_norm, or one linalg.vector_norm each);
//   2. per layout, the norm of those norms raised to p (the sum of |g|^p over the local
//      elements; for p = inf, the max |g|): the value _NormPartial reduces;
//   3. one all-reduce (SUM, or MAX for inf) per process group of a mesh dim that shards
//      (size > 1): FSDP's shard dim; HSDP's (Replicate, Shard) only the shard dim; FSDP + TP
//      the dp dim and, for TP-sharded parameters, the tp dim. Layouts sharing a group share
//      the all-reduce (a small vector, one entry per layout), so a model on one mesh costs
//      one all-reduce per sharding mesh dim whatever its number of parameters. Whole
//      gradients are not reduced (that would count them once per rank);
//   4. total = (sum of the values)^(1/p), or their max;
//   5. every gradient *= clamp(max_norm / (total + 1e-6), max = 1), in place (PyTorch's
//      formula: no branch on the value, so no host sync unless error_if_nonfinite).
// The p-th powers are summed across mesh dims and the root taken once, where DTensor takes
// the root after each mesh dim and raises to p again before the next: equal up to rounding.
//
// Collective: call it on every rank of the model's meshes, in the same order, after the
// step's backward (every FSDP group idle) and before the optimizer step. Which all-reduces
// run depends only on the parameters that require grad (or hold one), not on which ranks
// got gradients, so ranks cannot disagree about them.
//
// The total norm (a 0-d tensor, equal on every rank: PyTorch's total_norm.full_tensor()) is
// in the promoted dtype of the parameters involved (gradients share their parameter's dtype,
// so nn.utils' dtype) on the first gradient's device (the CPU without gradients). Unlike
// PyTorch:
//   - a rank whose shard of a parameter is empty (uneven sharding) contributes 0 to the inf
//     norm, where PyTorch's local linalg.vector_norm raises "cannot compute the inf norm on
//     an empty tensor";
//   - managed and unmanaged gradients mix (PyTorch's torch.stack rejects DTensors next to
//     plain tensors), as do gradients on different meshes;
//   - a tensor listed twice is clipped once (PyTorch would scale it twice);
//   - max_norm must be >= 0 (+inf allowed: measure without clipping) and norm_type > 0 or
//     +inf: anything else is a c10::Error naming the argument (PyTorch does not check).
// Unlike FSDP1's FullyShardedDataParallel::clip_grad_norm (fsdp/fsdp1/clip_grad_norm.cc,
// PyTorch's FSDP.clip_grad_norm_), which follows PyTorch's FSDP1: that one computes the
// norms in float32 and requires one gradient dtype, rejects max_norm = inf, and has no
// error_if_nonfinite / foreach. Both use the same 1e-6 / clamp formula and both count
// unsharded gradients once.
//
// A tensor-parallel parameter (its layout published by a distributed_parameters::DistributedParameterModule,
// e.g. a parallel style's hook) counts with its layout whether or not a fully_shard manages it: under
// fully_shard its TP layout is part of the sharding spec; without, its local gradient is laid
// out by its module's spec (all-reduced over the TP dims that shard it, not over those that
// replicate it), so a TP-only model's norm equals one rank's.
#ifndef FSDP_FSDP_FSDP2_CLIP_GRAD_NORM_H_
#define FSDP_FSDP_FSDP2_CLIP_GRAD_NORM_H_

#include <ATen/core/Tensor.h>

#include <limits>
#include <optional>
#include <vector>

namespace torch::nn {
class Module;
}

namespace fsdp::fsdp2 {

// Clips the gradients of every parameter of `root`'s module tree (each tensor once, tied
// ones included once) so that their total norm is at most max_norm; returns the total norm
// before clipping. Parameters without a gradient are skipped.
//
// norm_type: p > 0, or std::numeric_limits<double>::infinity(). error_if_nonfinite: throw
// (on every rank, before any gradient changes) when the total norm is nan or inf. foreach:
// nullopt uses torch._foreach_norm / _foreach_mul_ where the device has them (CPU, CUDA,
// ...); true requires them (c10::Error otherwise); false computes one norm per gradient.
at::Tensor clip_grad_norm_(torch::nn::Module& root, double max_norm, double norm_type = 2.0,
                           bool error_if_nonfinite = false, std::optional<bool> foreach = std::nullopt);

// The same over `parameters` only (e.g. one optimizer parameter group), each of which must be
// a parameter of `root`'s module tree: the root is how their sharding is found (a tensor does
// not know which FSDPParam holds it).
at::Tensor clip_grad_norm_(torch::nn::Module& root, const std::vector<at::Tensor>& parameters, double max_norm,
                           double norm_type = 2.0, bool error_if_nonfinite = false,
                           std::optional<bool> foreach = std::nullopt);

}  // namespace fsdp::fsdp2

#endif  // FSDP_FSDP_FSDP2_CLIP_GRAD_NORM_H_
