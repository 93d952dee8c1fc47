// The lowering passes of torch/distributed/pipelining/schedules.py (_validate_schedule,
// _add_unshard_reshard, _add_reduce_grad, _add_send_recv, _add_wait_send,
// _validate_send_waits, _defer_recv_ops) and _PipelineScheduleRuntime's
// _prepare_schedule_with_comms(format="compute_only") that chains them.
#include "pipelining/lowering.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp::pipelining {
namespace {

using Key = std::tuple<ActionType, int, std::optional<int>>;  // (type, stage, microbatch)

Key KeyOf(const Action& a) { return {a.type, a.stage, a.microbatch}; }

Action LoweredAction(int stage, ActionType type, std::optional<int> mb) { return Action{stage, type, mb, {}}; }

// `action.sub_actions or (action,)`.
std::vector<Action> Parts(const Action& action) {
  return action.sub_actions.empty() ? std::vector<Action>{action} : action.sub_actions;
}

std::string MbString(const std::optional<int>& mb) { return mb.has_value() ? std::to_string(*mb) : "None"; }

// A Python list of optional actions: dropping the idle steps.
std::vector<std::optional<Action>> AsOptional(const std::vector<Action>& actions) {
  return {actions.begin(), actions.end()};
}

// An insertion-ordered map (Python's dict) of small size.
template <class K, class V>
class OrderedMap {
 public:
  V* Find(const K& k) {
    for (auto& [key, v] : items_) {
      if (key == k) return &v;
    }
    return nullptr;
  }
  void Set(const K& k, V v) {
    if (V* old = Find(k)) {
      *old = std::move(v);
    } else {
      items_.emplace_back(k, std::move(v));
    }
  }
  V Pop(const K& k) {
    auto it = std::find_if(items_.begin(), items_.end(), [&](const auto& kv) { return kv.first == k; });
    V v = std::move(it->second);
    items_.erase(it);
    return v;
  }
  const std::vector<std::pair<K, V>>& items() const { return items_; }
  bool empty() const { return items_.empty(); }

 private:
  std::vector<std::pair<K, V>> items_;
};

}  // namespace

std::map<int, int> ValidateSchedule(const PipelineOrder& actions, int num_ranks, int num_stages, int n_microbatches) {
  TORCH_CHECK(static_cast<int>(actions.size()) == num_ranks, "Schedule has incorrect number of ranks - expected ",
              num_ranks, ", actual ", actions.size());
  for (int rank = 0; rank < num_ranks; ++rank) {
    TORCH_CHECK(actions.count(rank), "Schedule is missing actions for rank ", rank);
  }
  // stage -> type -> the microbatches seen (F, B, I, W).
  std::map<int, std::map<ActionType, std::set<std::optional<int>>>> stage_actions;
  for (int s = 0; s < num_stages; ++s) {
    for (ActionType t :
         {ActionType::kForward, ActionType::kFullBackward, ActionType::kBackwardInput, ActionType::kBackwardWeight}) {
      stage_actions[s][t];
    }
  }
  std::map<int, int> stage_to_rank;
  auto fail_at = [&](int rank, int step, const std::string& what) {
    TORCH_CHECK(false, "Rank ", rank, ", step ", step, ": ", what, "\n\nFull pipeline schedule:\n",
                FormatPipelineOrder(actions, step));
  };
  auto process = [&](const Action& action, int rank, int step) {
    const int s = action.stage;
    const std::optional<int>& mb = action.microbatch;
    const bool compute = action.type == ActionType::kForward || action.type == ActionType::kFullBackward ||
                         action.type == ActionType::kBackwardInput || action.type == ActionType::kBackwardWeight;
    // PyTorch's dict lookup fails there (KeyError).
    TORCH_CHECK(!compute || stage_actions.count(s), "Rank ", rank, ", step ", step, ": action ", action.ToString(),
                " names stage ", s, " outside the schedule's ", num_stages, " stages");
    auto& seen = compute ? stage_actions[s] : stage_actions[-1];
    switch (action.type) {
      case ActionType::kForward: seen[ActionType::kForward].insert(mb); break;
      case ActionType::kFullBackward:
        if (!seen[ActionType::kForward].count(mb)) {
          fail_at(rank, step,
                  absl::StrCat("Running Full Backward for stage ", s, ", microbatch ", MbString(mb),
                               " without first running Forward"));
        }
        seen[ActionType::kFullBackward].insert(mb);
        break;
      case ActionType::kBackwardInput:
        if (!seen[ActionType::kForward].count(mb)) {
          fail_at(rank, step,
                  absl::StrCat("Running Backward Input for stage ", s, ", microbatch ", MbString(mb),
                               " without first running Forward"));
        }
        seen[ActionType::kBackwardInput].insert(mb);
        break;
      case ActionType::kBackwardWeight:
        if (!seen[ActionType::kBackwardInput].count(mb)) {
          fail_at(rank, step,
                  absl::StrCat("Running Backward Weight for stage ", s, ", microbatch ", MbString(mb),
                               " without first running Backward Input"));
        }
        seen[ActionType::kBackwardWeight].insert(mb);
        break;
      default: break;
    }
    auto [it, inserted] = stage_to_rank.emplace(s, rank);
    TORCH_CHECK(inserted || it->second == rank, "Rank ", rank, ", step ", step, ": Stage ", s,
                " is assigned to both rank ", rank, " and rank ", it->second);
  };
  for (const auto& [rank, rank_actions] : actions) {
    for (size_t step = 0; step < rank_actions.size(); ++step) {
      if (!rank_actions[step].has_value()) continue;
      const Action& action = *rank_actions[step];
      if (!action.sub_actions.empty()) {
        for (const Action& sub : action.sub_actions) process(sub, rank, static_cast<int>(step));
      } else {
        process(action, rank, static_cast<int>(step));
      }
    }
  }
  for (int s = 0; s < num_stages; ++s) {
    auto& seen = stage_actions[s];
    const size_t f = seen[ActionType::kForward].size(), b = seen[ActionType::kFullBackward].size();
    const size_t i = seen[ActionType::kBackwardInput].size(), w = seen[ActionType::kBackwardWeight].size();
    // PyTorch formats the type as its enum member there.
    TORCH_CHECK(static_cast<int>(f) == n_microbatches, "Got ", f, " _ComputationType.FORWARD microbatches for stage ",
                s, ", expected ", n_microbatches);
    TORCH_CHECK(i == w, "Invalid backward microbatches for stage ", s,
                ": I and W must have equal counts,             but got I=", i, ", W=", w);
    TORCH_CHECK(static_cast<int>(b + (i + w) / 2) == n_microbatches, "Invalid backward microbatches for stage ", s,
                ": expected ", n_microbatches, " total backwards,             but got B=", b, ", I=", i, ", W=", w);
  }
  return stage_to_rank;
}

