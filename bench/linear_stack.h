// A stack of `blocks` Linear(dim, dim) layers of type Layer (plain, FSDP1- or FSDP2-wrapped):
// the overhead-bound model of the step benchmarks (compute ~nothing, many parameters).
#ifndef FSDP_BENCH_LINEAR_STACK_H_
#define FSDP_BENCH_LINEAR_STACK_H_

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <vector>

#include "absl/strings/str_cat.h"

namespace fsdp::bench {

template <class Layer>
struct LinearStackImpl : torch::nn::Module {
  LinearStackImpl(int64_t blocks, int64_t dim) {
    for (int64_t i = 0; i < blocks; ++i) layers.push_back(register_module(absl::StrCat("l", i), Layer(dim, dim)));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& layer : layers) h = layer(h);
    return h;
  }
  std::vector<Layer> layers;
};

}  // namespace fsdp::bench

#endif  // FSDP_BENCH_LINEAR_STACK_H_
