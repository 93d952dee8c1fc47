// The all-gather and reduce-scatter of a parameter group, each with its copy-in and
// copy-out in one place (PyTorch's _fsdp_collectives.py).
#ifndef FSDP_FSDP_PER_PARAM_FSDP_COLLECTIVES_H_
#define FSDP_FSDP_PER_PARAM_FSDP_COLLECTIVES_H_

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "comm/process_group.h"
#include "fsdp/per_param/fsdp_param.h"

namespace fsdp::per_param {

// An issued all-gather: every parameter's input packed (as bytes, so parameters of
// different dtypes share one collective) into this rank's slot of `output`.
struct AllGatherResult {
  at::Tensor output;  // uint8 [world * sum(input bytes)]
  comm::WorkPtr work;
  std::vector<int64_t> input_bytes;  // per parameter
  int64_t world_size = 1;
};

// Copy-in + all_gather_into_tensor (asynchronous: wait via the result's work).
AllGatherResult ForeachAllGather(const std::vector<FSDPParam*>& params, const comm::ProcessGroupPtr& group);

// Waits for the all-gather, then copies each parameter's rows out into its (re-allocated)
// all-gather output; a parameter sharded on dim > 0 is chunk-concatenated back.
void ForeachAllGatherCopyOut(AllGatherResult& result, const std::vector<FSDPParam*>& params);

// How gradients are divided by the data-parallel size (_get_gradient_divide_factors):
// f32/bf16 reductions use AVG in the collectives (SUM for a single rank); other dtypes
// risk overflow, so they divide by ~sqrt(N) before and the rest after a SUM. A custom
// `factor` replaces the data-parallel size.
struct GradientDivideFactors {
  std::optional<double> pre;
  std::optional<double> post;
  comm::ReduceOp reduce_scatter_op;
  comm::ReduceOp all_reduce_op;
};
GradientDivideFactors GetGradientDivideFactors(int64_t reduce_scatter_size, int64_t all_reduce_size,
                                               c10::ScalarType reduce_dtype,
                                               std::optional<double> factor);

struct ReduceOptions {
  comm::ProcessGroupPtr reduce_scatter_group;  // null for DDP (no sharding)
  comm::ProcessGroupPtr all_reduce_group;      // HSDP / DDP replicate group, else null
  c10::ScalarType orig_dtype;
  std::optional<c10::ScalarType> reduce_dtype;
  std::optional<double> gradient_divide_factor;
  bool all_reduce_grads = true;
};

// Reduce-scatters (then for HSDP all-reduces) `unsharded_grads` and accumulates each
// parameter's sharded gradient. With all_reduce_grads false (HSDP accumulation), the
// reduce-scattered output is summed into *partial_reduce_output instead and no gradient is
// assigned; the next reducing call adds it back.
void ForeachReduce(const std::vector<FSDPParam*>& params, std::vector<at::Tensor> unsharded_grads,
                   const ReduceOptions& options, at::Tensor* partial_reduce_output);

}  // namespace fsdp::per_param

#endif  // FSDP_FSDP_PER_PARAM_FSDP_COLLECTIVES_H_
