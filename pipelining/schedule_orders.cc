// The compute-only orders of torch/distributed/pipelining/schedules.py's schedules: the
// names and stage mappings, GPipe, 1F1B, Looped BFS, and the interleaved family built on
// _get_1f1b_rank_ops (Interleaved 1F1B, Interleaved Zero Bubble with _add_bubbles_to_actions).
// The V-shaped schedules are in schedule_orders_v.cc.
#include "pipelining/schedule_orders.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "pipelining/schedule_orders_internal.h"

namespace fsdp::pipelining {
namespace {

using internal::RankOps;

// Python's // and % (floor division; the divisors here are positive).
int FloorDiv(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
int FloorMod(int a, int b) { return a - FloorDiv(a, b) * b; }

Action ComputeAction(int stage, ActionType type, int microbatch) { return Action{stage, type, microbatch, {}}; }

void AddIdle(RankOps& ops, int count) {
  for (int i = 0; i < count; ++i) ops.emplace_back(std::nullopt);
}

// ScheduleGPipe._get_pipeline_order, before its _add_reduce_grad.
RankOps GPipeRankOps(int rank, int num_ranks, int n) {
  RankOps ops;
  AddIdle(ops, rank);
  for (int mb = 0; mb < n; ++mb) ops.push_back(ComputeAction(rank, ActionType::kForward, mb));
  AddIdle(ops, 3 * (num_ranks - 1 - rank));
  for (int mb = 0; mb < n; ++mb) ops.push_back(ComputeAction(rank, ActionType::kFullBackward, mb));
  return ops;
}

// Schedule1F1B._get_pipeline_order, before its _add_reduce_grad. Its forward counter starts
// at 0 and is pre-incremented in the steady state, so a rank without warmup forwards (the
// last) starts at microbatch 1: PyTorch's behaviour, kept.
RankOps OneFOneBRankOps(int rank, int num_ranks, int n) {
  RankOps ops;
  AddIdle(ops, rank);
  const int num_forward = (num_ranks - 1) - rank;
  int forward_mb = 0;
  for (int i = 0; i < num_forward; ++i) {
    ops.push_back(ComputeAction(rank, ActionType::kForward, i));
    forward_mb = i;
  }
  AddIdle(ops, std::max(0, 2 * (num_ranks - 1 - rank)));
  int backward_mb = 0;
  for (int remaining_forward = n - num_forward; remaining_forward > 0; --remaining_forward) {
    ++forward_mb;
    ops.push_back(ComputeAction(rank, ActionType::kForward, forward_mb));
    ops.push_back(ComputeAction(rank, ActionType::kFullBackward, backward_mb++));
  }
  // Cooldown: (num_ranks - rank) > 0 always holds here, so each backward follows an idle step.
  for (int remaining_backward = n - backward_mb; remaining_backward > 0; --remaining_backward) {
    ops.emplace_back(std::nullopt);
    ops.push_back(ComputeAction(rank, ActionType::kFullBackward, backward_mb++));
  }
  return ops;
}

// ScheduleLoopedBFS._calculate_single_rank_operations.
RankOps LoopedBFSRankOps(int rank, int num_ranks, int n_local, int n) {
  std::vector<int> stages;
  for (int s = rank; s < num_ranks * n_local; s += num_ranks) stages.push_back(s);
  RankOps ops;
  AddIdle(ops, rank);
  for (int s : stages) {
    for (int mb = 0; mb < n; ++mb) ops.push_back(ComputeAction(s, ActionType::kForward, mb));
  }
  AddIdle(ops, 2 * (num_ranks - 1 - rank));
  for (auto it = stages.rbegin(); it != stages.rend(); ++it) {
    for (int mb = n - 1; mb >= 0; --mb) ops.push_back(ComputeAction(*it, ActionType::kFullBackward, mb));
  }
  return ops;
}

// _get_warmup_ops.
int WarmupOps(int rank, int n_local, int microbatches_per_round, int num_ranks, int n, int multiply_factor) {
  const int last_stage = (n_local - 1) * microbatches_per_round;
  const int warmup = last_stage + multiply_factor * ((num_ranks - 1) - rank);
  return std::min(warmup, n * n_local);
}

// _get_1f1b_rank_ops.
RankOps OneFOneBRankOpsInterleaved(int n_local, int num_ranks, int warmup_ops, int fwd_bwd_ops, int cooldown_ops,
                                   int rank, const std::function<int(int)>& forward_stage_index,
                                   const std::function<int(int)>& backward_stage_index, int num_1f1b_microbatches,
                                   bool enable_zero_bubble) {
  std::map<int, int> fwd_mb, bwd_mb, weight_mb;  // stage -> next microbatch
  RankOps ops;
  AddIdle(ops, rank);
  int post_warmup_ops = (n_local * num_ranks + 2 * (num_ranks - 1 - rank)) - (warmup_ops + rank);
  if (enable_zero_bubble) post_warmup_ops = num_ranks - rank - 1;
  const int total_ops = warmup_ops + fwd_bwd_ops + cooldown_ops;
  std::vector<int> backward_op_ids;
  size_t weight_op_count = 0;
  const ActionType backward_type = enable_zero_bubble ? ActionType::kBackwardInput : ActionType::kFullBackward;

  auto add_weight = [&]() {
    const int stage = backward_stage_index(backward_op_ids[weight_op_count]);
    ops.push_back(ComputeAction(stage, ActionType::kBackwardWeight, weight_mb[stage]++));
    ++weight_op_count;
  };
  for (int op = 0; op < total_ops; ++op) {
    if (op < warmup_ops) {
      const int stage = forward_stage_index(op);
      ops.push_back(ComputeAction(stage, ActionType::kForward, fwd_mb[stage]++));
      if (op == warmup_ops - 1) AddIdle(ops, post_warmup_ops);
    } else if (op < warmup_ops + fwd_bwd_ops) {
      const int f_stage = forward_stage_index(op);
      ops.push_back(ComputeAction(f_stage, ActionType::kForward, fwd_mb[f_stage]++));
      const int b_stage = backward_stage_index(op);
      ops.push_back(ComputeAction(b_stage, backward_type, bwd_mb[b_stage]++));
      backward_op_ids.push_back(op);
      if (enable_zero_bubble && op - warmup_ops >= num_1f1b_microbatches) add_weight();
    } else {
      if (!enable_zero_bubble) ops.emplace_back(std::nullopt);
      const int b_stage = backward_stage_index(op);
      ops.push_back(ComputeAction(b_stage, backward_type, bwd_mb[b_stage]++));
      backward_op_ids.push_back(op);
      if (enable_zero_bubble && op - warmup_ops >= num_1f1b_microbatches) add_weight();
    }
  }
  while (enable_zero_bubble && weight_op_count < backward_op_ids.size()) add_weight();
  return ops;
}

// ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble._calculate_single_rank_operations.
RankOps InterleavedRankOps(int rank, int num_ranks, int n_local, int n, int microbatches_per_round, bool zero_bubble) {
  const int warmup_ops = WarmupOps(rank, n_local, microbatches_per_round, num_ranks, n, zero_bubble ? 1 : 2);
  const int microbatch_ops = n_local * n;
  const int fwd_bwd_ops = microbatch_ops - warmup_ops;
  const int cooldown_ops = microbatch_ops - fwd_bwd_ops;
  auto forward_stage_index = [&](int step) {
    const int local_index = FloorMod(FloorDiv(step, microbatches_per_round), n_local);
    return local_index * num_ranks + rank;
  };
  auto backward_stage_index = [&](int step) {
    const int local_index = n_local - 1 - FloorMod(FloorDiv(step - warmup_ops, microbatches_per_round), n_local);
    return local_index * num_ranks + rank;
  };
  return OneFOneBRankOpsInterleaved(n_local, num_ranks, warmup_ops, fwd_bwd_ops, cooldown_ops, rank,
                                    forward_stage_index, backward_stage_index, zero_bubble ? rank : 0, zero_bubble);
}

// ScheduleInterleavedZeroBubble._add_bubbles_to_actions: steps the ranks in lockstep and idles
// a rank whose next F (B) waits on the previous (next) stage's F (B) of the microbatch from an
// earlier time step. Its I and W never wait (only F and B are checked, as PyTorch).
PipelineOrder AddBubbles(const PipelineOrder& actions, int num_ranks, int num_stages_global) {
  using Seen = std::tuple<int, ActionType, int>;
  std::set<Seen> seen;
  auto need_bubble = [&](int stage, ActionType op, int mb) {
    if (op == ActionType::kForward) return stage != 0 && !seen.count({stage - 1, op, mb});
    if (op == ActionType::kFullBackward) {
      if (stage == num_stages_global - 1) return !seen.count({stage, ActionType::kForward, mb});
      return !seen.count({stage + 1, op, mb});
    }
    return false;
  };
  PipelineOrder result;
  std::map<int, size_t> next;
  for (int r = 0; r < num_ranks; ++r) {
    result[r] = {};
    next[r] = 0;
  }
  while (true) {
    bool should_stop = true;
    bool progress = false;
    std::set<Seen> temp_seen;
    for (int r = 0; r < num_ranks; ++r) {
      const auto& ops = actions.at(r);
      if (next[r] >= ops.size()) continue;
      should_stop = false;
      const std::optional<Action>& a = ops[next[r]];
      if (a.has_value()) {
        // Every action here has a microbatch.
        if (!need_bubble(a->stage, a->type, a->microbatch.value_or(-1))) {
          result[r].push_back(a);
          if (a->microbatch.has_value()) temp_seen.insert({a->stage, a->type, *a->microbatch});
          ++next[r];
          progress = true;
        } else {
          result[r].emplace_back(std::nullopt);
        }
      } else {
        ++next[r];
        progress = true;
        result[r].emplace_back(std::nullopt);
      }
    }
    seen.insert(temp_seen.begin(), temp_seen.end());
    if (should_stop) break;
    // PyTorch would loop forever here; none of its own orders gets here.
    TORCH_CHECK(progress, "InterleavedZeroBubble: adding bubbles made no progress");
  }
  return result;
}

constexpr std::pair<std::string_view, ScheduleKind> kScheduleNames[] = {
    {"GPipe", ScheduleKind::kGPipe},
    {"1F1B", ScheduleKind::k1F1B},
    {"Interleaved1F1B", ScheduleKind::kInterleaved1F1B},
    {"LoopedBFS", ScheduleKind::kLoopedBFS},
    {"InterleavedZeroBubble", ScheduleKind::kInterleavedZeroBubble},
    {"ZBVZeroBubble", ScheduleKind::kZBVZeroBubble},
    {"DualPipeV", ScheduleKind::kDualPipeV},
};

// Interleaved schedules: n must be a multiple of the number of rounds.
int MicrobatchesPerRound(int num_ranks, int n, const char* what) {
  const int rounds = std::max(1, n / num_ranks);
  TORCH_CHECK(n % rounds == 0, what, " requires the number of microbatches to be a multiple of the number of rounds (",
              rounds, "), but got ", n, ".");
  return n / rounds;
}

// Python's str.lower() over ASCII.
std::string ToLower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = absl::ascii_tolower(static_cast<unsigned char>(c));
  return out;
}

}  // namespace

ScheduleKind ScheduleKindFromName(std::string_view name) {
  const std::string lower = ToLower(name);
  for (const auto& [n, kind] : kScheduleNames) {
    if (ToLower(n) == lower) return kind;
  }
  TORCH_CHECK(lower != "pipelineschedulesingle" && lower != "pipelineschedulemulti", "Schedule name '", name,
              "' names a base class of PyTorch's schedules, not a schedule");
  TORCH_CHECK(false, "Unknown schedule name '", name,
              "'. The valid options are ['1F1B', 'Interleaved1F1B', 'GPipe', 'LoopedBFS', 'InterleavedZeroBubble', "
              "'PipelineScheduleSingle', 'PipelineScheduleMulti', 'ZBVZeroBubble', 'DualPipeV']");
  return ScheduleKind::kGPipe;  // not reached; gcc does not know TORCH_CHECK(false) throws (-Wreturn-type)
}

std::string_view ScheduleName(ScheduleKind kind) {
  for (const auto& [n, k] : kScheduleNames) {
    if (k == kind) return n;
  }
  TORCH_CHECK(false, "unknown ScheduleKind ", static_cast<int>(kind));
}

bool IsSingleStageSchedule(ScheduleKind kind) { return kind == ScheduleKind::kGPipe || kind == ScheduleKind::k1F1B; }

bool IsVShapedSchedule(ScheduleKind kind) {
  return kind == ScheduleKind::kZBVZeroBubble || kind == ScheduleKind::kDualPipeV;
}

int StageRank(ScheduleKind kind, int stage, int num_ranks) {
  TORCH_CHECK(num_ranks >= 1, "StageRank: num_ranks must be positive, got ", num_ranks);
  TORCH_CHECK(stage >= 0, "StageRank: stage must be non-negative, got ", stage);
  if (!IsVShapedSchedule(kind)) return stage % num_ranks;
  // generate_stage_to_rank_mapping(style="v"): down the ranks, then back up, and so on.
  const int turn = stage / num_ranks;
  const int offset = stage % num_ranks;
  return turn % 2 == 0 ? offset : num_ranks - 1 - offset;
}

PipelineOrder ComputeOrder(ScheduleKind kind, int num_ranks, int stages_per_rank, int n_microbatches) {
  TORCH_CHECK(num_ranks >= 1, ScheduleName(kind), ": num_ranks must be positive, got ", num_ranks);
  TORCH_CHECK(stages_per_rank >= 1, ScheduleName(kind), ": stages_per_rank must be positive, got ", stages_per_rank);
  TORCH_CHECK(n_microbatches >= 1, ScheduleName(kind), ": n_microbatches must be positive, got ", n_microbatches);
  const int num_stages = num_ranks * stages_per_rank;
  const int n = n_microbatches;
  PipelineOrder order;
  switch (kind) {
    case ScheduleKind::kGPipe:
    case ScheduleKind::k1F1B: {
      TORCH_CHECK(stages_per_rank == 1, ScheduleName(kind), " runs one stage per rank, but stages_per_rank is ",
                  stages_per_rank);
      if (kind == ScheduleKind::k1F1B) {
        TORCH_CHECK(n >= num_stages, "Number of microbatches (", n,
                    ") must be greater than or equal to the number of stages (", num_stages, ").");
      }
      for (int r = 0; r < num_ranks; ++r) {
        order[r] = kind == ScheduleKind::kGPipe ? GPipeRankOps(r, num_ranks, n) : OneFOneBRankOps(r, num_ranks, n);
      }
      return order;
    }
    case ScheduleKind::kLoopedBFS:
      for (int r = 0; r < num_ranks; ++r) order[r] = LoopedBFSRankOps(r, num_ranks, stages_per_rank, n);
      return order;
    case ScheduleKind::kInterleaved1F1B: {
      const int per_round = MicrobatchesPerRound(num_ranks, n, "Interleaved 1F1B");
      for (int r = 0; r < num_ranks; ++r) {
        order[r] = InterleavedRankOps(r, num_ranks, stages_per_rank, n, per_round, /*zero_bubble=*/false);
      }
      return order;
    }
    case ScheduleKind::kInterleavedZeroBubble: {
      const int per_round = MicrobatchesPerRound(num_ranks, n, "Zero bubble");
      for (int r = 0; r < num_ranks; ++r) {
        order[r] = InterleavedRankOps(r, num_ranks, stages_per_rank, n, per_round, /*zero_bubble=*/true);
      }
      return AddBubbles(order, num_ranks, num_stages);
    }
    case ScheduleKind::kZBVZeroBubble:
    case ScheduleKind::kDualPipeV: {
      // PyTorch's DualPipeV repeats ZBV's message.
      TORCH_CHECK(stages_per_rank == 2, "ZBV requires exactly 2 stages per rank, but got ", stages_per_rank, ".");
      if (kind == ScheduleKind::kDualPipeV) {
        TORCH_CHECK(n >= num_stages, "DualPipeV requires at least as many microbatches as stages, but got ", n,
                    " microbatches and ", num_stages, " stages.");
      }
      for (int r = 0; r < num_ranks; ++r) {
        order[r] = kind == ScheduleKind::kZBVZeroBubble ? internal::ZBVRankOps(r, num_ranks, n)
                                                        : internal::DualPipeVRankOps(r, num_ranks, n);
      }
      return order;
    }
  }
  TORCH_CHECK(false, "unknown ScheduleKind ", static_cast<int>(kind));
  return order;  // not reached
}

}  // namespace fsdp::pipelining
