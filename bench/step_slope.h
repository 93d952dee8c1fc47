// The per-layer cost of a wrapper in the step benchmarks (bench/fsdp2, bench/tp): the median
// of "Step/ours/<blocks>" minus "Step/raw/<blocks>" at two block counts, and its slope over
// the block count (per-step fixed costs such as the root and the autograd engine drop out);
// and the same slope from a PyTorch twin script that prints "PEER <ours|raw> <blocks> <s>".
#ifndef FSDP_BENCH_STEP_SLOPE_H_
#define FSDP_BENCH_STEP_SLOPE_H_

#include <benchmark/benchmark.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/pair_flags.h"
#include "comm/main_guard.h"
#include "testing/peer_python.h"

namespace fsdp::bench {

// The usual console output; also keeps every Step run's time (us) for the summary.
class StepSlopeReporter : public benchmark::ConsoleReporter {
 public:
  // `what`: "fsdp2 step"; `unit`: what one block is ("fully_shard'ed Linear").
  StepSlopeReporter(std::string what, std::string unit)
      : ConsoleReporter(OO_None), what_(std::move(what)), unit_(std::move(unit)) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      const std::string& name = run.run_name.function_name;
      if (name.rfind("Step/", 0) == 0 && !run.error_occurred) {
        times_[{std::stoll(run.run_name.args), name == "Step/ours"}].push_back(run.GetAdjustedRealTime());
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }

  // Prints ours - raw per block count and the slope (us per block); then the twin's slope
  // and twin / ours when it ran. Returns our slope, or nullopt with fewer than two counts.
  std::optional<double> PrintSummary(std::optional<double> peer_slope, const char* peer_name) {
    std::map<int64_t, double> overhead;
    for (auto& [key, times] : times_) {
      if (!key.second || !times_.count({key.first, false})) continue;
      const double ours = Median(times), raw = Median(times_[{key.first, false}]);
      overhead[key.first] = ours - raw;
      std::printf("%s, %3lld blocks: ours %8.1f us, raw %8.1f us, overhead %.2f us per %s\n", what_.c_str(),
                  static_cast<long long>(key.first), ours, raw, (ours - raw) / static_cast<double>(key.first),
                  unit_.c_str());
    }
    if (overhead.size() < 2) return std::nullopt;
    const auto lo = *overhead.begin(), hi = *overhead.rbegin();
    const double slope = (hi.second - lo.second) / static_cast<double>(hi.first - lo.first);
    std::printf("%s overhead slope: %.2f us per %s per step\n", what_.c_str(), slope, unit_.c_str());
    if (peer_slope) {
      std::printf("%s slope: %.1f us per %s; PyTorch / ours = %.1f\n", peer_name, *peer_slope, unit_.c_str(),
                  *peer_slope / slope);
    }
    return slope;
  }

 private:
  static double Median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  }
  std::string what_, unit_;
  std::map<std::pair<int64_t, bool>, std::vector<double>> times_;
};

