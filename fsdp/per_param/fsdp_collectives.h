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

// Packed all-gather buffers kept across unshards. On the CPU, glibc maps allocations above
// 32 MiB afresh every time, and writing a fresh mapping costs a zero-filling page fault per
// 4 KiB: without reuse, copy-in ran at 0.1-0.2 of memcpy bandwidth (bench/fsdp2). Keeps at
// most `max_buffers` (an unshard and a prefetched one), so between steps up to that many
// buffers of the largest group's packed size stay allocated, as a GPU caching allocator
// would keep them. Not thread-safe: one per rank (FSDPCommContext).
class AllGatherBufferPool {
 public:
  explicit AllGatherBufferPool(size_t max_buffers = 2) : max_buffers_(max_buffers) {}
  // A buffer of at least `bytes` uint8 elements on `device`: the smallest kept one that
  // fits, else a new one.
  at::Tensor Take(int64_t bytes, const at::TensorOptions& options);
  // Returns a buffer from Take; the smallest kept buffer is dropped when over the limit.
  void Give(at::Tensor buffer);
  size_t size() const { return free_.size(); }

 private:
  size_t max_buffers_;
  std::vector<at::Tensor> free_;
};

// An issued all-gather: every parameter's input packed (as bytes, so parameters of
// different dtypes share one collective) into this rank's slot of `output`.
struct AllGatherResult {
  at::Tensor output;  // uint8 [world * sum(input bytes)]
  comm::WorkPtr work;
  std::vector<int64_t> input_bytes;  // per parameter
  int64_t world_size = 1;
  at::Tensor buffer;                    // what `output` is a prefix of
  AllGatherBufferPool* pool = nullptr;  // where copy-out returns `buffer`, if any
};

// Copy-in + all_gather_into_tensor (asynchronous: wait via the result's work). With a
// pool, the packed buffer comes from it (and copy-out gives it back).
AllGatherResult ForeachAllGather(const std::vector<FSDPParam*>& params, const comm::ProcessGroupPtr& group,
                                 AllGatherBufferPool* pool = nullptr);

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
