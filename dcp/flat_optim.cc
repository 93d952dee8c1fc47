// FSDP1 optimizer state between the optimizer's local form (flat-parameter keys) and DCP's
// per-original-parameter form (flat_pieces.h FlatOptimToPieces / PiecesToFlatOptim). The
// pieces are this rank's flat ranges of each original parameter, so no communication: a
// flat shard's state is cut into (and reassembled from) the same ranges as the parameters.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "dcp/flat_pieces.h"

namespace fsdp::dcp::internal {
namespace {

std::vector<std::string> ExpandGroup(const std::vector<std::string>& keys, const FlatModel& flat) {
  std::vector<std::string> out;
  for (const std::string& k : keys) {
    auto it = flat.fqns_of_flat_param.find(k);
    if (it == flat.fqns_of_flat_param.end()) {
      out.push_back(k);  // a parameter no FSDP1 unit manages
    } else {
      out.insert(out.end(), it->second.begin(), it->second.end());
    }
  }
  return out;
}

}  // namespace

optim_state::OptimStateDict FlatOptimToPieces(const optim_state::OptimStateDict& local, const FlatModel& flat) {
  optim_state::OptimStateDict out;
  out.optimizer = local.optimizer;
  for (const auto& [key, state] : local.state) {
    auto fqns = flat.fqns_of_flat_param.find(key);
    if (fqns == flat.fqns_of_flat_param.end()) {
      out.state[key] = state;
      continue;
    }
    for (const std::string& fqn : fqns->second) {
      const FlatPiece& piece = flat.by_fqn.at(fqn);
      optim_state::StateMap& mine = out.state[fqn];
      for (const auto& [name, value] : state) {
        const at::Tensor* t = std::get_if<at::Tensor>(&value);
        if (t == nullptr || t->dim() == 0) {
          mine[name] = value;  // step and other scalars: every original parameter has them
        } else if (piece.local.defined()) {
          mine[name] = t->narrow(0, piece.offset_in_shard, piece.local.numel());
        } else {
          mine[name] = at::empty({0}, t->options());
        }
      }
    }
  }
  for (const auto& g : local.param_groups) out.param_groups.push_back({ExpandGroup(g.params, flat), g.options});
  return out;
}

optim_state::OptimStateDict PiecesToFlatOptim(const optim_state::OptimStateDict& pieces, const FlatModel& flat,
                                              const char* caller) {
  optim_state::OptimStateDict out;
  out.optimizer = pieces.optimizer;
  for (const auto& [key, state] : pieces.state) {
    if (!flat.by_fqn.count(key)) out.state[key] = state;
  }
  for (const auto& [flat_key, fqns] : flat.fqns_of_flat_param) {
    optim_state::StateMap merged;
    for (const std::string& fqn : fqns) {
      auto it = pieces.state.find(fqn);
      if (it == pieces.state.end()) continue;  // no state (e.g. saved before the first step)
      const FlatPiece& piece = flat.by_fqn.at(fqn);
      for (const auto& [name, value] : it->second) {
        const at::Tensor* t = std::get_if<at::Tensor>(&value);
        if (t == nullptr || t->dim() == 0) {
          merged.emplace(name, value);  // the first original parameter's (they agree)
          continue;
        }
        auto slot = merged.find(name);
        if (slot == merged.end()) {
          // Padding and ranges no original parameter covers stay zero (as FSDP1's flattening).
          slot = merged.emplace(name, at::zeros({piece.shard_numel}, t->options())).first;
        }
        if (piece.local.defined()) {
          TORCH_CHECK(t->numel() == piece.local.numel(), caller, ": optimizer state '", name, "' of '", fqn, "' has ",
                      t->numel(), " elements for this rank's ", piece.local.numel());
          std::get<at::Tensor>(slot->second).narrow(0, piece.offset_in_shard, t->numel()).copy_(t->reshape({-1}));
        }
      }
    }
    if (!merged.empty()) out.state[flat_key] = std::move(merged);
  }
  // Param groups: each original name maps to its flat parameter (once, in first-seen order).
  absl::flat_hash_map<std::string, std::string> key_of;
  for (const auto& [flat_key, fqns] : flat.fqns_of_flat_param) {
    for (const std::string& fqn : fqns) key_of.emplace(fqn, flat_key);
  }
  for (const auto& g : pieces.param_groups) {
    optim_state::ParamGroupState group{{}, g.options};
    absl::flat_hash_set<std::string> seen;
    for (const std::string& fqn : g.params) {
      auto it = key_of.find(fqn);
      const std::string& key = it == key_of.end() ? fqn : it->second;
      if (seen.insert(key).second) group.params.push_back(key);
    }
    out.param_groups.push_back(std::move(group));
  }
  return out;
}

}  // namespace fsdp::dcp::internal