// Runs `script` (repository- or runfiles-relative) with the peer venv's Python as
// `script 16,64 REPETITIONS` and returns its slope (us per block between 16 and 64 blocks)
// from lines "PEER <ours-side> <blocks> <seconds>" / "PEER raw ...", or nullopt with the
// reason printed. `ours_side` is the twin's name for the wrapped side ("fsdp", "tp").
inline std::optional<double> RunPeerStepSlope(const char* script, const char* ours_side, const char* label,
                                              int repetitions) {
  std::string why_not;
  const std::string python = testing::PeerPythonOrCacheDefault(&why_not);
  if (python.empty() || ::access(script, R_OK) != 0) {
    std::printf("%s: skipped (%s)\n", label,
                python.empty() ? why_not.c_str() : absl::StrCat(script, " is not under the working directory").c_str());
    return std::nullopt;
  }
  std::string output;
  const int status =
      testing::RunCommand(absl::StrCat("'", python, "' ", script, " 16,64 ", std::max(3, repetitions)), &output);
  std::map<std::pair<std::string, int>, double> seconds;
  for (size_t at = output.find("PEER "); at != std::string::npos; at = output.find("PEER ", at + 1)) {
    char side[8] = {};
    int blocks = 0;
    double s = 0;
    if (std::sscanf(output.c_str() + at, "PEER %7s %d %lf", side, &blocks, &s) == 3) seconds[{side, blocks}] = s;
  }
  if (status != 0 || seconds.size() != 4) {
    std::printf("%s: FAILED (status %d): %s\n", label, status, output.c_str());
    return std::nullopt;
  }
  auto overhead = [&](int blocks) { return seconds[{ours_side, blocks}] - seconds[{"raw", blocks}]; };
  for (int blocks : {16, 64}) {
    std::printf("%s step, %3d blocks: %s %8.1f us, raw %8.1f us\n", label, blocks, ours_side,
                seconds[{ours_side, blocks}] * 1e6, seconds[{"raw", blocks}] * 1e6);
  }
  return (overhead(64) - overhead(16)) / 48 * 1e6;
}

// The timed loop of the step benchmarks: one training step (forward of a [batch, dim] input,
// sum, backward, SGD step, zero_grad) per iteration, after three warm-up steps (plan caches,
// the allocator), as the twins' step_timing.py.
template <class Net>
void RunTrainingSteps(benchmark::State& state, Net& net, int64_t batch, int64_t dim) {
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(1e-4));
  const at::Tensor x = at::randn({batch, dim});
  auto step = [&] {
    net.forward(x).sum().backward();
    opt.step();
    opt.zero_grad();
  };
  for (int i = 0; i < 3; ++i) step();
  for (auto _ : state) step();
}

// The main of a step benchmark whose two sides are one function (bench/tp, bench/float8):
// "Step/ours" and "Step/raw" at 16 and 64 blocks, alternating and repeated as pairs
// (--pair_repetitions) so that machine noise hits both alike, one intra-op thread, then the
// slope summary beside the twin `peer_script` (--peer=0 skips it).
struct StepSlopeBench {
  const char* what;         // "tp step"
  const char* unit;         // "tensor-parallel Linear"
  const char* peer_script;  // "bench/peer/tp_step_peer.py"
  const char* peer_side;    // the twin's name for the ours side: "tp"
  const char* twin;         // "PyTorch 2.15 tensor parallel (fake group)"
};
inline int RunStepSlopeMain(int argc, char** argv, const StepSlopeBench& bench,
                            void (*step)(benchmark::State& state, bool ours)) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return comm::RunMain([&]() -> int {
    std::vector<char*> args(argv, argv + argc);
    const int pair_repetitions = TakePairRepetitions(args);
    const bool peer = TakeIntFlag(args, "--peer=", 1) != 0;
    at::set_num_threads(1);  // repeatable on a shared 2-core machine, as bench/fsdp2
    int args_count = static_cast<int>(args.size());
    benchmark::Initialize(&args_count, args.data());
    for (int rep = 0; rep < pair_repetitions; ++rep) {
      for (int64_t blocks : {16, 64}) {
        for (bool ours : {true, false}) {
          benchmark::RegisterBenchmark(ours ? "Step/ours" : "Step/raw", step, ours)
              ->Arg(blocks)
              ->Unit(benchmark::kMicrosecond)
              ->UseRealTime();
        }
      }
    }
    StepSlopeReporter reporter(bench.what, bench.unit);
    benchmark::RunSpecifiedBenchmarks(&reporter);
    reporter.PrintSummary(
        peer ? RunPeerStepSlope(bench.peer_script, bench.peer_side, bench.twin, pair_repetitions) : std::nullopt,
        bench.twin);
    benchmark::Shutdown();
    return 0;
  });
}

}  // namespace fsdp::bench

#endif  // FSDP_BENCH_STEP_SLOPE_H_
