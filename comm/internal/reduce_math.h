// Reference reduction used by in-process backends.
#ifndef FSDP_COMM_INTERNAL_REDUCE_MATH_H_
#define FSDP_COMM_INTERNAL_REDUCE_MATH_H_

#include <ATen/core/Tensor.h>

#include <vector>

#include "comm/reduce_op.h"

namespace fsdp::comm::internal {

// Reduces equally shaped tensors (one per rank, in rank order) with `op`, accumulating
// f16/bf16 in f32 and rounding once; returns a new tensor of the inputs' dtype and shape.
// AVG divides by xs.size(); PREMUL_SUM multiplies each term by op.factor().
at::Tensor ReduceInRankOrder(const std::vector<at::Tensor>& xs, ReduceOp op);

}  // namespace fsdp::comm::internal

#endif  // FSDP_COMM_INTERNAL_REDUCE_MATH_H_
