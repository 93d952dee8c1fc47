#include "optim_state/optim_state_dict.h"

#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <memory>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/object_collectives.h"
#include "optim_state/optimizer_adapter.h"

namespace fsdp::optim_state {
namespace {

using torch::optim::OptimizerParamState;

// FQN of each parameter tensor the optimizer holds.
absl::flat_hash_map<const void*, std::string> NamesByTensor(const NamedParams& named) {
  absl::flat_hash_map<const void*, std::string> out;
  for (const auto& [fqn, t] : named) out.emplace(t.unsafeGetTensorImpl(), fqn);
  return out;
}

std::vector<std::string> GroupFqns(const torch::optim::OptimizerParamGroup& group, size_t index,
                                   const absl::flat_hash_map<const void*, std::string>& names) {
  std::vector<std::string> out;
  for (size_t i = 0; i < group.params().size(); ++i) {
    auto it = names.find(group.params()[i].unsafeGetTensorImpl());
    TORCH_CHECK(it != names.end(), "optimizer param group ", index, " parameter ", i, " (shape ",
                c10::str(c10::IntArrayRef(group.params()[i].sizes())), ") is not among the named parameters");
    out.push_back(it->second);
  }
  return out;
}

std::string List(const std::vector<std::string>& fqns) { return absl::StrCat("[", absl::StrJoin(fqns, ", "), "]"); }

}  // namespace

std::vector<size_t> MatchParamGroups(const std::vector<std::vector<std::string>>& optimizer_groups,
                                     const std::vector<ParamGroupState>& loaded, const char* caller) {
  absl::flat_hash_map<std::string, size_t> loaded_group;  // FQN -> index in `loaded`
  for (size_t i = 0; i < loaded.size(); ++i) {
    for (const auto& fqn : loaded[i].params) {
      auto [it, added] = loaded_group.emplace(fqn, i);
      TORCH_CHECK(added, caller, ": the optimizer state lists '", fqn, "' in param groups ", it->second, " and ", i);
    }
  }
  absl::flat_hash_map<std::string, size_t> optimizer_group;  // FQN -> index in `optimizer_groups`
  for (size_t g = 0; g < optimizer_groups.size(); ++g) {
    for (const auto& fqn : optimizer_groups[g]) optimizer_group.emplace(fqn, g);
  }
  for (size_t i = 0; i < loaded.size(); ++i) {
    for (const auto& fqn : loaded[i].params) {
      TORCH_CHECK(optimizer_group.contains(fqn), caller, ": param group ", i, " of the optimizer state holds '", fqn,
                  "', which is not a parameter of the optimizer");
    }
  }
  std::vector<size_t> out;
  std::vector<bool> used(loaded.size(), false);
  for (size_t g = 0; g < optimizer_groups.size(); ++g) {
    const std::vector<std::string>& fqns = optimizer_groups[g];
    std::optional<size_t> match;
    for (const auto& fqn : fqns) {
      auto it = loaded_group.find(fqn);
      TORCH_CHECK(it != loaded_group.end(), caller, ": the optimizer's parameter '", fqn, "' (param group ", g,
                  ") is in no param group of the optimizer state");
      TORCH_CHECK(!match || *match == it->second, caller, ": the optimizer's param group ", g, " holds ", List(fqns),
                  " but the optimizer state splits them across its param groups ", *match, " and ", it->second, " ('",
                  fqns.front(), "' in ", *match, ", '", fqn, "' in ", it->second, ")");
      match = it->second;
    }
    if (!match) {  // an empty group takes the first unused empty one
      for (size_t i = 0; i < loaded.size() && !match; ++i) {
        if (!used[i] && loaded[i].params.empty()) match = i;
      }
      TORCH_CHECK(match, caller, ": the optimizer's param group ", g,
                  " is empty and the optimizer state has no empty param group left for it");
    }
    for (const auto& fqn : loaded[*match].params) {
      const size_t other = optimizer_group.at(fqn);
      TORCH_CHECK(other == g, caller, ": param group ", *match, " of the optimizer state holds ",
                  List(loaded[*match].params), " but the optimizer splits them across its param groups ", g, " and ",
                  other, " ('", fqns.front(), "' in ", g, ", '", fqn, "' in ", other, ")");
    }
    used[*match] = true;
    out.push_back(*match);
  }
  TORCH_CHECK(loaded.size() == optimizer_groups.size(), caller, ": the optimizer state has ", loaded.size(),
              " param groups but the optimizer has ", optimizer_groups.size());
  return out;
}

OptimStateDict GetOptimStateDict(const torch::optim::Optimizer& optimizer, const NamedParams& named) {
  const std::shared_ptr<const OptimizerAdapter> adapter = OptimizerAdapterFor(optimizer);
  const auto names = NamesByTensor(named);
  OptimStateDict out;
  out.optimizer = adapter->name();
  const auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    ParamGroupState group{GroupFqns(groups[g], g, names), adapter->ReadOptions(groups[g].options())};
    for (size_t i = 0; i < groups[g].params().size(); ++i) {
      auto it = optimizer.state().find(groups[g].params()[i].unsafeGetTensorImpl());
      if (it != optimizer.state().end() && it->second) out.state[group.params[i]] = adapter->ReadState(*it->second);
    }
    out.param_groups.push_back(std::move(group));
  }
  return out;
}