std::vector<Action> AddUnshardReshard(const std::vector<std::optional<Action>>& compute_actions, int max_active_stages,
                                      std::optional<int> unshard_lookahead) {
  const int lookahead = unshard_lookahead.value_or(max_active_stages);
  // The next `count` distinct stages computed from `from` on (an OVERLAP_F_B's stages all count,
  // even past `count`: it is one atomic action).
  auto next_stage_indices = [&](int count, size_t from) {
    std::vector<int> ret;
    for (size_t k = from; k < compute_actions.size(); ++k) {
      if (!compute_actions[k].has_value()) continue;
      for (const Action& c : Parts(*compute_actions[k])) {
        if (std::find(ret.begin(), ret.end(), c.stage) == ret.end()) ret.push_back(c.stage);
      }
      if (static_cast<int>(ret.size()) >= count) return ret;
    }
    return ret;
  };
  std::vector<int> active;  // insertion-ordered, as PyTorch's dict
  std::vector<Action> out;
  for (size_t i = 0; i < compute_actions.size(); ++i) {
    if (!compute_actions[i].has_value()) continue;
    const Action& action = *compute_actions[i];
    std::set<int> current;
    for (const Action& c : Parts(action)) current.insert(c.stage);
    TORCH_CHECK(static_cast<int>(current.size()) <= max_active_stages, "Atomic action ", action.ToString(),
                " requires ", current.size(), " stages, exceeding max_active_stages=", max_active_stages);
    const std::vector<int> resident = next_stage_indices(max_active_stages, i);
    const std::vector<int> prefetch = next_stage_indices(lookahead, i);
    std::vector<int> fetch, evict;
    for (int s : prefetch) {
      if (std::find(active.begin(), active.end(), s) == active.end()) fetch.push_back(s);
    }
    for (int s : active) {
      if (std::find(resident.begin(), resident.end(), s) == resident.end()) evict.push_back(s);
    }
    for (int s : evict) {
      active.erase(std::find(active.begin(), active.end(), s));
      out.push_back(LoweredAction(s, ActionType::kReshard, std::nullopt));
    }
    for (int s : fetch) {
      active.push_back(s);
      out.push_back(LoweredAction(s, ActionType::kUnshard, std::nullopt));
    }
    out.push_back(action);
  }
  for (int s : active) out.push_back(LoweredAction(s, ActionType::kReshard, std::nullopt));
  return out;
}

