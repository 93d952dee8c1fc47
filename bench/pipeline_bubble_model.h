// The bubble a pipeline schedule should have (bench/pipelining_bench.cc compares the measured
// one with these): the closed forms, and a replay of the ranks' lowered action lists with fixed
// compute costs and free communication. Pure functions.
#ifndef FSDP_BENCH_PIPELINE_BUBBLE_MODEL_H_
#define FSDP_BENCH_PIPELINE_BUBBLE_MODEL_H_

#include <map>
#include <vector>

#include "pipelining/action.h"
#include "pipelining/schedule_orders.h"

namespace fsdp::bench {

// Per rank and microbatch: a rank with v stages runs each at 1/v of these.
struct StageCosts {
  double forward_us = 0, input_us = 0, weight_us = 0;
};

// Every rank's compute actions in its lowered order, each starting when the rank is free and
// its input is there (F after the previous stage's F, B / I after the next stage's B / I, W
// after its I; stage 0's I costs nothing: it has no input gradient). Returns
// 1 - mean(busy) / makespan and the makespan (us) in `makespan_us`; NaN where the lists do not
// replay to the end.
double ReplayedBubble(const std::map<int, std::vector<pipelining::Action>>& lowered, int num_stages, int v,
                      const StageCosts& costs, double* makespan_us);

// (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1) for Interleaved1F1B and LoopedBFS (p ranks,
// v stages per rank, m microbatches); NaN for the others.
double TheoryBubble(pipelining::ScheduleKind kind, int p, int v, int m);

}  // namespace fsdp::bench

#endif  // FSDP_BENCH_PIPELINE_BUBBLE_MODEL_H_
