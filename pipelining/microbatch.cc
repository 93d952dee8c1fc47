#include "pipelining/microbatch.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/tensor_split.h>
#include <c10/util/Exception.h>

#include <string>

namespace fsdp::pipelining {
namespace {

std::vector<at::Tensor> Split(const at::Tensor& tensor, int n, int64_t dim, const std::string& what) {
  TORCH_CHECK(tensor.defined(), what, " is undefined: cannot split it into microbatches");
  TORCH_CHECK(tensor.dim() > 0, what, " is 0-D: cannot split it into microbatches along dim ", dim);
  TORCH_CHECK(dim >= -tensor.dim() && dim < tensor.dim(), "dim ", dim, " is out of range for ", what, " of shape ",
              tensor.sizes());
  TORCH_CHECK(tensor.size(dim) >= n, what, " has ", tensor.size(dim), " rows along dim ", dim, ", fewer than the ", n,
              " microbatches (n_microbatches)");
  return at::tensor_split(tensor, n, dim);
}

void CheckCount(int n) { TORCH_CHECK(n >= 1, "n_microbatches must be at least 1, got ", n); }

}  // namespace

std::vector<std::vector<at::Tensor>> SplitIntoMicrobatches(const std::vector<at::Tensor>& args, int n, int64_t dim) {
  CheckCount(n);
  std::vector<std::vector<at::Tensor>> out(n);
  for (size_t i = 0; i < args.size(); ++i) {
    std::vector<at::Tensor> pieces = Split(args[i], n, dim, "args[" + std::to_string(i) + "]");
    for (int m = 0; m < n; ++m) out[m].push_back(std::move(pieces[m]));
  }
  return out;
}

std::vector<at::Tensor> SplitTensorIntoMicrobatches(const at::Tensor& tensor, int n, int64_t dim) {
  CheckCount(n);
  return Split(tensor, n, dim, "target");
}

std::vector<at::Tensor> MergeMicrobatches(const std::vector<std::vector<at::Tensor>>& chunks, int64_t dim) {
  if (chunks.empty()) return {};
  const size_t width = chunks[0].size();
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < width; ++i) {
    std::vector<at::Tensor> column;
    for (size_t m = 0; m < chunks.size(); ++m) {
      TORCH_CHECK(chunks[m].size() == width, "microbatch ", m, " produced ", chunks[m].size(),
                  " outputs, microbatch 0 produced ", width);
      column.push_back(chunks[m][i]);
    }
    out.push_back(at::cat(column, dim));
  }
  return out;
}

}  // namespace fsdp::pipelining