std::vector<Action> AddReduceGrad(const std::vector<std::optional<Action>>& actions, int n_microbatches,
                                  bool defer_reduce_grad_wait) {
  std::vector<Action> out;
  std::map<int, int> count;  // stage -> its B and W so far
  std::optional<int> pending;
  auto leaf = [&](const Action& a, std::vector<int>& to_schedule) {
    if (a.type != ActionType::kBackwardWeight && a.type != ActionType::kFullBackward) return;
    if (++count[a.stage] == n_microbatches) to_schedule.push_back(a.stage);
  };
  for (const auto& maybe : actions) {
    if (!maybe.has_value()) continue;
    const Action& a = *maybe;
    out.push_back(a);
    std::vector<int> to_schedule;
    if (a.type == ActionType::kOverlapFB && !a.sub_actions.empty()) {
      for (const Action& sub : a.sub_actions) leaf(sub, to_schedule);
    } else {
      leaf(a, to_schedule);
    }
    for (int stage : to_schedule) {
      if (defer_reduce_grad_wait && pending.has_value()) {
        out.push_back(LoweredAction(*pending, ActionType::kWaitReduceGrad, std::nullopt));
      }
      out.push_back(LoweredAction(stage, ActionType::kReduceGrad, std::nullopt));
      if (defer_reduce_grad_wait) {
        pending = stage;
      } else {
        out.push_back(LoweredAction(stage, ActionType::kWaitReduceGrad, std::nullopt));
      }
    }
  }
  if (pending.has_value()) out.push_back(LoweredAction(*pending, ActionType::kWaitReduceGrad, std::nullopt));
  return out;
}

std::vector<Action> AddReduceGrad(const std::vector<Action>& actions, int n_microbatches, bool defer_reduce_grad_wait) {
  return AddReduceGrad(AsOptional(actions), n_microbatches, defer_reduce_grad_wait);
}

LoweredOrder AddSendRecv(LoweredOrder compute_actions, const std::function<int(int)>& stage_to_rank, int num_stages) {
  LoweredOrder comm_actions;
  std::map<int, std::set<Key>> prev;
  for (const auto& [rank, actions] : compute_actions) {
    comm_actions[rank];
    prev[rank];
  }
  auto has_comms = [&](const Action& a) {
    if (a.type == ActionType::kForward) {
      return a.stage != num_stages - 1 && stage_to_rank(a.stage + 1) != stage_to_rank(a.stage);
    }
    if (a.type == ActionType::kBackwardInput || a.type == ActionType::kFullBackward) {
      return a.stage != 0 && stage_to_rank(a.stage - 1) != stage_to_rank(a.stage);
    }
    return false;
  };
  auto ready = [&](const Action& a, const std::set<Key>& seen) {
    auto has = [&](int stage, ActionType type) { return seen.count(Key{type, stage, a.microbatch}) > 0; };
    if (a.type == ActionType::kForward && a.stage != 0) {
      return has(a.stage, ActionType::kRecvF) || has(a.stage - 1, ActionType::kForward);
    }
    if ((a.type == ActionType::kBackwardInput || a.type == ActionType::kFullBackward) && a.stage != num_stages - 1) {
      return has(a.stage, ActionType::kRecvB) || has(a.stage + 1, ActionType::kBackwardInput) ||
             has(a.stage + 1, ActionType::kFullBackward);
    }
    return true;
  };
  std::map<int, size_t> next;  // rank -> index of its next action (PyTorch pops the front)
  for (const auto& [rank, actions] : compute_actions) next[rank] = 0;
  while (!next.empty()) {
    bool progress = false;
    std::vector<int> ranks;
    for (const auto& [rank, k] : next) ranks.push_back(rank);
    for (int rank : ranks) {
      const std::vector<Action>& actions = compute_actions[rank];
      TORCH_CHECK(next[rank] < actions.size(), "rank=", rank, ", len(compute_actions[rank])=0");
      const Action& action = actions[next[rank]];
      const std::vector<Action> all = Parts(action);
      if (!std::all_of(all.begin(), all.end(), [&](const Action& a) { return ready(a, prev[rank]); })) continue;
      comm_actions[rank].push_back(action);
      for (const Action& a : all) {
        prev[rank].insert(KeyOf(a));
        if (!has_comms(a)) continue;
        const bool fwd = a.type == ActionType::kForward;
        const Action send = LoweredAction(a.stage, fwd ? ActionType::kSendF : ActionType::kSendB, a.microbatch);
        const Action recv =
            LoweredAction(fwd ? a.stage + 1 : a.stage - 1, fwd ? ActionType::kRecvF : ActionType::kRecvB, a.microbatch);
        comm_actions[rank].push_back(send);
        prev[rank].insert(KeyOf(send));
        const int peer = stage_to_rank(recv.stage);
        TORCH_CHECK(comm_actions.count(peer), "stage ", recv.stage, " maps to rank ", peer,
                    ", which has no actions in the schedule");
        comm_actions[peer].push_back(recv);
        prev[peer].insert(KeyOf(recv));
      }
      if (++next[rank] == actions.size()) next.erase(rank);
      progress = true;
    }
    TORCH_CHECK(progress, "Malformed compute schedule, can't schedule sends/recvs");
  }
  return comm_actions;
}

