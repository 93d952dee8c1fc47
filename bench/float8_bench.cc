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
#include <torch/optim/sgd.h>

#include <vector>

#include "bench/linear_stack.h"
#include "bench/pair_flags.h"
#include "bench/step_slope.h"
#include "comm/main_guard.h"
#include "float8/float8_linear.h"
#include "fsdp/hooked_module/hooked_module.h"

namespace {

constexpr int64_t kDim = 16;  // float8 needs multiples of 16
constexpr int64_t kBatch = 16;

using Net = fsdp::bench::LinearStackImpl<fsdp::Hooked<torch::nn::LinearImpl>>;

void BM_Step(benchmark::State& state, bool ours) {
  Net net(state.range(0), kDim);
  if (ours) fsdp::float8::convert_to_float8_training(net);
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(1e-4));
  const at::Tensor x = at::randn({kBatch, kDim});
  auto step = [&] {
    net.forward(x).sum().backward();
    opt.step();
    opt.zero_grad();
  };
  for (int i = 0; i < 3; ++i) step();  // allocator warm-up
  for (auto _ : state) step();
}

}  // namespace

int main(int argc, char** argv) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain([&]() -> int {
    std::vector<char*> args(argv, argv + argc);
    const int pair_repetitions = fsdp::bench::TakePairRepetitions(args);
    const bool peer = fsdp::bench::TakeIntFlag(args, "--peer=", 1) != 0;
    at::set_num_threads(1);  // as bench/tp: repeatable on a shared 2-core machine
    int args_count = static_cast<int>(args.size());
    benchmark::Initialize(&args_count, args.data());
    // Ours and raw alternate, repeated as pairs, so machine noise hits both alike.
    for (int rep = 0; rep < pair_repetitions; ++rep) {
      for (int64_t blocks : {16, 64}) {
        for (bool ours : {true, false}) {
          benchmark::RegisterBenchmark(ours ? "Step/ours" : "Step/raw", BM_Step, ours)
              ->Arg(blocks)
              ->Unit(benchmark::kMicrosecond)
              ->UseRealTime();
        }
      }
    }
    fsdp::bench::StepSlopeReporter reporter("float8 step", "float8 Linear");
    benchmark::RunSpecifiedBenchmarks(&reporter);
    const char* twin = "torchao 0.18 float8 (eager)";
    reporter.PrintSummary(
        peer ? fsdp::bench::RunPeerStepSlope("bench/peer/float8_step_peer.py", "float8", twin, pair_repetitions)
             : std::nullopt,
        twin);
    benchmark::Shutdown();
    return 0;
  });
}
