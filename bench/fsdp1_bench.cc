// bench/fsdp1: FSDP1 (flat-parameter FSDP, wrap_fsdp) CPU costs, single process.
//
// 1. Flatten/{ours,cat}/<n>: building a FlatParamHandle over <n> small parameters
//    (Linear(16, 16)-shaped: weights [16, 16] and biases [16] alternating) and Shard()ing it
//    at rank 0 of a Fake group of 4, vs a plain at::cat of the same flattened tensors (what
//    the flattening itself costs). Fresh parameters are made outside the timed region on
//    both sides (the handle consumes them: they become views and then 0-element tensors).
// 2. Unflatten/{ours,narrow}/<n>: FlatParamHandle::GetUnflatViews() of the unsharded flat
//    parameter vs a plain loop of flat.narrow(0, offset, numel).view(shape).
// 3. Step/{ours,fsdp2}/<blocks>: one training step (forward, backward, SGD step, zero_grad)
//    of <blocks> Linear(16, 16) layers, each its own FSDP unit plus the root: FSDP1
//    (wrap_fsdp per layer, then the root; FULL_SHARD, BACKWARD_PRE prefetch, the optimizer
//    gets the flat parameters) vs FSDP2 (fully_shard per layer, then the root), both at
//    rank 0 of a Fake group of 4 (the Fake "collectives" are a few copy_ calls). The ratio is
//    FSDP1 / FSDP2 time. Plain/raw/<blocks>: the same model without FSDP (unpaired, for
//    tools/callgrind_budget.py's FSDP1 instructions per module beyond plain LibTorch).
//
// Names follow tools/bench_ratio.py's "<Op>/ours/<arg>" vs "<Op>/<ref>/<arg>" pairing; the
// ratio is ours / ref time. Everything runs on one intra-op thread (see main).
// --callgrind_iterations=N runs each benchmark N iterations, once (tools/callgrind_bench.sh
// counts the Unflatten and Step loops' instructions).
//
//   bazel build --config=opt //bench:fsdp1_bench
//   bazel-bin/bench/fsdp1_bench [--pair_repetitions=3] --benchmark_out=bench/out/fsdp1.json
//   python3 tools/bench_ratio.py bench/out/fsdp1.json
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/callgrind_loop.h"
#include "bench/linear_stack.h"
#include "bench/pair_flags.h"
#include "comm/fake_process_group.h"
#include "comm/main_guard.h"
#include "fsdp/fsdp1/flat_param.h"
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "mesh/device_mesh.h"

namespace {

constexpr int kWorld = 4;  // this process is rank 0 of 4
constexpr int64_t kDim = 16;
constexpr int64_t kBatch = 8;

// ---- 1, 2. flatten / unflatten ----

// One module holding n Linear-shaped parameters p0, p1, ... (weight, bias, weight, ...).
struct Params {
  std::shared_ptr<torch::nn::Module> module = std::make_shared<torch::nn::Module>();
  std::vector<at::Tensor> tensors;
};

Params MakeParams(int64_t n) {
  Params p;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor t = i % 2 == 0 ? at::randn({kDim, kDim}) : at::randn({kDim});
    p.tensors.push_back(p.module->register_parameter(absl::StrCat("p", i), t));
  }
  return p;
}

fsdp::fsdp1::FlatParamHandleOptions HandleOptions() {
  fsdp::fsdp1::FlatParamHandleOptions o;
  o.process_group = fsdp::comm::CreateFakeProcessGroup(0, kWorld);
  return o;
}

void BM_Flatten(benchmark::State& state, bool ours) {
  const int64_t n = state.range(0);
  const auto options = HandleOptions();
  for (auto _ : state) {
    state.PauseTiming();
    Params p = MakeParams(n);
    state.ResumeTiming();
    if (ours) {
      fsdp::fsdp1::FlatParamHandle h(p.tensors, *p.module, options);
      h.Shard();
      benchmark::DoNotOptimize(h.flat_param().param.data_ptr());
    } else {
      std::vector<at::Tensor> flat;
      flat.reserve(p.tensors.size());
      for (const at::Tensor& t : p.tensors) flat.push_back(t.detach().flatten());
      const at::Tensor cat = at::cat(flat);
      benchmark::DoNotOptimize(cat.data_ptr());
    }
    state.PauseTiming();
    p = Params();  // freed outside the timed region on both sides
    state.ResumeTiming();
  }
  state.counters["params"] = static_cast<double>(n);
}

void BM_Unflatten(benchmark::State& state, bool ours) {
  const int64_t n = state.range(0);
  Params p = MakeParams(n);
  std::vector<std::vector<int64_t>> shapes;
  for (const at::Tensor& t : p.tensors) shapes.push_back(t.sizes().vec());
  fsdp::fsdp1::FlatParamHandle h(p.tensors, *p.module, HandleOptions());  // unsharded
  const at::Tensor flat = h.flat_param().param.detach();
  fsdp::bench::TimedLoop(state, absl::StrCat(ours ? "Unflatten/ours/" : "Unflatten/narrow/", n), [&] {
    if (ours) {
      std::vector<at::Tensor> views = h.GetUnflatViews();
      benchmark::DoNotOptimize(views.back().data_ptr());
    } else {
      std::vector<at::Tensor> views;
      views.reserve(shapes.size());
      int64_t offset = 0;
      for (const auto& shape : shapes) {
        const int64_t numel = c10::multiply_integers(shape);
        views.push_back(flat.narrow(0, offset, numel).view(shape));
        offset += numel;
      }
      benchmark::DoNotOptimize(views.back().data_ptr());
    }
  });
  state.counters["params"] = static_cast<double>(n);
}