LoweredOrder AddWaitSend(const LoweredOrder& comm_actions) {
  LoweredOrder out;
  for (const auto& [rank, actions] : comm_actions) {
    OrderedMap<Key, Action> pending;
    std::vector<Action>& with_waits = out[rank];
    for (const Action& action : actions) {
      with_waits.push_back(action);
      if (action.type == ActionType::kSendF || action.type == ActionType::kSendB) {
        TORCH_CHECK(action.microbatch.has_value(), "Send action ", action.ToString(), " has no microbatch index");
        TORCH_CHECK(pending.Find(KeyOf(action)) == nullptr, "Duplicate pipeline send ", action.ToString());
        pending.Set(KeyOf(action), action);
      }
      for (const Action& part : Parts(action)) {
        if (part.type != ActionType::kFullBackward && part.type != ActionType::kBackwardInput) continue;
        TORCH_CHECK(part.microbatch.has_value(), "Backward action ", part.ToString(), " has no microbatch index");
        const Key key{ActionType::kSendF, part.stage, part.microbatch};
        if (pending.Find(key) != nullptr) {
          with_waits.push_back(LoweredAction(part.stage, ActionType::kWaitSendF, part.microbatch));
          pending.Pop(key);
        }
      }
    }
    for (const auto& [key, send] : pending.items()) {
      const auto& [type, stage, mb] = key;
      with_waits.push_back(
          LoweredAction(stage, type == ActionType::kSendF ? ActionType::kWaitSendF : ActionType::kWaitSendB, mb));
    }
  }
  return out;
}

void ValidateSendWaits(const LoweredOrder& comm_actions) {
  for (const auto& [rank, actions] : comm_actions) {
    std::set<Key> pending, registered;
    for (const Action& action : actions) {
      for (const Action& part : Parts(action)) {
        if (part.type == ActionType::kSendF || part.type == ActionType::kSendB) {
          TORCH_CHECK(part.microbatch.has_value(), "Send action ", part.ToString(), " at rank ", rank,
                      " has no microbatch index");
          TORCH_CHECK(registered.insert(KeyOf(part)).second, "Duplicate pipeline send ", part.ToString(), " at rank ",
                      rank);
          pending.insert(KeyOf(part));
        } else if (part.type == ActionType::kWaitSendF || part.type == ActionType::kWaitSendB) {
          TORCH_CHECK(part.microbatch.has_value(), "Wait action ", part.ToString(), " at rank ", rank,
                      " has no microbatch index");
          const Key key{part.type == ActionType::kWaitSendF ? ActionType::kSendF : ActionType::kSendB, part.stage,
                        part.microbatch};
          TORCH_CHECK(pending.erase(key) == 1, "Pipeline wait ", part.ToString(), " at rank ", rank,
                      " has no pending send");
        }
      }
    }
    if (pending.empty()) continue;
    // Sorted by (stage, microbatch, type's string): "SEND_B" before "SEND_F".
    std::vector<Key> sorted(pending.begin(), pending.end());
    std::sort(sorted.begin(), sorted.end(), [](const Key& a, const Key& b) {
      return std::make_tuple(std::get<1>(a), std::get<2>(a), ActionTypeName(std::get<0>(a))) <
             std::make_tuple(std::get<1>(b), std::get<2>(b), ActionTypeName(std::get<0>(b)));
    });
    std::vector<std::string> sends;
    for (const auto& [type, stage, mb] : sorted) sends.push_back(LoweredAction(stage, type, mb).ToString());
    TORCH_CHECK(false, "Pipeline sends at rank ", rank, " have no matching wait: ", absl::StrJoin(sends, ", "));
  }
}

