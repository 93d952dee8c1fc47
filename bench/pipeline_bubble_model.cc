// See pipeline_bubble_model.h.
#include "bench/pipeline_bubble_model.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>

namespace fsdp::bench {

using pipelining::Action;
using pipelining::ActionType;
using pipelining::ScheduleKind;

double ReplayedBubble(const std::map<int, std::vector<Action>>& lowered, int num_stages, int v, const StageCosts& costs,
                      double* makespan_us) {
  std::map<int, std::vector<Action>> compute;
  for (const auto& [rank, list] : lowered) {
    for (const Action& a : list) {
      for (const Action& leaf : a.sub_actions.empty() ? std::vector<Action>{a} : a.sub_actions) {
        if (leaf.IsCompute()) compute[rank].push_back(leaf);
      }
    }
  }
  auto cost = [&](const Action& a) {
    switch (a.type) {
      case ActionType::kForward: return costs.forward_us / v;
      case ActionType::kFullBackward: return (costs.input_us + costs.weight_us) / v;
      case ActionType::kBackwardInput: return a.stage == 0 ? 0.0 : costs.input_us / v;
      case ActionType::kBackwardWeight: return costs.weight_us / v;
      default: return 0.0;
    }
  };
  // (0 forward | 1 input gradient | 2 weight gradient, stage, microbatch) -> finish time.
  std::map<std::tuple<int, int, int>, double> done;
  std::map<int, size_t> next;
  std::map<int, double> free_at, busy;
  for (bool moved = true; moved;) {
    moved = false;
    for (auto& [rank, list] : compute) {
      while (next[rank] < list.size()) {
        const Action& a = list[next[rank]];
        const int s = a.stage, mb = a.microbatch.value_or(0);
        std::optional<std::tuple<int, int, int>> dep;
        if (a.type == ActionType::kForward && s > 0) dep = {0, s - 1, mb};
        if (a.type == ActionType::kFullBackward || a.type == ActionType::kBackwardInput) {
          dep = s + 1 < num_stages ? std::tuple{1, s + 1, mb} : std::tuple{0, s, mb};
        }
        if (a.type == ActionType::kBackwardWeight) dep = {1, s, mb};
        double ready = free_at[rank];
        if (dep) {
          auto it = done.find(*dep);
          if (it == done.end()) break;
          ready = std::max(ready, it->second);
        }
        free_at[rank] = ready + cost(a);
        busy[rank] += cost(a);
        done[{a.type == ActionType::kForward          ? 0
              : a.type == ActionType::kBackwardWeight ? 2
                                                      : 1,
              s, mb}] = free_at[rank];
        ++next[rank];
        moved = true;
      }
    }
  }
  double makespan = 0, busy_sum = 0;
  for (auto& [rank, list] : compute) {
    if (next[rank] != list.size()) return NAN;  // not runnable as replayed
    makespan = std::max(makespan, free_at[rank]);
    busy_sum += busy[rank];
  }
  *makespan_us = makespan;
  return 1 - busy_sum / static_cast<double>(compute.size()) / makespan;
}

double TheoryBubble(ScheduleKind kind, int p, int v, int m) {
  switch (kind) {
    case ScheduleKind::kGPipe:
    case ScheduleKind::k1F1B: return (p - 1.0) / (m + p - 1.0);
    case ScheduleKind::kInterleaved1F1B:
    case ScheduleKind::kLoopedBFS: return (p - 1.0) / (v * m + p - 1.0);
    default: return NAN;
  }
}

}  // namespace fsdp::bench
