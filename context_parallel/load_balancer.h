// The sequence layout of context parallelism: PyTorch 2.15's head-tail load balancer
// (_context_parallel/_load_balancer.py, _HeadTailLoadBalancer) and context_parallel_unshard.
//
// Causal attention's work grows along the sequence, so W equal contiguous pieces give the last
// rank W times the first rank's. Head-tail cuts the sequence into 2W chunks and gives rank r
// chunks r and 2W-1-r: every rank the same work. RingAttention (ring_attention.h) with
// load_balanced = true expects q, k, v sharded so; the input ids, labels and position ids go
// through the same ShardSequence so that each token keeps its targets and its rotary position.
//
// Errors (c10::Error naming the argument): a sequence length not divisible by 2W (W without
// load balancing), a rank outside [0, W), a dim outside the tensor.
#ifndef FSDP_CONTEXT_PARALLEL_LOAD_BALANCER_H_
#define FSDP_CONTEXT_PARALLEL_LOAD_BALANCER_H_

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "comm/process_group.h"

namespace fsdp::context_parallel {

// Rank `cp_rank`'s part of `buffer` along `seq_dim` (a copy): chunks r and 2W-1-r of 2W, or
// chunk r of W without load balancing.
at::Tensor ShardSequence(const at::Tensor& buffer, int64_t seq_dim, int64_t cp_rank, int64_t cp_size,
                         bool load_balanced = true);

// The positions (0-based) of rank `cp_rank`'s part in the full sequence of `seq_len`.
at::Tensor ShardPositions(int64_t seq_len, int64_t cp_rank, int64_t cp_size, bool load_balanced = true);

// context_parallel_unshard: every rank's part all-gathered over `group` (collective), in the
// original order along `seq_dim`.
at::Tensor UnshardSequence(const at::Tensor& local, int64_t seq_dim, const comm::ProcessGroupPtr& group,
                           bool load_balanced = true);

}  // namespace fsdp::context_parallel

#endif  // FSDP_CONTEXT_PARALLEL_LOAD_BALANCER_H_
