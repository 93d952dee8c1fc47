// bench/pipelining: the pipeline runtime (pipelining/pipeline_schedule.h) per schedule, on W
// Gloo processes (`./x run -n W`; `./x bench` runs Bubble at W = 4 and Overhead at W = 2).
//
// Bubble/<schedule>/<microbatches>: the idle fraction of each rank's step with stages of a
// known fixed cost, against the schedule's theory. A stage is a custom autograd function that
// sleeps: F = 1 ms per rank and microbatch, its backward I = 1 ms (the input's gradient) and
// W = 1 ms (the weight's), so B = I + W = 2 ms; a rank with v stages runs each at 1/v of that.
// Sleeping, not computing: W = 4 processes share 2 cores here, and a busy-wait or a matmul
// would make the ranks' compute a matter of the kernel's scheduler; a sleep costs no core and
// its duration is fixed (timer slack set to 1 ns). Each rank's busy time is the sum of its
// F / B / I / W intervals from PipelineScheduleOptions::on_action (which excludes the waits for
// receives); the step time T is the slowest rank's step after a barrier; the bubble is
// 1 - mean(busy) / T. Counters: `bubble` (measured), `theory` ((p-1)/(m+p-1) for GPipe / 1F1B,
// (p-1)/(v m+p-1) for Interleaved1F1B and LoopedBFS; NaN for the others) and `sim` (the
// rank's lowered action list replayed with the nominal costs and free communication: the
// schedule's own bubble, for every schedule, zero-bubble ones included).
//
// Overhead/<schedule>: host overhead of the runtime with tiny stages (one Linear(1, 1) per
// stage, microbatches of one row, 16 microbatches): `<schedule>/ours/16` our step, and in the
// same run `<schedule>/pytorch/16` PyTorch 2.15's schedule with the same model on the same
// number of Gloo processes (bench/peer/pipelining_peer.py from the peer venv; --peer=0 skips
// it). `Raw<v>/ours/16` and the twin's `Raw<v>/pytorch/16`: the same stages' forwards and
// backwards with blocking recv / isend in GPipe order, written out by hand (the floor: compute
// and p2p without a runtime); `Raw2V` in the V placement of ZBVZeroBubble and DualPipeV;
// `Raw2Split` / `Raw2VSplit` with each backward split into the input's and the weights'
// gradients with plain autograd, as the zero-bubble schedules must compute them (two autograd
// passes instead of one). The summary prints per schedule the step, its overhead over the
// floor (the raw loop of its placement, with the schedule's share of split backwards taken
// from the split one) per lowered action of rank 0's list (the same divisor for both sides)
// and PyTorch / ours. `python3 tools/bench_ratio.py bench/out/pipelining.json` prints ours /
// PyTorch per step.
//
// --fake_world=W: instead of Gloo processes, one process as the last rank of a fake process
// group of W ranks (comm/fake_process_group.h: sends and receives return at once; the twin runs
// on PyTorch's fake group likewise), the Overhead benchmarks only: the runtime's host work per
// action without the noise of the p2p transport. With --callgrind=1 each Overhead loop runs
// twice, with kCallgrindSteps steps, each run dumped: tools/callgrind_pipelining.sh counts both
// sides' instructions per action.
//
// Every rank runs the same benchmarks with fixed iteration counts; only rank 0 reports.
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <sys/prctl.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/linear.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/callgrind_loop.h"
#include "bench/pair_flags.h"
#include "bench/pipeline_bubble_model.h"
#include "bench/pipeline_overhead_floor.h"
#include "comm/fake_process_group.h"
#include "comm/gloo_process_group.h"
#include "comm/main_guard.h"
#include "pipelining/pipeline_schedule.h"
#include "pipelining/schedule_orders.h"
#include "pipelining/stage.h"
#include "testing/peer_python.h"

