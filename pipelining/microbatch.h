// Splitting a step's batch into microbatches and merging the last stage's outputs back, as
// PyTorch 2.15's torch/distributed/pipelining/microbatch.py does with its default specs
// (TensorChunkSpec(0) for every argument and the target, concatenation along dim 0 for the
// outputs).
//
// Contract: every tensor to split is defined and has at least `n` rows along `dim`; the
// pieces are torch.tensor_split's (sizes differ by at most one, the larger ones first),
// views of the input. Errors (c10::Error) name the argument, its index and the bad value:
// n < 1, an undefined tensor, a dim out of range, fewer rows than microbatches. Stateless;
// callable from any thread.
#ifndef FSDP_PIPELINING_MICROBATCH_H_
#define FSDP_PIPELINING_MICROBATCH_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace fsdp::pipelining {

// result[m][i] is microbatch m's piece of args[i] (split_args_kwargs_into_chunks).
std::vector<std::vector<at::Tensor>> SplitIntoMicrobatches(const std::vector<at::Tensor>& args, int n, int64_t dim = 0);

// The pieces of one tensor (the target): result[m] is microbatch m's.
std::vector<at::Tensor> SplitTensorIntoMicrobatches(const at::Tensor& tensor, int n, int64_t dim = 0);

// merge_chunks: result[i] concatenates chunks[m][i] over m along `dim`. Every chunk holds the
// same number of tensors.
std::vector<at::Tensor> MergeMicrobatches(const std::vector<std::vector<at::Tensor>>& chunks, int64_t dim = 0);

}  // namespace fsdp::pipelining

#endif  // FSDP_PIPELINING_MICROBATCH_H_