// ---- 3. one training step, FSDP1 vs FSDP2 ----

template <class Layer>
using NetImpl = fsdp::bench::LinearStackImpl<Layer>;
using Fsdp1Linear = fsdp::Hooked<torch::nn::LinearImpl>;
using Fsdp1Net = fsdp::HookedImpl<NetImpl<Fsdp1Linear>>;
using Fsdp2Linear = fsdp::Hooked<torch::nn::LinearImpl>;
using Fsdp2Net = fsdp::HookedImpl<NetImpl<Fsdp2Linear>>;

template <class Net>
void RunSteps(benchmark::State& state, Net& net, const std::vector<at::Tensor>& params, const std::string& label) {
  torch::optim::SGD opt(params, torch::optim::SGDOptions(1e-4));
  const at::Tensor x = at::randn({kBatch, kDim});
  auto step = [&] {
    net.forward(x).sum().backward();
    opt.step();
    opt.zero_grad();
  };
  for (int i = 0; i < 3; ++i) step();  // lazy init, allocator warm-up
  fsdp::bench::TimedLoop(state, label, step);
  state.counters["params"] = static_cast<double>(2 * state.range(0));
}

enum class StepSide { kFsdp1, kFsdp2, kPlain };

void BM_Step(benchmark::State& state, StepSide side) {
  const int64_t blocks = state.range(0);
  if (side == StepSide::kPlain) {
    NetImpl<torch::nn::Linear> net(blocks, kDim);
    return RunSteps(state, net, net.parameters(), absl::StrCat("Plain/raw/", blocks));
  }
  const bool fsdp1 = side == StepSide::kFsdp1;
  const std::string label = absl::StrCat(fsdp1 ? "Step/ours/" : "Step/fsdp2/", blocks);
  if (fsdp1) {
    auto net = std::make_shared<Fsdp1Net>(blocks, kDim);
    const fsdp::fsdp1::FSDPOptions options{.process_group = fsdp::comm::CreateFakeProcessGroup(0, kWorld)};
    for (auto& layer : net->layers) fsdp::fsdp1::wrap_fsdp(layer.ptr(), options);
    const fsdp::fsdp1::FullyShardedDataParallel root = fsdp::fsdp1::wrap_fsdp(net, options);
    return RunSteps(state, *net, root.parameters(), label);  // the flat parameters
  }
  auto net = std::make_shared<Fsdp2Net>(blocks, kDim);
  const fsdp::fsdp2::FullyShardOptions options{
      .mesh = fsdp::mesh::DeviceMesh::Create(fsdp::comm::CreateFakeProcessGroup(0, kWorld), {kWorld})};
  for (auto& layer : net->layers) fsdp::fsdp2::fully_shard(layer.ptr(), options);
  fsdp::fsdp2::fully_shard(net, options);
  RunSteps(state, *net, net->parameters(), label);  // the sharded parameters
}

// iterations > 0: each benchmark runs exactly that many iterations (for instruction counts).
void RegisterAll(int pair_repetitions, int iterations) {
  auto fixed = [iterations](benchmark::internal::Benchmark* b) {
    if (iterations > 0) b->Iterations(iterations);
  };
  // Ours and the reference alternate, repeated as pairs, so machine noise hits both alike;
  // bench_ratio.py takes the median of each side.
  for (int rep = 0; rep < pair_repetitions; ++rep) {
    for (int64_t n : {16, 64, 256}) {
      for (bool ours : {true, false}) {
        fixed(benchmark::RegisterBenchmark(ours ? "Flatten/ours" : "Flatten/cat", BM_Flatten, ours)
                  ->Arg(n)
                  ->Unit(benchmark::kMicrosecond)
                  ->UseRealTime());
      }
      for (bool ours : {true, false}) {
        fixed(benchmark::RegisterBenchmark(ours ? "Unflatten/ours" : "Unflatten/narrow", BM_Unflatten, ours)
                  ->Arg(n)
                  ->Unit(benchmark::kMicrosecond)
                  ->UseRealTime());
      }
    }
    for (int64_t blocks : {8, 32}) {
      for (auto [name, side] : {std::pair{"Step/ours", StepSide::kFsdp1}, std::pair{"Step/fsdp2", StepSide::kFsdp2},
                                std::pair{"Plain/raw", StepSide::kPlain}}) {
        fixed(benchmark::RegisterBenchmark(name, BM_Step, side)
                  ->Arg(blocks)
                  ->Unit(benchmark::kMicrosecond)
                  ->UseRealTime());
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain([&]() -> int {
    std::vector<char*> args(argv, argv + argc);
    const int pair_repetitions = fsdp::bench::TakePairRepetitions(args);
    const int callgrind_iterations = fsdp::bench::TakeIntFlag(args, "--callgrind_iterations=", 0);
    // One intra-op thread, as bench/fsdp2 (repeatable numbers on a shared 2-core machine).
    at::set_num_threads(1);
    int args_count = static_cast<int>(args.size());
    benchmark::Initialize(&args_count, args.data());
    RegisterAll(pair_repetitions, callgrind_iterations);
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return 0;
  });
}