namespace {

using fsdp::comm::ProcessGroupPtr;
using fsdp::pipelining::Action;
using fsdp::pipelining::ActionType;
using fsdp::pipelining::PipelineSchedule;
using fsdp::pipelining::PipelineScheduleOptions;
using fsdp::pipelining::PipelineStage;
using fsdp::pipelining::ScheduleKind;
using Clock = std::chrono::steady_clock;
using fsdp::bench::RawLoop;
using fsdp::bench::RawLoopOf;
using fsdp::bench::ReplayedBubble;
using fsdp::bench::SplitShare;
using fsdp::bench::StageCosts;
using fsdp::bench::TheoryBubble;
using fsdp::bench::TinyLinear;

ProcessGroupPtr& Group() {
  static ProcessGroupPtr group;
  return group;
}

std::string Name(ScheduleKind kind) { return std::string(fsdp::pipelining::ScheduleName(kind)); }
int StagesPerRank(ScheduleKind kind) { return fsdp::pipelining::IsSingleStageSchedule(kind) ? 1 : 2; }

// ------------------------------------------------------------------------------------ Bubble

constexpr int kBubbleMicrobatches = 8;
constexpr double kForwardUs = 1000, kInputUs = 1000, kWeightUs = 1000;  // per rank and microbatch

void SleepUs(double us) {
  std::this_thread::sleep_until(Clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(us * 1e3)));
}

