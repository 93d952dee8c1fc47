// bench/optim_state: consolidating FSDP2's sharded AdamW state into the full FQN-keyed state
// (GetFullOptimStateDict) vs the raw all-gathers of the same bytes, and loading a full state
// back into shards (LoadFullOptimStateDict) vs copying this rank's share of the bytes.
// W processes (./x run -n W); every rank runs the same benchmarks with fixed iteration
// counts, rank 0 reports. Pairs "<Op>/ours/<bytes>" vs "<Op>/raw/<bytes>" for
// tools/bench_ratio.py; <bytes> is the full state's size.
//
//   ./x run -n 2 "$(bazel info --config=opt bazel-bin)/bench/optim_state_bench" --pair_repetitions=3
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <benchmark/benchmark.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/pair_flags.h"
#include "comm/gloo_process_group.h"
#include "comm/main_guard.h"
#include "fsdp/fsdp2/fsdp_param.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "optim_state/fsdp2_optim_state.h"

namespace {

using fsdp::Hooked;

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width) : fc(register_module("fc", torch::nn::Linear(width, width))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc(x).relu(); }
  torch::nn::Linear fc;
};

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t blocks, int64_t width) {
    for (int64_t i = 0; i < blocks; ++i)
      layers.push_back(register_module(absl::StrCat("block", i), Hooked<BlockImpl>(width)));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& b : layers) h = b(h);
    return h;
  }
  std::vector<Hooked<BlockImpl>> layers;
};

struct Setup {
  fsdp::comm::ProcessGroupPtr world;
  std::shared_ptr<fsdp::HookedImpl<NetImpl>> model;
  std::unique_ptr<torch::optim::AdamW> opt;
  fsdp::optim_state::OptimStateDict full;
  std::vector<std::pair<at::Tensor, at::Tensor>> gathers;  // (local shard, full output) per state tensor
  int64_t full_bytes = 0;
  int64_t local_bytes = 0;
};

Setup& S() {
  static Setup s;
  return s;
}

void Init(int64_t blocks, int64_t width) {
  Setup& s = S();
  s.world = fsdp::comm::CreateGlooProcessGroupFromEnv();
  auto mesh = fsdp::mesh::DeviceMesh::Create(s.world, {s.world->size()});
  s.model = std::make_shared<fsdp::HookedImpl<NetImpl>>(blocks, width);
  for (auto& b : s.model->layers) fsdp::fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
  fsdp::fsdp2::fully_shard(s.model, {.mesh = mesh});
  s.opt = std::make_unique<torch::optim::AdamW>(s.model->parameters(), torch::optim::AdamWOptions(1e-3));
  s.model->forward(at::randn({8, width}, at::make_generator<at::CPUGeneratorImpl>(1))).square().mean().backward();
  s.opt->step();
  s.full = fsdp::optim_state::GetFullOptimStateDict(*s.model, *s.opt);
  // The raw side: one all-gather per positive-dim state tensor, of the padded shard FSDP holds.
  for (const auto& [fqn, values] : s.full.state) {
    for (const auto& [name, value] : values) {
      if (const auto* t = std::get_if<at::Tensor>(&value); t && t->dim() > 0) {
        const int64_t w = s.world->size(), rows = (t->size(0) + w - 1) / w;
        const int64_t shard = rows * (t->numel() / t->size(0));
        s.gathers.emplace_back(at::ones({shard}), at::empty({shard * w}));
        s.full_bytes += t->nbytes();
        s.local_bytes += shard * 4;
      }
    }
  }
}

void BM_Consolidate(benchmark::State& state, bool ours) {
  Setup& s = S();
  for (auto _ : state) {
    if (ours) {
      benchmark::DoNotOptimize(fsdp::optim_state::GetFullOptimStateDict(*s.model, *s.opt).state.size());
    } else {
      for (auto& [in, out] : s.gathers) s.world->all_gather_into_tensor(out, in)->wait();
    }
  }
  state.SetBytesProcessed(state.iterations() * s.full_bytes);
}

void BM_Load(benchmark::State& state, bool ours) {
  Setup& s = S();
  const at::Tensor src = at::ones({s.local_bytes / 4}), dst = at::empty({s.local_bytes / 4});
  for (auto _ : state) {
    if (ours) {
      fsdp::optim_state::LoadFullOptimStateDict(*s.model, *s.opt, s.full);
    } else {
      dst.copy_(src);
    }
  }
  state.SetBytesProcessed(state.iterations() * s.local_bytes);
}

}  // namespace

int main(int argc, char** argv) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain([&]() -> int {
    at::set_num_threads(1);
    Init(/*blocks=*/8, /*width=*/512);
    std::vector<char*> args(argv, argv + argc);
    const int pair_repetitions = fsdp::bench::TakePairRepetitions(args);
    fsdp::bench::QuietUnlessRankZero(args, S().world->rank());
    int args_count = static_cast<int>(args.size());
    benchmark::Initialize(&args_count, args.data());
    for (int rep = 0; rep < pair_repetitions; ++rep) {
      for (bool ours : {true, false}) {
        const char* side = ours ? "ours" : "raw";
        benchmark::RegisterBenchmark(absl::StrCat("Consolidate/", side, "/", S().full_bytes).c_str(), BM_Consolidate,
                                     ours)
            ->Iterations(10)
            ->UseRealTime();
        benchmark::RegisterBenchmark(absl::StrCat("Load/", side, "/", S().full_bytes).c_str(), BM_Load, ours)
            ->Iterations(10)
            ->UseRealTime();
      }
    }
    benchmark::RunSpecifiedBenchmarks();
    S().world->barrier()->wait();
    benchmark::Shutdown();
    return 0;
  });
}
