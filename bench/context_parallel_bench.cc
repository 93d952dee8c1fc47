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
// --peer=0 skips it). Bookkeeping/ours and Bookkeeping/pytorch: the same tiny calls on a fake
// process group of W ranks (comm/fake_process_group.h; PyTorch's "fake" backend), whose
// collectives return at once: what is left is each ring's own host work plus the same CPU
// flash kernels, which Kernels/ours (and the twin) time alone, so that the summary's last
// line compares the bookkeeping: a call's CPU time on the fake group less its kernels' (CPU
// time: this machine's other processes do not count, as they do in wall time).
//
// Every ring call here runs the forward, then the backward node directly (`grad_fn()`), not
// through the autograd engine: the twin calls PyTorch's forward and backward functions
// directly too, so neither side counts the engine, gradient accumulation into .grad, or
// autograd's graph task.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/autograd/function.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/pair_flags.h"
#include "comm/fake_process_group.h"
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
void BM_Ring(benchmark::State& state, const fsdp::comm::ProcessGroupPtr& group, int64_t heads, int64_t dim,
             bool balanced) {
  const int64_t seq = state.range(0), world = group->size(), rank = group->rank();
  auto local = [&](int64_t h) {
    return cp::ShardSequence(at::randn({1, h, seq, dim}), 2, rank, world, balanced).requires_grad_();
  };
  const at::Tensor q = local(heads), k = local(heads), v = local(heads);
  const at::Tensor go = at::randn_like(q);
  for (auto _ : state) {
    group->barrier()->wait();
    const at::Tensor out = cp::RingAttention(q, k, v, /*is_causal=*/true, group, {.load_balanced = balanced});
    const at::NoGradGuard as_the_engine_runs_it;  // a backward without create_graph
    benchmark::DoNotOptimize((*out.grad_fn())(torch::autograd::variable_list{go}));
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

// The CPU flash kernels one tiny ring call runs on this rank, alone: forward and backward of
// its own block (causal), then of each other block's attended part (load balancing: the
// earlier half of the keys of a block from a rank before this one, else the later half of
// the queries), with the ring's shapes.
void BM_Kernels(benchmark::State& state, const fsdp::comm::ProcessGroupPtr& group) {
  const int64_t seq = state.range(0), world = group->size(), rank = group->rank();
  const at::Tensor q = at::randn({1, 1, seq / world, kTinyDim}), k = at::randn_like(q), v = at::randn_like(q);
  const auto half = [](const at::Tensor& t, int64_t h) { return t.narrow(2, h * t.size(2) / 2, t.size(2) / 2); };
  for (auto _ : state) {
    for (int64_t i = 0; i < world; ++i) {
      const bool earlier_keys = i > 0 && i <= rank, later_queries = i > rank;
      const at::Tensor qi = later_queries ? half(q, 1) : q;
      const at::Tensor ki = earlier_keys ? half(k, 0) : k, vi = earlier_keys ? half(v, 0) : v;
      auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(qi, ki, vi, 0.0, i == 0);
      benchmark::DoNotOptimize(
          at::_scaled_dot_product_flash_attention_for_cpu_backward(out, qi, ki, vi, out, lse, 0.0, i == 0));
    }
  }
}

// PyTorch's per-call wall and CPU seconds from the twin on `backend` ("gloo" or "fake"), run
// once by rank 0 (the others wait).
struct PeerTimes {
  double seconds = NAN, cpu_seconds = NAN, kernel_seconds = NAN;
};
PeerTimes& Peer(const std::string& backend) {
  static std::map<std::string, PeerTimes> times;
  return times[backend];
}

void BM_PeerOverhead(benchmark::State& state, const std::string& backend) {
  PeerTimes& peer = Peer(backend);
  if (Group()->rank() == 0 && std::isnan(peer.seconds)) {
    std::string why_not;
    const std::string python = fsdp::testing::PeerPythonOrCacheDefault(&why_not);
    const char* script = "bench/peer/context_parallel_peer.py";
    std::string output;
    if (!python.empty() && ::access(script, R_OK) == 0) {
      fsdp::testing::RunCommand(absl::StrCat("'", python, "' ", script, " --backend ", backend, " --world ",
                                             Group()->size(), " --seq ", 4 * Group()->size(), " --dim ", kTinyDim),
                                &output);
      const size_t at = output.find("PEER ");
      if (at != std::string::npos) {
        std::sscanf(output.c_str() + at, "PEER %lf %lf %lf", &peer.seconds, &peer.cpu_seconds, &peer.kernel_seconds);
      }
    }
    if (std::isnan(peer.seconds)) std::printf("PyTorch's ring: skipped (%s%s)\n", why_not.c_str(), output.c_str());
  }
  Group()->barrier()->wait();
  for (auto _ : state) {
    if (std::isnan(peer.seconds)) {
      state.SkipWithError("no PyTorch time");
      break;
    }
    state.SetIterationTime(peer.seconds);
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
  const PeerTimes& gloo = Peer("gloo");
  std::printf("tiny ring call (fwd + bwd) on Gloo, wall: ours %.1f us, PyTorch %.1f us, PyTorch / ours %.1f\n", ours,
              gloo.seconds * 1e6, gloo.seconds * 1e6 / ours);
  std::printf("tiny ring call (fwd + bwd) on Gloo, CPU: ours %.1f us, PyTorch %.1f us, PyTorch / ours %.1f\n", ours_cpu,
              gloo.cpu_seconds * 1e6, gloo.cpu_seconds * 1e6 / ours_cpu);
  const auto median_cpu = [](const std::string& name) {
    auto it = CpuTimes().find(name);
    return it == CpuTimes().end() ? NAN : Median(it->second);
  };
  const double fake_call = median_cpu("Bookkeeping/ours/" + std::to_string(tiny_seq) + "/iterations:2000/real_time");
  const double kernels = median_cpu("Kernels/ours/" + std::to_string(tiny_seq) + "/iterations:2000/real_time");
  const PeerTimes& fake = Peer("fake");
  std::printf("tiny ring call (fwd + bwd) on a fake group, CPU: ours %.1f us, PyTorch %.1f us, PyTorch / ours %.1f\n",
              fake_call, fake.cpu_seconds * 1e6, fake.cpu_seconds * 1e6 / fake_call);
  const double ours_book = fake_call - kernels, theirs_book = (fake.cpu_seconds - fake.kernel_seconds) * 1e6;
  std::printf(
      "bookkeeping per tiny call (that less the kernels' CPU, ours %.1f us, PyTorch's %.1f us): ours %.1f us, "
      "PyTorch %.1f us, PyTorch / ours %.1f\n",
      kernels, fake.kernel_seconds * 1e6, ours_book, theirs_book, theirs_book / ours_book);
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
    const fsdp::comm::ProcessGroupPtr fake = fsdp::comm::CreateFakeProcessGroup(Group()->rank(), Group()->size());
    for (int rep = 0; rep < pair_repetitions; ++rep) {
      for (const int64_t seq : seqs) {
        const int iterations = seq <= 1024 ? 20 : 5;
        benchmark::RegisterBenchmark("Ring", BM_Ring, Group(), kHeads, kDim, true)
            ->Arg(seq)
            ->Iterations(iterations)
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
        benchmark::RegisterBenchmark("RingContiguous", BM_Ring, Group(), kHeads, kDim, false)
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
      benchmark::RegisterBenchmark("Overhead/ours", BM_Ring, Group(), 1, kTinyDim, true)
          ->Arg(tiny_seq)
          ->Iterations(200)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
      benchmark::RegisterBenchmark("Bookkeeping/ours", BM_Ring, fake, 1, kTinyDim, true)
          ->Arg(tiny_seq)
          ->Iterations(2000)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
      benchmark::RegisterBenchmark("Kernels/ours", BM_Kernels, fake)
          ->Arg(tiny_seq)
          ->Iterations(2000)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
      for (const char* backend : {"gloo", "fake"}) {
        if (!peer) break;
        const std::string name = std::string(backend) == "gloo" ? "Overhead/pytorch" : "Bookkeeping/pytorch";
        benchmark::RegisterBenchmark(name.c_str(), BM_PeerOverhead, std::string(backend))
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
