// bench/float8: the float8 linears' CPU cost per step beyond the matmuls, single process.
//
// Step/{ours,raw}/<blocks>: one training step (forward, backward, SGD step, zero_grad) of
// <blocks> Linear(16, 16) layers, converted by convert_to_float8_training (tensorwise recipe:
// three float8 matmuls with six dynamic casts per layer) or plain (raw), batch 16, one intra-op
// thread. Compute is small, so ours - raw is what float8 adds per layer: the amaxes, scales and
// casts, the _scaled_mm calls and the autograd node; the slope over block counts is its cost
// per float8 Linear. In the same run, torchao 0.18's twin (bench/peer/float8_step_peer.py:
// the same stack under torchao's convert_to_float8_training, eager; --peer=0 skips it).
//
//   bazel build --config=opt //bench:float8_bench
//   bazel-bin/bench/float8_bench [--pair_repetitions=3] [--peer=0] --benchmark_out=bench/out/float8.json
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/nn/modules/linear.h>

#include <vector>

#include "bench/linear_stack.h"
#include "bench/step_slope.h"
#include "float8/float8_linear.h"
#include "fsdp/hooked_module/hooked_module.h"

namespace {

constexpr int64_t kDim = 16;  // float8 needs multiples of 16
constexpr int64_t kBatch = 16;

using Net = fsdp::bench::LinearStackImpl<fsdp::Hooked<torch::nn::LinearImpl>>;

void BM_Step(benchmark::State& state, bool ours) {
  Net net(state.range(0), kDim);
  if (ours) fsdp::float8::convert_to_float8_training(net);
  fsdp::bench::RunTrainingSteps(state, net, kBatch, kDim);
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::bench::RunStepSlopeMain(
      argc, argv,
      {"float8 step", "float8 Linear", "bench/peer/float8_step_peer.py", "float8", "torchao 0.18 float8 (eager)"},
      BM_Step);
}
