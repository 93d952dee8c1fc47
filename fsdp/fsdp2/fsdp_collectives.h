// The all-gather and reduce-scatter of a parameter group, each with its copy-in and
// copy-out in one place (PyTorch's _fsdp_collectives.py).
#ifndef FSDP_FSDP_FSDP2_FSDP_COLLECTIVES_H_
#define FSDP_FSDP_FSDP2_FSDP_COLLECTIVES_H_

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>

#include <functional>
#include <optional>
#include <vector>

#include "comm/process_group.h"
#include "device/stream.h"
#include "fsdp/fsdp2/fsdp_param.h"

namespace fsdp::fsdp2 {

// Packed all-gather buffers kept across unshards. On the CPU, glibc maps allocations above
// 32 MiB afresh every time, and writing a fresh mapping costs a zero-filling page fault per
// 4 KiB: without reuse, copy-in ran far below memcpy bandwidth
// (docs/design/measured-choices.md). Smaller CPU buffers are not kept (`min_cpu_bytes`):
// glibc's heap recycles them (its mmap threshold rises to the freed size), and keeping them
// would hold memory PyTorch frees after each copy-out (bench/e2e's allocation peak). Keeps at most `max_buffers` (an
// unshard and a prefetched one), so between steps up to that many buffers of the largest group's packed size stay
// allocated, as a GPU caching allocator would keep them. Each kept buffer carries the event after which its last reader
// (the copy-out) finished: a stream reusing it waits for that event first, which is what record_stream does for the
// caching allocator. Not thread-safe: one per rank (FSDPCommContext), used from the host thread.
//
// A small CPU buffer's memory is freed at Give, but its tensor and storage objects (at 0
// bytes) are kept, at most kMaxShells of them, and re-allocated in place by the next Take:
// constructing and destroying them costs instructions on every unshard
// (docs/design/measured-choices.md). Kept only when nobody else holds the tensor or its
// storage and its last reader finished.
class AllGatherBufferPool {
 public:
  static constexpr int64_t kGlibcMmapThresholdMax = int64_t{32} << 20;  // DEFAULT_MMAP_THRESHOLD_MAX, 64-bit
  explicit AllGatherBufferPool(size_t max_buffers = 2, int64_t min_cpu_bytes = kGlibcMmapThresholdMax)
      : max_buffers_(max_buffers), min_cpu_bytes_(min_cpu_bytes) {}
  struct Buffer {
    at::Tensor bytes;
    device::EventPtr ready;  // null: usable at once
  };
  // A buffer of at least `bytes` uint8 elements on `device`: the smallest kept one that
  // fits, else a new one.
  Buffer Take(int64_t bytes, const at::TensorOptions& options);
  // Returns a buffer from Take, free for reuse once `ready` completed (a CPU buffer below
  // `min_cpu_bytes` is freed instead); the smallest kept buffer is dropped when over the limit.
  void Give(at::Tensor buffer, device::EventPtr ready = nullptr);
  size_t size() const { return free_.size(); }      // buffers kept with their memory
  size_t shells() const { return shells_.size(); }  // freed small CPU buffers kept for reuse

  static constexpr size_t kMaxShells = 2;  // an unshard and a prefetched one

