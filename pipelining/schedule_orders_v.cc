// The V-shaped schedules of torch/distributed/pipelining/schedules.py: ScheduleZBVZeroBubble
// and ScheduleDualPipeV, two stages per rank, rank r holding stages r and 2 * ranks - 1 - r.
#include <c10/util/Exception.h>

#include <algorithm>
#include <deque>
#include <map>
#include <utility>

#include "pipelining/schedule_orders_internal.h"

namespace fsdp::pipelining::internal {
namespace {

Action VAction(int stage, ActionType type, int microbatch) { return Action{stage, type, microbatch, {}}; }

}  // namespace

RankOps ZBVRankOps(int rank, int num_ranks, int n_microbatches) {
  // At least as many microbatches as fill the pipeline; the extra ones are idle steps at the end.
  const int n_micro = std::max(2 * num_ranks - 1, n_microbatches);
  const int num_stages = 2 * num_ranks;
  RankOps ops(rank, std::nullopt);
  int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
  const int chunk0 = rank;
  const int chunk1 = num_stages - 1 - rank;
  auto add = [&](int stage, ActionType type, int mb) { ops.push_back(VAction(stage, type, mb)); };

  // Warm-up.
  for (int i = 0; i < 2 * (num_ranks - rank) - 1; ++i) add(chunk0, ActionType::kForward, f0++);
  for (int i = 0; i < rank; ++i) {
    add(chunk1, ActionType::kForward, f1++);
    add(chunk0, ActionType::kForward, f0++);
  }
  for (int i = 0; i < num_ranks - rank; ++i) {
    add(chunk1, ActionType::kForward, f1++);
    add(chunk1, ActionType::kBackwardInput, b1);
    add(chunk1, ActionType::kBackwardWeight, b1);
    ++b1;
  }
  // Stable phase.
  while (f1 < f0 || f0 < n_micro) {
    if (f0 < n_micro) add(chunk0, ActionType::kForward, f0++);
    add(chunk0, ActionType::kBackwardInput, b0);
    add(chunk0, ActionType::kBackwardWeight, b0);
    ++b0;
    add(chunk1, ActionType::kForward, f1++);
    add(chunk1, ActionType::kBackwardInput, b1);
    add(chunk1, ActionType::kBackwardWeight, b1);
    ++b1;
  }
  // Cool-down.
  int w0 = b0, w1 = b1;
  for (int i = 0; i < rank; ++i) {
    add(chunk0, ActionType::kBackwardInput, b0++);
    add(chunk1, ActionType::kBackwardInput, b1++);
  }
  for (int i = 0; i < num_ranks - rank; ++i) {
    add(chunk0, ActionType::kBackwardInput, b0++);
    add(chunk0, ActionType::kBackwardWeight, w0++);
  }
  while (w1 < b1) add(chunk1, ActionType::kBackwardWeight, w1++);
  while (w0 < b0) add(chunk0, ActionType::kBackwardWeight, w0++);
  TORCH_CHECK(w0 == b0 && b0 == f0, "Expected w0_cnt == b0_cnt == f0_cnt, got w0_cnt=", w0, ", b0_cnt=", b0,
              ", f0_cnt=", f0);
  TORCH_CHECK(w1 == b1 && b1 == f1, "Expected w1_cnt == b1_cnt == f1_cnt, got w1_cnt=", w1, ", b1_cnt=", b1,
              ", f1_cnt=", f1);
  // The microbatches beyond n_microbatches become idle steps.
  for (auto& a : ops) {
    if (a.has_value() && !(a->microbatch.has_value() && *a->microbatch < n_microbatches)) a.reset();
  }
  return ops;
}

RankOps DualPipeVRankOps(int rank, int num_ranks, int n_microbatches) {
  RankOps actions;
  std::map<std::pair<int, ActionType>, int> counters;  // (stage, type) -> next microbatch
  std::deque<std::pair<int, int>> weight_queue;        // (stage, microbatch) of pending W
  // generate_rank_to_stage_mapping(ranks, 2 * ranks, style="v")[rank], sorted.
  const int stage0 = rank;
  const int stage1 = 2 * num_ranks - 1 - rank;

  auto count = [&](int stage, ActionType type) -> int& { return counters[{stage, type}]; };
  auto increment_backward_counts = [&](int stage) {
    ++count(stage, ActionType::kBackwardInput);
    ++count(stage, ActionType::kBackwardWeight);
  };
  auto add_overlap_f_b = [&](int forward_stage, int backward_stage) {
    const int forward_mb = count(forward_stage, ActionType::kForward);
    const int backward_mb = count(backward_stage, ActionType::kBackwardInput);
    Action overlap{-1, ActionType::kOverlapFB, std::nullopt, {}};
    overlap.sub_actions = {VAction(forward_stage, ActionType::kForward, forward_mb),
                           VAction(backward_stage, ActionType::kFullBackward, backward_mb)};
    actions.push_back(std::move(overlap));
    count(forward_stage, ActionType::kForward) = forward_mb + 1;
    increment_backward_counts(backward_stage);
  };
  // A FULL_BACKWARD takes the BACKWARD_INPUT counter and moves the I and W counters on.
  auto add_action = [&](int stage, ActionType type) {
    const ActionType key = type == ActionType::kFullBackward ? ActionType::kBackwardInput : type;
    const int mb = count(stage, key);
    actions.push_back(VAction(stage, type, mb));
    if (type == ActionType::kFullBackward) {
      increment_backward_counts(stage);
    } else {
      if (type == ActionType::kBackwardInput) weight_queue.emplace_back(stage, mb);
      count(stage, key) = mb + 1;
    }
  };
  auto add_weight_action_if_pending = [&]() {
    if (weight_queue.empty()) return;
    const auto [stage, mb] = weight_queue.front();
    weight_queue.pop_front();
    actions.push_back(VAction(stage, ActionType::kBackwardWeight, mb));
    ++count(stage, ActionType::kBackwardWeight);
  };

  // Step 1: F0.
  for (int i = 0; i < (num_ranks - rank - 1) * 2; ++i) add_action(stage0, ActionType::kForward);
  // Step 2: F0F1.
  for (int i = 0; i < rank + 1; ++i) {
    add_action(stage0, ActionType::kForward);
    add_action(stage1, ActionType::kForward);
  }
  // Step 3: I1W1F1.
  for (int i = 0; i < num_ranks - rank - 1; ++i) {
    add_action(stage1, ActionType::kBackwardInput);
    add_weight_action_if_pending();
    add_action(stage1, ActionType::kForward);
  }
  // Step 4: F0B1-F1B0, overlapped (the last rank's first pair not, to shrink the bubble).
  const int step_4 = n_microbatches - num_ranks * 2 + rank + 1;
  for (int i = 0; i < step_4; ++i) {
    if (i == 0 && rank == num_ranks - 1) {
      add_action(stage0, ActionType::kForward);
      add_action(stage1, ActionType::kFullBackward);
    } else {
      add_overlap_f_b(stage0, stage1);
    }
    add_overlap_f_b(stage1, stage0);
  }
  // Step 5: B1-F1B0.
  for (int i = 0; i < num_ranks - rank - 1; ++i) {
    add_action(stage1, ActionType::kFullBackward);
    add_overlap_f_b(stage1, stage0);
  }
  // Step 6: B1B0, the second half split into I and W.
  const int step_6 = rank + 1;
  bool enable_zb = false;
  for (int i = 0; i < step_6; ++i) {
    if (i == step_6 / 2 && rank % 2 == 1) enable_zb = true;
    add_action(stage1, enable_zb ? ActionType::kBackwardInput : ActionType::kFullBackward);
    if (i == step_6 / 2 && rank % 2 == 0) enable_zb = true;
    add_action(stage0, enable_zb ? ActionType::kBackwardInput : ActionType::kFullBackward);
  }
  // Step 7: W0B0.
  for (int i = 0; i < num_ranks - rank - 1; ++i) {
    add_weight_action_if_pending();
    add_action(stage0, enable_zb ? ActionType::kBackwardInput : ActionType::kFullBackward);
  }
  // Step 8: W0.
  for (int i = 0; i < rank + 1; ++i) add_weight_action_if_pending();
  return actions;
}

}  // namespace fsdp::pipelining::internal