// y = x * w with fixed costs: forward sleeps f_us; backward sleeps i_us when x's gradient is
// wanted (B, I) and w_us when w's is (B, W).
struct FixedCost : torch::autograd::Function<FixedCost> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double f_us, double i_us, double w_us) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["i"] = i_us;
    ctx->saved_data["w"] = w_us;
    SleepUs(f_us);
    return x * w;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    double us = 0;
    at::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) {
      us += ctx->saved_data["i"].toDouble();
      gx = grads[0] * saved[1];
    }
    if (ctx->needs_input_grad(1)) {
      us += ctx->saved_data["w"].toDouble();
      gw = (grads[0] * saved[0]).sum().reshape(saved[1].sizes());
    }
    SleepUs(us);
    return {gx, gw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct FixedCostStage : torch::nn::Module {
  FixedCostStage() { w = register_parameter("w", at::ones({1})); }
  at::Tensor w;
};

void BM_Bubble(benchmark::State& state, ScheduleKind kind) {
  const ProcessGroupPtr& group = Group();
  const int p = group->size(), rank = group->rank(), v = StagesPerRank(kind), m = kBubbleMicrobatches;
  const int num_stages = p * v;
  std::vector<std::shared_ptr<PipelineStage>> stages;
  for (int s = 0; s < num_stages; ++s) {
    if (fsdp::pipelining::StageRank(kind, s, p) != rank) continue;
    auto module = std::make_shared<FixedCostStage>();
    auto forward = [module, v](const std::vector<at::Tensor>& in) {
      at::Tensor x = in[0];
      // Stage 0's input, too, wants a gradient, so that its B costs I + W like the others'.
      if (at::GradMode::is_enabled() && !x.requires_grad()) x = x.detach().requires_grad_(true);
      if (!at::GradMode::is_enabled()) return std::vector<at::Tensor>{x * module->w};  // shape inference
      return std::vector<at::Tensor>{FixedCost::apply(x, module->w, kForwardUs / v, kInputUs / v, kWeightUs / v)};
    };
    stages.push_back(std::make_shared<PipelineStage>(module, forward, s, num_stages, group));
  }
  double busy_us = 0, wait_send_us = 0, other_us = 0;  // this rank's, in the current step
  PipelineScheduleOptions options{
      .n_microbatches = m,
      .loss_fn = [](const std::vector<at::Tensor>& out, const at::Tensor&) { return out[0].sum(); }};
  options.on_action = [&](const Action& a, Clock::time_point start, Clock::time_point end) {
    if (a.type == ActionType::kForward || a.type == ActionType::kFullBackward || a.type == ActionType::kBackwardInput ||
        a.type == ActionType::kBackwardWeight) {
      busy_us += std::chrono::duration<double, std::micro>(end - start).count();
    } else if (a.type == ActionType::kWaitSendF || a.type == ActionType::kWaitSendB) {
      wait_send_us += std::chrono::duration<double, std::micro>(end - start).count();
    } else {
      other_us += std::chrono::duration<double, std::micro>(end - start).count();
    }
  };
  PipelineSchedule schedule(kind, stages, options);
  const at::Tensor x = at::ones({m * 2, 4});
  schedule.step({x}, x);  // shape inference, warm-up
  double bubble_sum = 0, step_sum = 0, busy_sum = 0, wait_send_sum = 0, other_sum = 0;
  for (auto _ : state) {
    group->barrier()->wait();
    busy_us = wait_send_us = other_us = 0;
    const Clock::time_point start = Clock::now();
    schedule.step({x}, x);
    const double step_us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
    at::Tensor mine = at::zeros({4, p}, at::kDouble);
    mine[0][rank] = step_us;
    mine[1][rank] = busy_us;
    mine[2][rank] = wait_send_us;
    mine[3][rank] = other_us;
    group->all_reduce(mine)->wait();
    const double slowest = mine[0].max().item<double>();
    const double mean_busy = mine[1].mean().item<double>();
    wait_send_sum += mine[2].mean().item<double>();
    other_sum += mine[3].mean().item<double>();
    state.SetIterationTime(slowest * 1e-6);
    bubble_sum += 1 - mean_busy / slowest;
    step_sum += slowest;
    busy_sum += mean_busy;
  }
  const double iterations = static_cast<double>(state.iterations());
  double sim_step_us = 0;
  state.counters["bubble"] = bubble_sum / iterations;
  state.counters["theory"] = TheoryBubble(kind, p, v, m);
  state.counters["sim"] =
      ReplayedBubble(schedule.all_actions(), num_stages, v, StageCosts{kForwardUs, kInputUs, kWeightUs}, &sim_step_us);
  state.counters["step_ms"] = step_sum / iterations * 1e-3;
  state.counters["busy_ms"] = busy_sum / iterations * 1e-3;
  state.counters["sim_step_ms"] = sim_step_us * 1e-3;
  state.counters["wait_send_ms"] = wait_send_sum / iterations * 1e-3;
  state.counters["other_ms"] = other_sum / iterations * 1e-3;
}

// ---------------------------------------------------------------------------------- Overhead

constexpr int kOverheadMicrobatches = 16;
constexpr int kOverheadSteps = 40;

bool& Breakdown() {
  static bool breakdown = false;
  return breakdown;
}
// --callgrind: tools/callgrind_pipelining.sh counts the Overhead loops' instructions.
bool& Callgrind() {
  static bool callgrind = false;
  return callgrind;
}

// --fake_world: the group is fake (the reporting rank is its last).
bool& Fake() {
  static bool fake = false;
  return fake;
}
bool Reports() { return Fake() || Group()->rank() == 0; }

// Seconds per step, every repetition, by benchmark name (rank 0's; for the summary).
std::map<std::string, std::vector<double>>& Seconds() {
  static std::map<std::string, std::vector<double>> seconds;
  return seconds;
}
std::map<std::string, std::vector<double>>& CpuSeconds() {
  static std::map<std::string, std::vector<double>> seconds;
  return seconds;
}
std::map<std::string, int>& ActionCounts() {
  static std::map<std::string, int> counts;
  return counts;
}
std::map<std::string, SplitShare>& SplitShares() {
  static std::map<std::string, SplitShare> shares;
  return shares;
}

at::Tensor Mse(const std::vector<at::Tensor>& out, const at::Tensor& target) { return at::mse_loss(out[0], target); }

void BM_OverheadOurs(benchmark::State& state, ScheduleKind kind) {
  const ProcessGroupPtr& group = Group();
  const int p = group->size(), rank = group->rank(), v = StagesPerRank(kind), m = kOverheadMicrobatches;
  std::vector<std::shared_ptr<PipelineStage>> stages;
  for (int s = 0; s < p * v; ++s) {
    if (fsdp::pipelining::StageRank(kind, s, p) != rank) continue;
    auto l = TinyLinear();
    // Shapes given (as the twin gives PyTorch's): a fake group cannot infer them.
    stages.push_back(std::make_shared<PipelineStage>(
        l, [l](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{l->forward(in[0])}; }, s, p * v,
        group, fsdp::pipelining::PipelineStageOptions{.inputs = {{{1, 1}}}, .outputs = {{{1, 1}}}}));
  }
  PipelineScheduleOptions options{.n_microbatches = m, .loss_fn = Mse};
  // --breakdown=1: time per action type (rank 0 prints it after the run; the clock reads cost
  // a little of what is measured).
  std::map<ActionType, std::pair<double, int64_t>> per_type;  // type -> (us, count)
  if (Breakdown()) {
    options.on_action = [&](const Action& a, Clock::time_point start, Clock::time_point end) {
      auto& [us, count] = per_type[a.type];
      us += std::chrono::duration<double, std::micro>(end - start).count();
      ++count;
    };
  }
  PipelineSchedule schedule(kind, stages, options);
  const at::Tensor x = at::linspace(-1, 1, m).reshape({m, 1});
  const at::Tensor target = x * 0.3;
  for (int i = 0; i < 3; ++i) schedule.step({x}, target);  // warm-up
  group->barrier()->wait();
  per_type.clear();
  fsdp::bench::TimedLoop(state, absl::StrCat(Name(kind), "/ours/", m), [&] { schedule.step({x}, target); });
  if (Breakdown() && Reports()) {
    std::string line = absl::StrCat(Name(kind), " rank ", rank, ", us per action (count per step):");
    for (auto& [type, t] : per_type) {
      absl::StrAppend(
          &line, " ", std::string(fsdp::pipelining::ActionTypeName(type)), " ",
          absl::StrFormat("%.1f (%d)", t.first / t.second, static_cast<int>(t.second / state.iterations())));
    }
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  ActionCounts()[Name(kind)] = static_cast<int>(schedule.actions().size());
  SplitShares()[Name(kind)] = fsdp::bench::SplitShareOf(schedule.actions());
  group->barrier()->wait();
}

void BM_OverheadRaw(benchmark::State& state, RawLoop loop) {
  fsdp::bench::RunRawLoop(state, Group(), loop, kOverheadMicrobatches);
}

// One run of the twin (every schedule and the raw loops) on rank 0, the other ranks waiting
// in a barrier; its seconds per step by name ("GPipe", ..., "Raw1", "Raw2").
std::map<std::string, double>& PeerSeconds() {
  static std::map<std::string, double> seconds;
  return seconds;
}

std::map<std::string, double>& PeerCpuSeconds() {
  static std::map<std::string, double> seconds;
  return seconds;
}

void BM_PeerRound(benchmark::State& state) {
  for (auto _ : state) {
    PeerSeconds().clear();
    PeerCpuSeconds().clear();
    if (Reports()) {
      std::string why_not;
      const std::string python = fsdp::testing::PeerPythonOrCacheDefault(&why_not);
      const char* script = "bench/peer/pipelining_peer.py";
      if (python.empty() || ::access(script, R_OK) != 0) {
        state.SkipWithError(
            (python.empty() ? why_not : absl::StrCat(script, " is not under the working directory")).c_str());
      } else {
        std::string output;
        const int status =
            fsdp::testing::RunCommand(absl::StrCat("'", python, "' ", script, " --world ", Group()->size(),
                                                   " --backend ", Fake() ? "fake" : "gloo", " --microbatches ",
                                                   kOverheadMicrobatches, " --steps ", kOverheadSteps),
                                      &output);
        for (size_t at = output.find("PEER "); at != std::string::npos; at = output.find("PEER ", at + 1)) {
          char name[32] = {};
          double s = 0, cpu = 0;
          if (std::sscanf(output.c_str() + at, "PEER %31s %lf %lf", name, &s, &cpu) == 3 && std::isfinite(s)) {
            PeerSeconds()[name] = s;
            PeerCpuSeconds()[name] = cpu;
          }
        }
        if (status != 0 || PeerSeconds().empty()) {
          state.SkipWithError(absl::StrCat("pipelining_peer.py failed (status ", status, "): ", output).c_str());
        }
      }
    }
    Group()->barrier()->wait();
  }
}

// Reports the twin's wall seconds per step for `name` from the last PeerRound, its CPU
// seconds as the counter cpu_s.
void BM_Peer(benchmark::State& state, std::string name) {
  auto it = PeerSeconds().find(name);
  auto cpu = PeerCpuSeconds().find(name);
  for (auto _ : state) {
    if (it == PeerSeconds().end() || cpu == PeerCpuSeconds().end()) {
      state.SkipWithError(absl::StrCat("no PyTorch time for ", name).c_str());
      break;
    }
    state.SetIterationTime(it->second);
  }
  if (cpu != PeerCpuSeconds().end()) state.counters["cpu_s"] = cpu->second;
}

// Bubble runs' counters by benchmark name.
std::map<std::string, std::map<std::string, std::vector<double>>>& Bubbles() {
  static std::map<std::string, std::map<std::string, std::vector<double>>> bubbles;
  return bubbles;
}

// Keeps every Bubble run's counters and every Overhead run's seconds per step for the summary.
class Reporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      const std::string& name = run.run_name.function_name;
      if (run.error_occurred || name.find('/') == std::string::npos) continue;
      if (name.rfind("Bubble/", 0) == 0) {
        for (const char* c :
             {"bubble", "theory", "sim", "step_ms", "busy_ms", "sim_step_ms", "wait_send_ms", "other_ms"})
          Bubbles()[name][c].push_back(run.counters.at(c).value);
      } else {
        const std::string key = name.substr(0, name.rfind('/'));
        const double unit = benchmark::GetTimeUnitMultiplier(run.time_unit);
        Seconds()[key].push_back(run.GetAdjustedRealTime() / unit);
        CpuSeconds()[key].push_back(run.counters.count("cpu_s") ? run.counters.at("cpu_s").value
                                                                : run.GetAdjustedCPUTime() / unit);
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }
};

double Median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void PrintBubbleSummary() {
  std::printf(
      "\nBubble fraction, %d Gloo processes, %d microbatches, F = %.0f us, I = W = %.0f us per rank "
      "(medians over repetitions)\n",
      Group()->size(), kBubbleMicrobatches, kForwardUs, kInputUs);
  std::printf("%-30s %9s %9s %9s %9s %12s %9s %9s %9s\n", "schedule", "measured", "theory", "sim", "step ms",
              "sim step ms", "busy ms", "wsend ms", "comm ms");
  for (auto& [name, c] : Bubbles()) {
    std::printf("%-30s %9.3f %9.3f %9.3f %9.2f %12.2f %9.2f %9.2f %9.2f\n", name.c_str(), Median(c["bubble"]),
                Median(c["theory"]), Median(c["sim"]), Median(c["step_ms"]), Median(c["sim_step_ms"]),
                Median(c["busy_ms"]), Median(c["wait_send_ms"]), Median(c["other_ms"]));
  }
  std::printf(
      "busy / wsend / comm ms: the mean rank's time inside F / B / I / W (nominal %.2f), inside WAIT_SEND_*, "
      "inside the other actions (issuing sends and receives, REDUCE_GRAD, ...)\n",
      kBubbleMicrobatches * (kForwardUs + kInputUs + kWeightUs) * 1e-3);
}

void PrintOverheadSummary() {
  std::printf(
      "\nPipeline runtime host overhead, %s, %d microbatches of a Linear(1, 1) per stage; "
      "rank %d's process CPU time and wall time per step in us (medians over repetitions); overhead per "
      "action = (step - floor) CPU time / actions of that rank's lowered list, the floor being the raw loop "
      "with the share of its backwards split that each runtime runs as two passes (split ours / PyTorch's)\n",
      absl::StrCat(Group()->size(), Fake() ? " ranks of a fake process group" : " Gloo processes").c_str(),
      kOverheadMicrobatches, Group()->rank());
  std::printf("%-22s %7s %11s %9s %9s %11s %11s %9s %9s %11s\n", "schedule", "actions", "split", "ours cpu",
              "torch cpu", "ours us/act", "torch us/act", "ours wall", "torch wall", "torch/ours");
  auto med = [](std::map<std::string, std::vector<double>>& m, const std::string& key) { return Median(m[key]) * 1e6; };
  // The CPU time of `side`'s raw loop for `kind` with `share` of its backwards split: each
  // backward costs a whole one or an I and a W, so the floor interpolates.
  auto floor = [&](ScheduleKind kind, double share, const std::string& side) {
    const double whole = med(CpuSeconds(), absl::StrCat(RawLoopOf(kind, false).Name(), "/", side));
    if (share == 0) return whole;
    return whole + share * (med(CpuSeconds(), absl::StrCat(RawLoopOf(kind, true).Name(), "/", side)) - whole);
  };
  for (ScheduleKind kind : fsdp::pipelining::kAllScheduleKinds) {
    const std::string name = Name(kind);
    if (!Seconds().count(name + "/ours")) continue;
    const int actions = ActionCounts()[name];
    const SplitShare share = SplitShares()[name];
    const double ours_cpu = med(CpuSeconds(), name + "/ours"), torch_cpu = med(CpuSeconds(), name + "/pytorch");
    const double ours_per = (ours_cpu - floor(kind, share.ours, "ours")) / actions;
    const double torch_per = (torch_cpu - floor(kind, share.pytorch, "pytorch")) / actions;
    std::printf("%-22s %7d %5.2f/%5.2f %9.0f %9.0f %11.2f %11.2f %9.0f %9.0f %11.1f\n", name.c_str(), actions,
                share.ours, share.pytorch, ours_cpu, torch_cpu, ours_per, torch_per, med(Seconds(), name + "/ours"),
                med(Seconds(), name + "/pytorch"), torch_per / ours_per);
  }
  for (RawLoop loop : fsdp::bench::kRawLoops) {
    const std::string raw = loop.Name();
    std::printf("raw loop %-10s: ours cpu %.0f us, wall %.0f us; PyTorch cpu %.0f us, wall %.0f us\n", raw.c_str(),
                med(CpuSeconds(), absl::StrCat(raw, "/ours")), med(Seconds(), absl::StrCat(raw, "/ours")),
                med(CpuSeconds(), absl::StrCat(raw, "/pytorch")), med(Seconds(), absl::StrCat(raw, "/pytorch")));
  }
}

// The step counts of the two runs of each Overhead loop under --callgrind: the instructions
// per step are the slope between them, which cancels what bracketing a loop costs (PyTorch's
// side toggles callgrind from Python, bench/peer/pipelining_peer.py).
constexpr int kCallgrindSteps[] = {4, 20};

void RegisterOverhead(const std::string& name, std::function<void(benchmark::State&)> body) {
  for (int steps : Callgrind() ? std::vector<int>(std::begin(kCallgrindSteps), std::end(kCallgrindSteps))
                               : std::vector<int>{kOverheadSteps}) {
    benchmark::RegisterBenchmark(absl::StrCat(name, "/ours/", kOverheadMicrobatches).c_str(), body)
        ->Iterations(steps)
        ->MeasureProcessCPUTime()
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
}

void RegisterAll(int pair_repetitions, bool peer) {
  const std::string m = absl::StrCat("/", kBubbleMicrobatches);
  for (int rep = 0; rep < pair_repetitions && !Fake(); ++rep) {
    for (ScheduleKind kind : fsdp::pipelining::kAllScheduleKinds) {
      benchmark::RegisterBenchmark(absl::StrCat("Bubble/", Name(kind), m).c_str(), BM_Bubble, kind)
          ->Iterations(5)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  const std::string o = absl::StrCat("/", kOverheadMicrobatches);
  for (int rep = 0; rep < pair_repetitions; ++rep) {
    for (RawLoop loop : fsdp::bench::kRawLoops) {
      RegisterOverhead(loop.Name(), [loop](benchmark::State& state) { BM_OverheadRaw(state, loop); });
    }
    for (ScheduleKind kind : fsdp::pipelining::kAllScheduleKinds) {
      RegisterOverhead(Name(kind), [kind](benchmark::State& state) { BM_OverheadOurs(state, kind); });
    }
    if (!peer) continue;
    benchmark::RegisterBenchmark("PeerRound", BM_PeerRound)->Iterations(1)->UseRealTime()->Unit(benchmark::kSecond);
    std::vector<std::string> names;
    for (RawLoop loop : fsdp::bench::kRawLoops) names.push_back(loop.Name());
    for (ScheduleKind kind : fsdp::pipelining::kAllScheduleKinds) {
      names.emplace_back(fsdp::pipelining::ScheduleName(kind));
    }
    for (const std::string& name : names) {
      benchmark::RegisterBenchmark(absl::StrCat(name, "/pytorch", o).c_str(), BM_Peer, name)
          ->Iterations(1)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
}

// Under --callgrind, what tools/pipelining_callgrind.py needs beside the dumps: per schedule,
// the length of the reporting rank's lowered list and its split shares.
void PrintScheduleShapes() {
  for (ScheduleKind kind : fsdp::pipelining::kAllScheduleKinds) {
    const std::string name = Name(kind);
    if (!ActionCounts().count(name)) continue;
    const SplitShare share = SplitShares()[name];
    std::printf("SCHEDULE %s actions=%d split_ours=%.6f split_pytorch=%.6f raw=%s raw_split=%s\n", name.c_str(),
                ActionCounts()[name], share.ours, share.pytorch, RawLoopOf(kind, false).Name().c_str(),
                RawLoopOf(kind, true).Name().c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain([&]() -> int {
    at::set_num_threads(1);                  // W processes share the machine's cores
    ::prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0);  // the fixed-cost stages' sleeps end on time
    std::vector<char*> args(argv, argv + argc);
    const int fake_world = fsdp::bench::TakeIntFlag(args, "--fake_world=", 0);
    Fake() = fake_world > 0;
    if (Fake()) {
      Group() = fsdp::comm::CreateFakeProcessGroup(fake_world - 1, fake_world);
    } else {
      fsdp::comm::GlooOptions options;
      options.hostname = "127.0.0.1";
      Group() = fsdp::comm::CreateGlooProcessGroupFromEnv(options);
    }
    const int pair_repetitions = fsdp::bench::TakePairRepetitions(args);
    Breakdown() = fsdp::bench::TakeIntFlag(args, "--breakdown=", 0) != 0;
    Callgrind() = fsdp::bench::TakeIntFlag(args, "--callgrind=", 0) != 0;
    const bool peer = fsdp::bench::TakeIntFlag(args, "--peer=", 1) != 0 && !Callgrind();
    fsdp::bench::QuietUnlessRankZero(args, Fake() ? 0 : Group()->rank());
    int args_count = static_cast<int>(args.size());
    benchmark::Initialize(&args_count, args.data());
    RegisterAll(pair_repetitions, peer);
    Reporter reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);
    if (Reports() && !Bubbles().empty()) PrintBubbleSummary();
    if (Reports() && !ActionCounts().empty()) Callgrind() ? PrintScheduleShapes() : PrintOverheadSummary();
    std::fflush(stdout);
    Group()->barrier()->wait();
    benchmark::Shutdown();
    return 0;
  });
}
