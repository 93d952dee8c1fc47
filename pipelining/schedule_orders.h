// The compute-only orders of PyTorch's pipeline schedules
// (torch/distributed/pipelining/schedules.py): which forward / backward steps each rank runs,
// in which order, with the idle steps the schedule leaves, for GPipe, 1F1B, Interleaved 1F1B,
// Looped BFS, Interleaved Zero Bubble (ZB1P), ZBV Zero Bubble and DualPipeV.
//
// Contract: ComputeOrder(kind, ranks, stages_per_rank, n) is the order PyTorch builds for that
// schedule over `ranks` ranks of `stages_per_rank` stages each and n microbatches, action for
// action: the multi-stage schedules' pipeline_order (before _prepare_schedule_with_comms
// lowers it); for GPipe and 1F1B, _get_pipeline_order() before its final _add_reduce_grad
// (which drops the idle steps and adds REDUCE_GRAD / WAIT_REDUCE_GRAD: AddReduceGrad of
// lowering.h gives the rest). PyTorch's bugs are kept (1F1B's last rank numbers its forwards
// from 1, so its order does not validate; see ComputeOrder). Lower an order with
// LowerWithComms (lowering.h) and StageRank as the stage mapping.
//
// Errors: the arguments PyTorch rejects are a c10::Error with PyTorch's message (naming the
// argument and the value); ours on top: ranks, stages_per_rank and n_microbatches must be
// positive, GPipe and 1F1B take one stage per rank. Thread-safety: pure functions.
#ifndef FSDP_PIPELINING_SCHEDULE_ORDERS_H_
#define FSDP_PIPELINING_SCHEDULE_ORDERS_H_

#include <string_view>

#include "pipelining/action.h"

namespace fsdp::pipelining {

enum class ScheduleKind {
  kGPipe,
  k1F1B,
  kInterleaved1F1B,
  kLoopedBFS,
  kInterleavedZeroBubble,
  kZBVZeroBubble,
  kDualPipeV
};

// Every ScheduleKind, in declaration order.
inline constexpr ScheduleKind kAllScheduleKinds[] = {
    ScheduleKind::kGPipe,
    ScheduleKind::k1F1B,
    ScheduleKind::kInterleaved1F1B,
    ScheduleKind::kLoopedBFS,
    ScheduleKind::kInterleavedZeroBubble,
    ScheduleKind::kZBVZeroBubble,
    ScheduleKind::kDualPipeV,
};

// get_schedule_class: the names it accepts, case-insensitively ("gpipe", "1F1B",
// "Interleaved1F1B", ...). An unknown name is PyTorch's error listing the valid options;
// "PipelineScheduleSingle" / "PipelineScheduleMulti" (base classes there) are an error too.
ScheduleKind ScheduleKindFromName(std::string_view name);
// The class name without "Schedule": "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS",
// "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV".
std::string_view ScheduleName(ScheduleKind kind);
// GPipe and 1F1B (PipelineScheduleSingle): one stage per rank.
bool IsSingleStageSchedule(ScheduleKind kind);
// ZBVZeroBubble and DualPipeV: the stages in a "v" (generate_stage_to_rank_mapping(style="v")).
bool IsVShapedSchedule(ScheduleKind kind);
// Where stage `stage` runs: "loop" (stage % num_ranks) or, for the V-shaped schedules, "v"
// (stage for stage < num_ranks, else 2 * num_ranks - 1 - stage; further turns continue the
// zigzag).
int StageRank(ScheduleKind kind, int stage, int num_ranks);

// The compute-only order of each rank, with PyTorch's argument checks (same conditions,
// PyTorch's messages): 1F1B and DualPipeV need n_microbatches >= the stage count; Interleaved
// 1F1B and Interleaved Zero Bubble need n_microbatches a multiple of max(1, n / ranks);
// ZBVZeroBubble and DualPipeV exactly 2 stages per rank.
//
// PyTorch's 1F1B _get_pipeline_order numbers the last rank's forwards from 1 (it has no
// warmup forward to start the count at 0), so its order runs 0B0 without 0F0 there and
// ValidateSchedule / LowerWithComms reject it, as PyTorch's _PipelineScheduleRuntime does; the
// order is PyTorch's nonetheless.
PipelineOrder ComputeOrder(ScheduleKind kind, int num_ranks, int stages_per_rank, int n_microbatches);

}  // namespace fsdp::pipelining

#endif  // FSDP_PIPELINING_SCHEDULE_ORDERS_H_
