// bench/context_parallel: ring attention (context_parallel/ring_attention.h) on W Gloo
// processes (`./x run -n W bazel-bin/bench/context_parallel_bench`), rank 0 reporting.
//
// Ring/<seq>: one causal attention forward and backward over a sequence of <seq> tokens
// sharded head-tail over the W ranks (q, k, v [1, 8 heads, seq / W, 64], float32, the
// all-gather ring). OneRank/<seq>: what each rank would compute without context parallelism,
// the CPU flash kernel's forward and backward over the whole sequence. Comm/<seq>: the ring's
// collectives alone with the same sizes (the forward's and the backward's all-gather of the
// key / value blocks, the backward's W all_to_all_single of their gradients). The summary
// prints OneRank / Ring (the speed-up) and Comm / Ring (the communication's share).
// RingContiguous/<seq>: the same ring on contiguous shards, without load balancing: its time is
// the most loaded rank's (a barrier starts each call), so RingContiguous / Ring is what the
// head-tail balancer saves.
//
// Overhead/ours: the ring's host cost per call, forward and backward of a tiny sequence (two
// tokens per chunk, one head of 8), where the kernels and messages are small; in the same run
// Overhead/pytorch, PyTorch 2.15's _templated_ring_attention and its backward over the same
// kernels with the same shapes on W Gloo processes (bench/peer/context_parallel_peer.py;
// --peer=0 skips it). PyTorch / ours is the summary's last line.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/pair_flags.h"
#include "comm/gloo_process_group.h"
#include "comm/main_guard.h"
#include "context_parallel/load_balancer.h"
#include "context_parallel/ring_attention.h"
#include "testing/peer_python.h"

namespace {

namespace cp = fsdp::context_parallel;

constexpr int64_t kHeads = 8, kDim = 64;
constexpr int64_t kTinyDim = 8;

fsdp::comm::ProcessGroupPtr& Group() {
  static fsdp::comm::ProcessGroupPtr group;
  return group;
}

std::map<std::string, std::vector<double>>& Times() {
  static std::map<std::string, std::vector<double>> times;
  return times;
}
std::map<std::string, std::vector<double>>& CpuTimes() {
  static std::map<std::string, std::vector<double>> times;
  return times;
}

// Every rank runs every benchmark; a barrier before each timed call lines the ranks up.
void BM_Ring(benchmark::State& state, int64_t heads, int64_t dim, bool balanced) {
  const int64_t seq = state.range(0), world = Group()->size(), rank = Group()->rank();
  auto local = [&](int64_t h) {
    return cp::ShardSequence(at::randn({1, h, seq, dim}), 2, rank, world, balanced).requires_grad_();
  };
  const at::Tensor q = local(heads), k = local(heads), v = local(heads);
  const at::Tensor go = at::randn_like(q);
  for (auto _ : state) {
    Group()->barrier()->wait();
    cp::RingAttention(q, k, v, /*is_causal=*/true, Group(), {.load_balanced = balanced}).backward(go);
  }
}

void BM_OneRank(benchmark::State& state) {
  const int64_t seq = state.range(0);
  const at::Tensor q = at::randn({1, kHeads, seq, kDim}), k = at::randn_like(q), v = at::randn_like(q);
  for (auto _ : state) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, true);
    benchmark::DoNotOptimize(
        at::_scaled_dot_product_flash_attention_for_cpu_backward(at::ones_like(out), q, k, v, out, lse, 0.0, true));
  }
}

void BM_Comm(benchmark::State& state) {
  const int64_t seq = state.range(0), world = Group()->size();
  const int64_t kv = 2 * kHeads * (seq / world) * kDim;
  const at::Tensor blocks = at::randn({kv}), gathered = at::empty({world * kv});
  const at::Tensor grads = at::randn({kv}), received = at::empty({kv});
  std::vector<int64_t> in_splits(world, 0), out_splits(world, 0);
  in_splits[(Group()->rank() + 1) % world] = kv;
  out_splits[(Group()->rank() - 1 + world) % world] = kv;
  for (auto _ : state) {
    Group()->barrier()->wait();
    Group()->all_gather_into_tensor(gathered, blocks)->wait();  // forward
    Group()->all_gather_into_tensor(gathered, blocks)->wait();  // backward
    for (int64_t i = 0; i < world; ++i) Group()->all_to_all_single(received, grads, out_splits, in_splits)->wait();
  }
}

// PyTorch's per-call seconds from the twin, run once by rank 0 (the others wait).
double& PeerSeconds() {
  static double seconds = NAN;
  return seconds;
}
double& PeerCpuSeconds() {
  static double seconds = NAN;
  return seconds;
}