namespace {

// What SetOptimStateDict installs, built and checked without changing the optimizer.
struct PreparedState {
  std::shared_ptr<const OptimizerAdapter> adapter;
  std::vector<const OptionMap*> options;  // per optimizer group: the loaded group's options
  std::vector<std::pair<void*, std::unique_ptr<OptimizerParamState>>> states;
};

PreparedState PrepareOptimState(torch::optim::Optimizer& optimizer, const NamedParams& named,
                                const OptimStateDict& state_dict, StateTensors tensors) {
  PreparedState out{OptimizerAdapterFor(optimizer)};
  TORCH_CHECK(state_dict.optimizer == out.adapter->name(), "the optimizer state is for ", state_dict.optimizer,
              " but the optimizer is ", out.adapter->name());
  const auto names = NamesByTensor(named);
  auto& groups = optimizer.param_groups();
  absl::flat_hash_map<std::string, at::Tensor> params;
  std::vector<std::vector<std::string>> group_fqns;
  for (size_t g = 0; g < groups.size(); ++g) {
    group_fqns.push_back(GroupFqns(groups[g], g, names));
    for (size_t i = 0; i < group_fqns[g].size(); ++i) params.emplace(group_fqns[g][i], groups[g].params()[i]);
  }
  // The options of the loaded group holding each optimizer group's FQNs.
  for (size_t i : MatchParamGroups(group_fqns, state_dict.param_groups, "SetOptimStateDict")) {
    out.options.push_back(&state_dict.param_groups[i].options);
  }
  for (const auto& [fqn, state] : state_dict.state) {
    TORCH_CHECK(params.contains(fqn), "the optimizer state has state for '", fqn,
                "', which is not a parameter of the optimizer");
  }
  for (size_t g = 0; g < groups.size(); ++g) {  // on a copy: only the checks count here
    out.adapter->WriteOptions(OptionReader(*out.options[g]), *groups[g].options().clone());
  }
  for (const auto& [fqn, state] : state_dict.state) {
    const at::Tensor& p = params.at(fqn);
    out.states.emplace_back(p.unsafeGetTensorImpl(),
                            out.adapter->MakeState(ParamStateReader(state, fqn, p, tensors == StateTensors::kAdopt)));
  }
  return out;
}

}  // namespace

void SetOptimStateDict(torch::optim::Optimizer& optimizer, const NamedParams& named, const OptimStateDict& state_dict,
                       StateTensors tensors) {
  // Everything is read and checked before the optimizer changes: a bad state leaves it as it was.
  PreparedState prepared = PrepareOptimState(optimizer, named, state_dict, tensors);
  auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    prepared.adapter->WriteOptions(OptionReader(*prepared.options[g]), groups[g].options());
  }
  optimizer.state().clear();
  for (auto& [key, state] : prepared.states) optimizer.state()[key] = std::move(state);
}

void CheckOptimStateDict(torch::optim::Optimizer& optimizer, const NamedParams& named,
                         const OptimStateDict& state_dict) {
  PrepareOptimState(optimizer, named, state_dict, StateTensors::kAdopt);  // adopting: no copies
}

