// Ring attention: scaled dot-product attention over a sequence sharded across the ranks of a
// context-parallel group, as PyTorch 2.15's torch/distributed/tensor/experimental/
// _context_parallel/_attention.py computes it (_templated_ring_attention and its backward over
// ATen's SDPA kernels: on the CPU aten._scaled_dot_product_flash_attention_for_cpu, on CUDA
// aten._scaled_dot_product_flash_attention for float16 / bfloat16 and
// aten._scaled_dot_product_efficient_attention for float32, each with its backward kernel).
//
//   // q: [batch, heads, seq / cp, head_dim] on each rank, the sequence head-tail sharded
//   // (load_balancer.h); k, v may have fewer heads (GQA).
//   at::Tensor out = context_parallel::RingAttention(q, k, v, /*is_causal=*/true, cp_group);
//
// Each rank holds one block of queries and one of keys / values. The key / value blocks go
// round the ring (rotate method kAllGather: one all-gather of every rank's block, PyTorch's
// default; kAllToAll: one all_to_all_single per step passing the block to the next rank, as
// PyTorch's permute_tensor); each block's attention yields an output and its log-sum-exp,
// merged into the running result in float32 (out -= sigmoid(lse_b - lse) (out - out_b),
// lse -= logsigmoid(lse - lse_b); with convert_to_f32 = false the running output stays in the
// inputs' dtype). With a causal mask and load balancing (PyTorch's default,
// _ContextParallelOptions.enable_load_balance), rank r's queries are sequence chunks r and
// 2W-1-r of 2W, so every block after the first is either the earlier half of a block (full
// attention) or the later half of the queries (full attention); without load balancing, blocks
// from later ranks are skipped. The backward runs the same ring again for the key / value
// blocks and passes the accumulating key / value gradients round with all_to_all_single.
//
// Preconditions (c10::Error naming the argument otherwise): 4-D floating-point q, k, v of one
// dtype on one device, the CPU or a CUDA device (there float16, bfloat16 or float32, the
// dtypes of ATen's CUDA flash and memory-efficient kernels), the sequence on dim 2, k and v
// of one shape, q's heads a multiple of k's; causal attention needs q and k of the same
// length; load balancing needs causal attention (as PyTorch); with load balancing the local
// length must be even (two chunks).
//
// Collective over `group`; not thread-safe per group (one ring at a time). The output's
// grad_fn is a RingAttentionBackward node (not differentiable again).
#ifndef FSDP_CONTEXT_PARALLEL_RING_ATTENTION_H_
#define FSDP_CONTEXT_PARALLEL_RING_ATTENTION_H_

#include <ATen/core/Tensor.h>

#include <optional>

#include "comm/process_group.h"

namespace fsdp::context_parallel {

// PyTorch's _RotateMethod (set_rotate_method("allgather" / "alltoall")).
enum class RotateMethod { kAllGather, kAllToAll };

struct RingAttentionOptions {
  RotateMethod rotate_method = RotateMethod::kAllGather;
  // The sequence is head-tail sharded (load_balancer.h); PyTorch's enable_load_balance.
  bool load_balanced = true;
  // Merge partial outputs and accumulate gradients in float32 (PyTorch's convert_to_f32).
  bool convert_to_f32 = true;
  // Softmax scale; unset: head_dim^-0.5.
  std::optional<double> scale;
};

// The attention output [batch, heads, local_seq, head_dim], differentiable in q, k, v.
at::Tensor RingAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                         const comm::ProcessGroupPtr& group, const RingAttentionOptions& options = {});

}  // namespace fsdp::context_parallel

#endif  // FSDP_CONTEXT_PARALLEL_RING_ATTENTION_H_