void BM_PeerOverhead(benchmark::State& state) {
  if (Group()->rank() == 0 && std::isnan(PeerSeconds())) {
    std::string why_not;
    const std::string python = fsdp::testing::PeerPythonOrCacheDefault(&why_not);
    const char* script = "bench/peer/context_parallel_peer.py";
    std::string output;
    if (!python.empty() && ::access(script, R_OK) == 0) {
      fsdp::testing::RunCommand(absl::StrCat("'", python, "' ", script, " --world ", Group()->size(), " --seq ",
                                             4 * Group()->size(), " --dim ", kTinyDim),
                                &output);
      const size_t at = output.find("PEER ");
      if (at != std::string::npos) std::sscanf(output.c_str() + at, "PEER %lf %lf", &PeerSeconds(), &PeerCpuSeconds());
    }
    if (std::isnan(PeerSeconds())) std::printf("PyTorch's ring: skipped (%s%s)\n", why_not.c_str(), output.c_str());
  }
  Group()->barrier()->wait();
  for (auto _ : state) {
    if (std::isnan(PeerSeconds())) {
      state.SkipWithError("no PyTorch time");
      break;
    }
    state.SetIterationTime(PeerSeconds());
  }
}

class Reporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.error_occurred) continue;
      Times()[run.benchmark_name()].push_back(run.GetAdjustedRealTime());
      CpuTimes()[run.benchmark_name()].push_back(run.GetAdjustedCPUTime());
    }
    ConsoleReporter::ReportRuns(runs);
  }
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void PrintSummary(const std::vector<int64_t>& seqs, int64_t tiny_seq) {
  const auto median = [](const std::string& name) {
    auto it = Times().find(name);
    return it == Times().end() ? NAN : Median(it->second);
  };
  for (const int64_t seq : seqs) {
    const std::string s = std::to_string(seq);
    const std::string it = seq <= 1024 ? "/iterations:20/real_time" : "/iterations:5/real_time";
    const double ring = median("Ring/" + s + it), one = median("OneRank/" + s + it);
    const double comm = median("Comm/" + s + it), contiguous = median("RingContiguous/" + s + it);
    std::printf(
        "seq %5lld at cp %d: ring %.0f us, one rank %.0f us (speed-up %.2fx), collectives %.0f us (%.0f%%); "
        "without load balancing %.0f us (%.2fx the balanced ring)\n",
        static_cast<long long>(seq), Group()->size(), ring, one, one / ring, comm, 100 * comm / ring, contiguous,
        contiguous / ring);
  }
  const std::string tiny = "Overhead/ours/" + std::to_string(tiny_seq) + "/iterations:200/real_time";
  const double ours = median(tiny);
  const double ours_cpu = CpuTimes().count(tiny) ? Median(CpuTimes()[tiny]) : NAN;
  const double theirs = PeerSeconds() * 1e6, theirs_cpu = PeerCpuSeconds() * 1e6;
  std::printf("tiny ring call (fwd + bwd), wall: ours %.1f us, PyTorch %.1f us, PyTorch / ours %.1f\n", ours, theirs,
              theirs / ours);
  std::printf("tiny ring call (fwd + bwd), CPU: ours %.1f us, PyTorch %.1f us, PyTorch / ours %.1f\n", ours_cpu,
              theirs_cpu, theirs_cpu / ours_cpu);
}

}  // namespace

int main(int argc, char** argv) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain([&]() -> int {
    at::set_num_threads(1);  // W processes share the machine's cores
    fsdp::comm::GlooOptions options;
    options.hostname = "127.0.0.1";
    Group() = fsdp::comm::CreateGlooProcessGroupFromEnv(options);
    std::vector<char*> args(argv, argv + argc);
    const int pair_repetitions = fsdp::bench::TakePairRepetitions(args);
    const bool peer = fsdp::bench::TakeIntFlag(args, "--peer=", 1) != 0;
    fsdp::bench::QuietUnlessRankZero(args, Group()->rank());
    int args_count = static_cast<int>(args.size());
    benchmark::Initialize(&args_count, args.data());
    // Fixed iteration counts: every rank must run the same collectives.
    const std::vector<int64_t> seqs = {1024, 4096};
    const int64_t tiny_seq = 4 * Group()->size();
    for (int rep = 0; rep < pair_repetitions; ++rep) {
      for (const int64_t seq : seqs) {
        const int iterations = seq <= 1024 ? 20 : 5;
        benchmark::RegisterBenchmark("Ring", BM_Ring, kHeads, kDim, true)
            ->Arg(seq)
            ->Iterations(iterations)
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
        benchmark::RegisterBenchmark("RingContiguous", BM_Ring, kHeads, kDim, false)
            ->Arg(seq)
            ->Iterations(iterations)
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
        benchmark::RegisterBenchmark("OneRank", BM_OneRank)
            ->Arg(seq)
            ->Iterations(iterations)
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
        benchmark::RegisterBenchmark("Comm", BM_Comm)
            ->Arg(seq)
            ->Iterations(iterations)
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
      }
      benchmark::RegisterBenchmark("Overhead/ours", BM_Ring, 1, kTinyDim, true)
          ->Arg(tiny_seq)
          ->Iterations(200)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
      if (peer) {
        benchmark::RegisterBenchmark("Overhead/pytorch", BM_PeerOverhead)
            ->Arg(tiny_seq)
            ->Iterations(1)
            ->Unit(benchmark::kMicrosecond)
            ->UseManualTime();
      }
    }
    Reporter reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);
    if (Group()->rank() == 0) PrintSummary(seqs, tiny_seq);
    std::fflush(stdout);
    Group()->barrier()->wait();
    benchmark::Shutdown();
    return 0;
  });
}