void CheckStateAgreement(const comm::ProcessGroupPtr& world, const std::vector<std::string>& fqns,
                         const OptimStateDict& local, const char* caller) {
  if (!world || world->size() == 1 || fqns.empty()) return;
  at::Tensor has = at::empty({static_cast<int64_t>(fqns.size())}, at::kInt);
  for (size_t i = 0; i < fqns.size(); ++i) has[i] = local.state.count(fqns[i]) ? 1 : 0;
  // Over NCCL through its CUDA device (comm::ProcessGroup::object_collective_device).
  at::Tensor lo = comm::ToObjectCollectiveDevice(*world, has).clone(), hi = lo.clone();
  world->all_reduce(lo, comm::ReduceOp::Min())->wait();
  world->all_reduce(hi, comm::ReduceOp::Max())->wait();
  lo = lo.cpu();
  hi = hi.cpu();
  for (size_t i = 0; i < fqns.size(); ++i) {
    TORCH_CHECK(lo[i].item<int>() == hi[i].item<int>(), caller, ": some ranks have optimizer state for '", fqns[i],
                "' and others do not (this rank: ", has[i].item<int>() ? "has" : "lacks", " it)");
  }
  // Scalar state (e.g. step) is taken from this rank, so it must be the same everywhere.
  std::vector<std::pair<std::string, std::string>> where;
  std::vector<double> scalars;
  for (const auto& fqn : fqns) {
    auto it = local.state.find(fqn);
    if (it == local.state.end()) continue;
    for (const auto& [name, value] : it->second) {
      if (Classify(value) == StateKind::kPositiveDimTensor) continue;
      where.emplace_back(fqn, name);
      if (const auto* t = std::get_if<at::Tensor>(&value)) {
        scalars.push_back(t->item<double>());
      } else if (const auto* i = std::get_if<int64_t>(&value)) {
        scalars.push_back(static_cast<double>(*i));
      } else {
        scalars.push_back(std::get<double>(value));
      }
    }
  }
  at::Tensor count = at::full({2}, static_cast<double>(scalars.size()), at::kDouble);
  count[1] = -count[1];  // one MAX gives both the largest and (negated) the smallest count
  count = comm::ToObjectCollectiveDevice(*world, count);
  world->all_reduce(count, comm::ReduceOp::Max())->wait();
  count = count.cpu();
  TORCH_CHECK(count[0].item<double>() == -count[1].item<double>(), caller,
              ": ranks hold different numbers of scalar optimizer states (this rank: ", scalars.size(), ")");
  if (scalars.empty()) return;
  at::Tensor values = at::tensor(scalars, at::kDouble);
  at::Tensor both = comm::ToObjectCollectiveDevice(*world, at::cat({values, -values}));
  world->all_reduce(both, comm::ReduceOp::Max())->wait();
  both = both.cpu();
  const int64_t n = values.numel();
  for (int64_t i = 0; i < n; ++i) {
    const double max = both[i].item<double>(), min = -both[n + i].item<double>();
    TORCH_CHECK(max == min, caller, ": scalar optimizer state '", where[i].second, "' of '", where[i].first,
                "' differs across ranks (from ", min, " to ", max, "; this rank: ", scalars[i], ")");
  }
}

std::map<int64_t, StateMap> StateById(const OptimStateDict& state_dict) {
  std::map<int64_t, StateMap> out;
  int64_t id = 0;
  for (const auto& g : state_dict.param_groups) {
    for (const auto& fqn : g.params) {
      auto it = state_dict.state.find(fqn);
      if (it != state_dict.state.end()) out[id] = it->second;
      ++id;
    }
  }
  for (const auto& [fqn, values] : state_dict.state) {
    bool listed = false;
    for (const auto& g : state_dict.param_groups) listed = listed || std::count(g.params.begin(), g.params.end(), fqn);
    TORCH_CHECK(listed, "StateById: '", fqn, "' has state but is in no param group");
  }
  return out;
}

OptimStateDict FromStateById(std::string optimizer, std::vector<ParamGroupState> param_groups,
                             const std::map<int64_t, StateMap>& state) {
  OptimStateDict out{std::move(optimizer), {}, std::move(param_groups)};
  std::vector<std::string> fqns;
  for (const auto& g : out.param_groups) fqns.insert(fqns.end(), g.params.begin(), g.params.end());
  for (const auto& [id, values] : state) {
    TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(fqns.size()), "FromStateById: parameter ID ", id,
                " is not in [0, ", fqns.size(), ") (the param groups list ", fqns.size(), " parameters)");
    out.state[fqns[id]] = values;
  }
  return out;
}

OptimStateDict BroadcastOptimStateDict(const OptimStateDict& state_dict, const comm::ProcessGroupPtr& world) {
  TORCH_CHECK(world != nullptr, "BroadcastOptimStateDict: world group is null");
  if (world->size() == 1) return state_dict;
  std::vector<char> bytes;
  if (world->rank() == 0) bytes = SerializeOptimStateDict(state_dict);
  bytes = comm::BroadcastBytes(world, bytes, 0);
  if (world->rank() == 0) return state_dict;
  return DeserializeOptimStateDict(bytes, "rank 0's broadcast");
}

}  // namespace fsdp::optim_state