 private:
  size_t max_buffers_;
  int64_t min_cpu_bytes_;
  std::vector<Buffer> free_;
  std::vector<at::Tensor> shells_;
};

// The streams of one rank's collectives (FSDPCommContext's; PyTorch's names).
struct CommStreams {
  device::Stream* current = nullptr;  // compute
  device::Stream* all_gather_copy_in = nullptr;
  device::Stream* all_gather = nullptr;
  device::Stream* reduce_scatter = nullptr;
  device::Stream* all_reduce = nullptr;
  device::CollectiveSequencer* sequencer = nullptr;
};

// Inline streams of the calling thread, for callers outside a root's context (benchmarks,
// tests of the collectives alone): everything runs on the host, collectives stay pending
// until the copy-out.
const CommStreams& ThreadInlineStreams();

// An issued all-gather: every parameter's input packed (as bytes, so parameters of
// different dtypes share one collective) into this rank's slot of `output`.
struct AllGatherResult {
  at::Tensor output;                         // uint8 [world * sum(input bytes)]
  device::EventPtr event;                    // the all-gather finished
  c10::SmallVector<int64_t, 8> input_bytes;  // per parameter (inline up to 8: no allocation)
  int64_t world_size = 1;
  at::Tensor buffer;                    // what `output` is a prefix of
  AllGatherBufferPool* pool = nullptr;  // where copy-out returns `buffer`, if any
};

// Copy-in on `copy_in_stream`, then all_gather_into_tensor on `all_gather_stream` after it
// (PyTorch's foreach_all_gather); returns at once with the event to wait for. The
// all-gather inputs (mixed-precision casts) are taken on the host. With a pool, the packed
// buffer comes from it (and copy-out gives it back).
AllGatherResult ForeachAllGather(const std::vector<FSDPParam*>& params, const comm::ProcessGroupPtr& group,
                                 device::Stream& copy_in_stream, device::Stream& all_gather_stream,
                                 device::CollectiveSequencer& sequencer, AllGatherBufferPool* pool = nullptr);
// On ThreadInlineStreams().
AllGatherResult ForeachAllGather(const std::vector<FSDPParam*>& params, const comm::ProcessGroupPtr& group,
                                 AllGatherBufferPool* pool = nullptr);

// Makes `current` wait for the all-gather, then copies each parameter's rows out into its
// (re-allocated) all-gather output on `current`; a parameter sharded on dim > 0 is
// chunk-concatenated back.
void ForeachAllGatherCopyOut(AllGatherResult& result, const std::vector<FSDPParam*>& params, device::Stream& current);
void ForeachAllGatherCopyOut(AllGatherResult& result, const std::vector<FSDPParam*>& params);

// How gradients are divided by the data-parallel size (_get_gradient_divide_factors):
// f32/bf16 reductions use AVG in the collectives (SUM for a single rank); other dtypes
// risk overflow, so they divide by ~sqrt(N) before and the rest after a SUM. A custom
// `factor` replaces the data-parallel size. force_sum_reduction_for_comms: only SUM in the
// collectives, dividing after (before and after for the overflow-prone dtypes).
struct GradientDivideFactors {
  std::optional<double> pre;
  std::optional<double> post;
  comm::ReduceOp reduce_scatter_op;
  comm::ReduceOp all_reduce_op;
};
GradientDivideFactors GetGradientDivideFactors(int64_t reduce_scatter_size, int64_t all_reduce_size,
                                               c10::ScalarType reduce_dtype, std::optional<double> factor,
                                               bool force_sum_reduction_for_comms = false);

struct ReduceOptions {
  comm::ProcessGroupPtr reduce_scatter_group;  // null for DDP (no sharding)
  comm::ProcessGroupPtr all_reduce_group;      // HSDP / DDP replicate group, else null
  c10::ScalarType orig_dtype;
  std::optional<c10::ScalarType> reduce_dtype;
  std::optional<double> gradient_divide_factor;
  bool force_sum_reduction_for_comms = false;
  bool all_reduce_grads = true;
  // Runs on the reduced output in place, on the all-reduce stream: after the replicate
  // all-reduce (HSDP / DDP) or after the reduce-scatter (FSDP), before the post-division
  // (PyTorch 2.15's all_reduce_hook in foreach_reduce). Not with all_reduce_grads false.
  std::function<void(const at::Tensor&)> all_reduce_hook;
};

struct ReduceEvents {
  device::EventPtr reduce_scatter;  // the reduce-scatter finished (its input is free)
  device::EventPtr post_reduce;     // the sharded gradients hold their data
};

// Reduce-scatters (then for HSDP all-reduces) `unsharded_grads` and accumulates each
// parameter's sharded gradient: copy-in and reduce-scatter on the reduce-scatter stream
// after `current`, the all-reduce on the all-reduce stream, the division and accumulation
// on the last of them (PyTorch's foreach_reduce). Returns at once: gradient tensors are
// assigned on the host now, their data is there once `post_reduce` completed. With
// all_reduce_grads false (HSDP accumulation), the reduce-scattered output is summed into
// *partial_reduce_output instead and no gradient is assigned; the next reducing call adds
// it back.
ReduceEvents ForeachReduce(std::vector<FSDPParam*> params, std::vector<at::Tensor> unsharded_grads,
                           const ReduceOptions& options, at::Tensor* partial_reduce_output, const CommStreams& streams);

}  // namespace fsdp::fsdp2

#endif  // FSDP_FSDP_FSDP2_FSDP_COLLECTIVES_H_
