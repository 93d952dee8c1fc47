// Cross entropy over logits sharded on the class dimension, without gathering them:
// F.cross_entropy under PyTorch 2.15's loss_parallel() context
// (torch/distributed/tensor/parallel/loss.py).
//
//   // lm_head: ColwiseParallel({.output_layouts = Shard(-1), .use_local_output = false})
//   at::Tensor logits = model->forward(tokens);                    // local [B, S, V/tp]
//   DTensor d = *tensor_parallel::AsDTensor(logits);                       // its layout
//   DTensor flat = DTensor::from_local(logits.flatten(0, 1), d.device_mesh(), {Shard(1)},
//                                      std::vector<int64_t>{B * S, V});
//   at::Tensor loss = tensor_parallel::loss_parallel_cross_entropy(flat, labels.flatten());
//
// Forward: three all-reduces over the class dimension's group (the row max, the sum of
// exponentials, the target logit), as PyTorch's; backward: none (softmax minus the one-hot
// target, on this rank's classes). The loss is the same on every rank.
//
// Contract: logits is [N, C] (or [C], or [N, C, d1, ...]) with the class dim (1; 0 for
// 1-D) sharded on exactly one mesh dim and every other mesh dim Replicate; target holds
// class indices (int64), the same on every rank, shape logits' without the class dim.
// reduction kMean is defined on a 1-D mesh only (PyTorch's restriction). Errors
// (c10::Error) name the argument and its bad value; a target index out of [0, C) other
// than ignore_index is an error. Collective over the class dim's group.
#ifndef FSDP_TENSOR_PARALLEL_LOSS_PARALLEL_H_
#define FSDP_TENSOR_PARALLEL_LOSS_PARALLEL_H_

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "dtensor/dtensor.h"

namespace fsdp::tensor_parallel {

enum class LossReduction { kNone, kMean, kSum };

struct LossParallelOptions {
  LossReduction reduction = LossReduction::kMean;
  int64_t ignore_index = -100;
};

// The loss (a scalar; the target's shape for kNone), differentiable in logits.
at::Tensor loss_parallel_cross_entropy(const dtensor::DTensor& logits, const at::Tensor& target,
                                       const LossParallelOptions& options = {});

}  // namespace fsdp::tensor_parallel

#endif  // FSDP_TENSOR_PARALLEL_LOSS_PARALLEL_H_
