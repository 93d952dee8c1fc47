// bench/comm: all-gather and reduce-scatter through our Gloo adapter vs calling
// c10d::ProcessGroupGloo directly, same sizes, interleaved in one run; and point-to-point: a
// round trip of a message between ranks 0 and 1 (send, then recv of the reply; the other
// ranks idle), through ours vs c10d's send / recv.
//
// Run as W processes with the torchrun environment (`./x bench` uses `./x run -n 2`). Every
// rank runs the same fixed-iteration sequence (the collectives must match across ranks),
// only rank 0 reports. tools/bench_ratio.py prints ours/c10d per size from the JSON.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/pair_flags.h"
#include "comm/gloo_process_group.h"
#include "comm/main_guard.h"
#include "comm/torchrun_env.h"

namespace {

using fsdp::comm::ProcessGroupPtr;

struct Groups {
  int rank = 0;
  int world = 1;
  ProcessGroupPtr ours;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> direct;
};

Groups& G() {
  static Groups groups;
  return groups;
}

// Each path gets its own store and gloo context, configured identically.
void InitGroups() {
  const fsdp::comm::TorchrunEnv env = fsdp::comm::ReadTorchrunEnv();
  Groups& g = G();
  g.rank = env.rank;
  g.world = env.world_size;
  const std::string base = absl::StrCat("/tmp/fsdp_comm_bench_", env.master_port);
  fsdp::comm::GlooOptions options;
  options.hostname = "127.0.0.1";  // both sides on the same explicit transport
  g.ours = fsdp::comm::CreateGlooProcessGroupWithFileStore(base + "_ours", env.rank, env.world_size, options);
  auto store = c10::make_intrusive<c10d::FileStore>(base + "_direct", env.world_size);
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
  gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(options.hostname));
  gloo_options->threads = options.threads;
  g.direct = c10::make_intrusive<c10d::ProcessGroupGloo>(store, env.rank, env.world_size, gloo_options);
}

int64_t Iterations(int64_t bytes) {
  const int64_t budget = int64_t{256} << 20;  // ~256 MiB moved per benchmark
  return std::max<int64_t>(10, std::min<int64_t>(400, budget / std::max<int64_t>(bytes, 1)));
}

// Shard bytes = state.range(0) per rank; `ours` picks the path.
void BM_AllGather(benchmark::State& state, bool ours) {
  const int64_t n = state.range(0) / 4;
  at::Tensor in = at::ones({n});
  at::Tensor out = at::empty({n * G().world});
  for (auto _ : state) {
    if (ours) {
      G().ours->all_gather_into_tensor(out, in)->wait();
    } else {
      G().direct->all_gather_single(out, in)->wait();
    }
  }
  state.SetBytesProcessed(state.iterations() * out.nbytes());
}

void BM_ReduceScatter(benchmark::State& state, bool ours) {
  const int64_t n = state.range(0) / 4;
  at::Tensor in = at::ones({n * G().world});
  at::Tensor out = at::empty({n});
  for (auto _ : state) {
    if (ours) {
      G().ours->reduce_scatter_tensor(out, in)->wait();
    } else {
      G().direct->reduce_scatter_single(out, in)->wait();
    }
  }
  state.SetBytesProcessed(state.iterations() * in.nbytes());
}

// Bytes = state.range(0) each way.
void BM_SendRecv(benchmark::State& state, bool ours) {
  const int rank = G().rank;
  at::Tensor message = at::ones({state.range(0) / 4});
  const auto send = [&](int peer) {
    if (ours) return G().ours->send(message, peer, 0)->wait();
    std::vector<at::Tensor> t{message};
    G().direct->send(t, peer, 0)->wait();
  };
  const auto recv = [&](int peer) {
    if (ours) return G().ours->recv(message, peer, 0)->wait();
    std::vector<at::Tensor> t{message};
    G().direct->recv(t, peer, 0)->wait();
  };
  for (auto _ : state) {
    if (rank == 0) {
      send(1);
      recv(1);
    } else if (rank == 1) {
      recv(0);
      send(0);
    }
  }
  state.SetBytesProcessed(state.iterations() * 2 * message.nbytes());
}

void RegisterAll(int pair_repetitions) {
  for (int64_t bytes = 1 << 10; bytes <= (int64_t{64} << 20); bytes *= 4) {
    const int64_t iters = Iterations(bytes * G().world);
    // Ours and c10d alternate (repeated as pairs) so machine noise hits both alike;
    // bench_ratio.py takes the median of each side.
    for (int rep = 0; rep < pair_repetitions; ++rep) {
      for (auto [name, fn] : {std::pair{"AllGather", &BM_AllGather}, std::pair{"ReduceScatter", &BM_ReduceScatter},
                              std::pair{"SendRecv", &BM_SendRecv}}) {
        for (bool ours : {true, false}) {
          benchmark::RegisterBenchmark(absl::StrCat(name, ours ? "/ours" : "/c10d").c_str(), fn, ours)
              ->Arg(bytes)
              ->Iterations(iters)
              ->UseRealTime();
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain([&]() -> int {
    InitGroups();
    // Only rank 0 reports; the others run the same sequence silently.
    std::vector<char*> args(argv, argv + argc);
    const int pair_repetitions = fsdp::bench::TakePairRepetitions(args);
    fsdp::bench::QuietUnlessRankZero(args, G().rank);
    int args_count = static_cast<int>(args.size());
    benchmark::Initialize(&args_count, args.data());
    RegisterAll(pair_repetitions);
    benchmark::RunSpecifiedBenchmarks();
    G().ours->barrier()->wait();
    if (G().rank == 0) {
      const std::string base = absl::StrCat("/tmp/fsdp_comm_bench_", fsdp::comm::ReadTorchrunEnv().master_port);
      std::remove((base + "_ours").c_str());
      std::remove((base + "_direct").c_str());
    }
    benchmark::Shutdown();
    return 0;
  });
}
