// The floor of bench/pipelining's Overhead benchmarks: the same stages' compute and p2p as a
// schedule's, written out by hand without a runtime ("raw loops"), and what share of a
// schedule's backwards each runtime runs as two autograd passes, so that the floor holds the
// passes the runtime must run. bench/peer/pipelining_peer.py has PyTorch's twin of each loop.
#ifndef FSDP_BENCH_PIPELINE_OVERHEAD_FLOOR_H_
#define FSDP_BENCH_PIPELINE_OVERHEAD_FLOOR_H_

#include <benchmark/benchmark.h>
#include <torch/nn/modules/linear.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/process_group.h"
#include "pipelining/action.h"
#include "pipelining/schedule_orders.h"

namespace fsdp::bench {

// Every stage of the Overhead benchmarks: Linear(1, 1), weight 0.5, bias 0.1.
std::shared_ptr<torch::nn::LinearImpl> TinyLinear();

// v stages per rank, every forward then every backward (GPipe order, stage by stage), blocking
// recv and isend (waited at the end of each pass). `v_shaped`: the V placement of
// ZBVZeroBubble and DualPipeV (rank r holds stages r and 2p-1-r, so the last rank hands its
// first stage's output to its second in memory) instead of the loop (stage c p + r). `split`:
// each backward as the zero-bubble schedules do it, written out with plain autograd: the
// input's gradient first (retaining the graph, sent at once), every weight gradient after all
// of them (a stage without an input gradient, stage 0, does its whole backward then).
struct RawLoop {
  int v = 1;
  bool v_shaped = false, split = false;
  std::string Name() const { return absl::StrCat("Raw", v, v_shaped ? "V" : "", split ? "Split" : ""); }
};
inline constexpr RawLoop kRawLoops[] = {
    {.v = 1}, {.v = 2}, {.v = 2, .split = true}, {.v = 2, .v_shaped = true}, {.v = 2, .v_shaped = true, .split = true}};

// The raw loop whose stages per rank and placement `kind` has, with or without split backwards.
RawLoop RawLoopOf(pipelining::ScheduleKind kind, bool split);

// Runs `loop` with `microbatches` rows of one feature (MSE loss on the last stage): 3 warm-up
// steps, then the benchmark's iterations, bracketed as "<Name()>/ours/<microbatches>" for
// callgrind (bench/callgrind_loop.h). Every rank of `group` calls it.
void RunRawLoop(benchmark::State& state, const comm::ProcessGroupPtr& group, RawLoop loop, int microbatches);

// The share of a rank's backwards run as two autograd passes: for PyTorch's runtime every I
// (I / (I + B)); ours runs an I whose own W comes next (past waits for sends) as one pass
// (pipelining::InputBackwardsFollowedByTheirWeight), so its share leaves those out.
struct SplitShare {
  double ours = 0, pytorch = 0;
};
SplitShare SplitShareOf(const std::vector<pipelining::Action>& actions);

}  // namespace fsdp::bench

#endif  // FSDP_BENCH_PIPELINE_OVERHEAD_FLOOR_H_