LoweredOrder DeferRecvOps(const LoweredOrder& actions, const std::function<int(int)>& stage_to_rank) {
  auto recv_peer = [&](const Action& a) {
    return stage_to_rank(a.type == ActionType::kRecvF ? a.stage - 1 : a.stage + 1);
  };
  auto send_peer = [&](const Action& a) {
    return stage_to_rank(a.type == ActionType::kSendF ? a.stage + 1 : a.stage - 1);
  };
  using RecvKey = std::tuple<int, ActionType, std::optional<int>>;  // (stage, type, microbatch)
  LoweredOrder result;
  for (const auto& [rank, action_list] : actions) {
    std::vector<Action> out;
    OrderedMap<RecvKey, Action> deferred;
    for (const Action& action : action_list) {
      if (action.type == ActionType::kRecvF || action.type == ActionType::kRecvB) {
        deferred.Set(RecvKey{action.stage, action.type, action.microbatch}, action);
        continue;
      }
      if (action.type == ActionType::kSendF || action.type == ActionType::kSendB) {
        // Rank parity: the lower rank posts its receives from the peer before sending to it.
        const int peer = send_peer(action);
        if (rank < peer) {
          std::vector<RecvKey> flush;
          for (const auto& [key, recv] : deferred.items()) {
            if (recv_peer(recv) == peer) flush.push_back(key);
          }
          for (const RecvKey& key : flush) out.push_back(deferred.Pop(key));
        }
      }
      for (const Action& sub : Parts(action)) {
        std::optional<RecvKey> key;
        if (sub.type == ActionType::kForward) {
          key = RecvKey{sub.stage, ActionType::kRecvF, sub.microbatch};
        } else if (sub.type == ActionType::kFullBackward || sub.type == ActionType::kBackwardInput) {
          key = RecvKey{sub.stage, ActionType::kRecvB, sub.microbatch};
        }
        if (key.has_value() && deferred.Find(*key) != nullptr) out.push_back(deferred.Pop(*key));
      }
      out.push_back(action);
    }
    if (!deferred.empty()) {
      std::vector<std::string> left;
      for (const auto& [key, recv] : deferred.items()) left.push_back(recv.ToString());
      TORCH_CHECK(false, "Malformed input schedule on rank ", rank, ": leftover RECV ops with no consumer found: [",
                  absl::StrJoin(left, ", "), "]. Every RECV must be consumed by a downstream compute op.");
    }
    result[rank] = std::move(out);
  }
  return result;
}

LoweredOrder LowerWithComms(const PipelineOrder& compute, int n_microbatches,
                            const std::function<int(int)>& stage_to_rank, int num_stages,
                            const LoweringOptions& options) {
  const std::map<int, int> mapping =
      ValidateSchedule(compute, static_cast<int>(compute.size()), num_stages, n_microbatches);
  for (const auto& [stage, rank] : mapping) {
    if (stage < 0 || stage >= num_stages) continue;  // an empty OVERLAP_F_B, a communication action's stage
    TORCH_CHECK(stage_to_rank(stage) == rank, "LowerWithComms: the schedule runs stage ", stage, " on rank ", rank,
                ", but stage_to_rank(", stage, ") is ", stage_to_rank(stage));
  }
  // _resolve_unshard_lookahead("full").
  TORCH_CHECK(options.max_active_stages >= 1, "max_active_stages must be a positive integer, got ",
              options.max_active_stages);
  for (const auto& [rank, actions] : compute) {
    for (size_t i = 0; i < actions.size(); ++i) {
      TORCH_CHECK(!actions[i].has_value() || actions[i]->IsCompute(),
                  "Expected compute-only schedule but found communication action '", actions[i]->ToString(),
                  "' at rank ", rank, ", position ", i,
                  ". Communication actions (e.g. SEND_F, RECV_F, etc.) should not be present when "
                  "format='compute_only'.");
    }
  }
  LoweredOrder lowered;
  for (const auto& [rank, actions] : compute) {
    lowered[rank] = AddReduceGrad(AddUnshardReshard(actions, options.max_active_stages, options.max_active_stages),
                                  n_microbatches, options.defer_reduce_grad_wait);
  }
  lowered = AddWaitSend(AddSendRecv(std::move(lowered), stage_to_rank, num_stages));
  if (options.defer_pp_recv) lowered = DeferRecvOps(lowered, stage_to_rank);
  ValidateSendWaits(lowered);
  return lowered;
}

}  // namespace fsdp::pipelining
