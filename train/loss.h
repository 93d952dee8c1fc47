// torchtitan's training loss (torchtitan/components/loss.py, cross_entropy_loss): the
// cross-entropy summed over the valid tokens (labels != -100), on float32 logits; the trainer
// divides it by the global count of valid tokens, so that gradient accumulation and data
// parallelism give the mean over every token of the global batch.
//
// Contract: `logits` [batch, seq, vocab] (or this rank's vocab slice of them, when they carry
// ApplyTensorParallel's vocab-sharded DTensor layout: loss parallel, no gather), `labels`
// [batch, seq] int64 already aligned with the logits (the data loader shifts within each
// document). Returns a scalar, differentiable in logits. Bad shapes are c10::Errors.
#ifndef FSDP_TRAIN_LOSS_H_
#define FSDP_TRAIN_LOSS_H_

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace fsdp::train {

inline constexpr int64_t kIgnoreIndex = -100;  // torchtitan's IGNORE_INDEX

at::Tensor CrossEntropySum(const at::Tensor& logits, const at::Tensor& labels);

}  // namespace fsdp::train

#endif  // FSDP_TRAIN_LOSS_H_
