#include "optim_state/fsdp1_optim_state.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "fsdp/flat_param/flat_param.h"
#include "fsdp/flat_param/flat_state.h"
#include "fsdp/flat_param/fsdp_state.h"
#include "fsdp/flat_param/fully_sharded_data_parallel.h"

namespace fsdp::optim_state {
namespace {

std::string Names(const std::vector<std::string>& names) { return absl::StrCat("[", absl::StrJoin(names, ", "), "]"); }

std::string ValueText(const StateValue& v) {
  if (const auto* t = std::get_if<at::Tensor>(&v)) return absl::StrCat(t->item<double>());
  if (const auto* i = std::get_if<int64_t>(&v)) return absl::StrCat(*i);
  return absl::StrCat(std::get<double>(v));
}

// The value's type for PyTorch's "same type" rule: positive-dim tensor, zero-dim tensor
// of a dtype, int, double.
std::string TypeKey(const StateValue& v) {
  switch (Classify(v)) {
    case StateKind::kPositiveDimTensor: return "tensor";
    case StateKind::kZeroDimTensor:
      return absl::StrCat("scalar tensor ", c10::toString(std::get<at::Tensor>(v).scalar_type()));
    case StateKind::kNonTensor: return std::holds_alternative<int64_t>(v) ? "int" : "float";
  }
  return "?";
}

}  // namespace

std::map<std::string, StateMap> UnflattenOptimState(const flat_param::FlatParamHandle& handle,
                                                    const StateMap& flat_state,
                                                    const comm::ProcessGroupPtr& shard_group,
                                                    const std::string& prefix) {
  const flat_param::FlatParameter& fp = handle.flat_param();
  std::map<std::string, StateMap> out;
  for (const auto& [name, value] : flat_state) {
    if (Classify(value) != StateKind::kPositiveDimTensor) {
      for (const auto& fqn : fp.fqns) out[prefix + fqn][name] = value;
      continue;
    }
    for (auto& [fqn, t] : flat_param::UnflattenShard(handle, std::get<at::Tensor>(value), shard_group, prefix)) {
      out[fqn][name] = std::move(t);
    }
  }
  return out;
}

StateMap FlattenOptimState(const flat_param::FlatParamHandle& handle, const std::map<std::string, StateMap>& full,
                           int64_t rank, int64_t world_size, const std::string& prefix) {
  const flat_param::FlatParameter& fp = handle.flat_param();
  std::vector<std::string> fqns;
  std::vector<const StateMap*> states;
  std::set<std::string> names;
  bool first = true;
  for (const auto& fqn : fp.fqns) {
    fqns.push_back(prefix + fqn);
    auto it = full.find(prefix + fqn);
    states.push_back(it == full.end() ? nullptr : &it->second);
    if (it == full.end()) continue;
    std::set<std::string> mine;
    for (const auto& [name, v] : it->second) mine.insert(name);
    TORCH_CHECK(first || mine == names,
                "Differing optimizer state names for the unflattened parameters: ", Names(fqns));
    names = mine;
    first = false;
  }
  StateMap flat;
  if (first) return flat;  // no state at all (e.g. before the first step)
  for (const std::string& name : names) {
    std::vector<const StateValue*> values;
    std::set<std::string> types;
    for (const StateMap* s : states) {
      values.push_back(s ? &s->at(name) : nullptr);
      if (s) types.insert(TypeKey(s->at(name)));
    }
    TORCH_CHECK(types.size() == 1, "Differing optimizer state types for state ", name,
                " and unflattened parameter names ", Names(fqns));
    if (*types.begin() == "tensor") {
      std::set<c10::ScalarType> dtypes;
      for (const StateValue* v : values) {
        if (v) dtypes.insert(std::get<at::Tensor>(*v).scalar_type());
      }
      TORCH_CHECK(dtypes.size() == 1,
                  "All unflattened parameters comprising a single flattened parameter must have "
                  "positive-dimension tensor state with the same dtype for state ",
                  name, " and unflattened parameter names ", Names(fqns));
      // Zeros for parameters without the state (Adam's moments: zero == no state).
      std::map<std::string, const at::Tensor*> tensors;
      for (size_t i = 0; i < fqns.size(); ++i) {
        if (values[i]) tensors[fqns[i]] = &std::get<at::Tensor>(*values[i]);
      }
      const at::Tensor shard = flat_param::FlatShardOf(handle, tensors, rank, world_size, *dtypes.begin(), prefix);
      flat[name] = shard;
      continue;
    }
    // Scalar state: every original parameter has it, with one value (no value would mean,
    // e.g. for Adam's step, a different bias correction).
    std::set<std::string> texts;
    bool missing = false;
    for (const StateValue* v : values) {
      if (v) texts.insert(ValueText(*v));
      missing = missing || v == nullptr;
    }
    TORCH_CHECK(!missing && texts.size() == 1,
                "All unflattened parameters comprising a single flattened parameter must "
                "have scalar state with the same value and dtype but got values {",
                absl::StrJoin(texts, ", "), missing ? ", None" : "", "} for state ", name,
                " and unflattened parameter names ", Names(fqns));
    flat[name] = *values.front();
  }
  return flat;
}

namespace {

// The optimizer's view of an FSDP1 model: each flat parameter under the list of its original
// FQNs ("[block0.fc1.weight, block0.fc1.bias, ...]", a key no FQN can take), so every error
// about it names the original parameters as PyTorch's do (its _OptimStateKey holds the
// unflat_param_names: torch/distributed/fsdp/_optim_utils.py, v2.15.0), and what each key
// stands for in FQNs.
struct FlatModelParams {
  NamedParams named;
  std::vector<flat_param::FlatParamHandle*> handles;  // handles[i] <-> key named[i].first
  std::vector<std::string> prefixes;
  std::map<std::string, std::vector<std::string>> fqns_of;  // key -> original FQNs
  const std::string& key(size_t i) const { return named[i].first; }
};

FlatModelParams ModelParams(const flat_param::FullyShardedDataParallel& root, const char* caller) {
  torch::nn::Module& module = root.module();
  FlatModelParams out;
  std::set<const c10::TensorImpl*> managed;
  for (flat_param::FSDPState* s : flat_param::CollectStates(module)) {
    flat_param::FlatParamHandle* h = s->handle();
    if (h == nullptr) continue;
    TORCH_CHECK(h->flat_param().params.empty(), caller,
                ": FSDP1 optimizer state needs use_orig_params false "
                "(the optimizer on the flat parameters); with use_orig_params use an optimizer state per original "
                "parameter instead");
    out.handles.push_back(h);
    out.prefixes.push_back(flat_param::HandlePrefix(module, *h));
    std::vector<std::string> fqns;
    for (const auto& fqn : h->flat_param().fqns) fqns.push_back(out.prefixes.back() + fqn);
    const std::string key = Names(fqns);
    out.named.emplace_back(key, h->flat_param().param);
    out.fqns_of[key] = std::move(fqns);
    managed.insert(h->flat_param().param.unsafeGetTensorImpl());
  }
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!managed.insert(item.value().unsafeGetTensorImpl()).second) continue;
    TORCH_CHECK(!out.fqns_of.contains(item.key()), caller, ": parameter '", item.key(),
                "' is named like a flat parameter's key");
    out.named.emplace_back(item.key(), item.value());
  }
  return out;
}

std::vector<std::string> ExpandFqns(const FlatModelParams& m, const std::vector<std::string>& keys) {
  std::vector<std::string> out;
  for (const auto& k : keys) {
    auto it = m.fqns_of.find(k);
    if (it == m.fqns_of.end()) {
      out.push_back(k);
    } else {
      out.insert(out.end(), it->second.begin(), it->second.end());
    }
  }
  return out;
}

// The optimizer's parameters named as the sharded state names them.
NamedParams LocalNames(const FlatModelParams& m) {
  NamedParams out = m.named;
  for (size_t i = 0; i < m.handles.size(); ++i) out[i].first = m.prefixes[i] + "_flat_param";
  return out;
}

}  // namespace

OptimStateDict GetShardedOptimStateDict(const flat_param::FullyShardedDataParallel& root,
                                        const torch::optim::Optimizer& optimizer) {
  return GetOptimStateDict(optimizer, LocalNames(ModelParams(root, "GetShardedOptimStateDict")));
}

void LoadShardedOptimStateDict(const flat_param::FullyShardedDataParallel& root, torch::optim::Optimizer& optimizer,
                               const OptimStateDict& sharded) {
  SetOptimStateDict(optimizer, LocalNames(ModelParams(root, "LoadShardedOptimStateDict")), sharded);
}

OptimStateDict GetFullOptimStateDict(const flat_param::FullyShardedDataParallel& root,
                                     const torch::optim::Optimizer& optimizer, bool rank0_only) {
  const FlatModelParams m = ModelParams(root, "GetFullOptimStateDict");
  const OptimStateDict local = GetOptimStateDict(optimizer, m.named);
  std::vector<std::string> keys;
  for (const auto& [key, t] : m.named) keys.push_back(key);
  CheckStateAgreement(m.handles.empty() ? nullptr : m.handles.front()->process_group(), keys, local,
                      "GetFullOptimStateDict");
  bool keep = true;
  for (const auto* h : m.handles) keep = keep && (!rank0_only || h->process_group()->rank() == 0);
  OptimStateDict out;
  out.optimizer = local.optimizer;
  for (size_t i = 0; i < m.handles.size(); ++i) {
    auto it = local.state.find(m.key(i));
    if (it == local.state.end()) continue;
    const flat_param::FlatParamHandle& h = *m.handles[i];
    auto unflat =
        UnflattenOptimState(h, it->second, h.uses_sharded_strategy() ? h.process_group() : nullptr, m.prefixes[i]);
    if (keep) out.state.merge(unflat);
  }
  if (!keep) return OptimStateDict{};
  for (const auto& [key, values] : local.state) {
    if (!m.fqns_of.count(key)) out.state[key] = values;  // parameters no handle manages
  }
  for (const auto& g : local.param_groups) out.param_groups.push_back({ExpandFqns(m, g.params), g.options});
  return out;
}

void LoadFullOptimStateDict(const flat_param::FullyShardedDataParallel& root, torch::optim::Optimizer& optimizer,
                            const OptimStateDict& full) {
  const FlatModelParams m = ModelParams(root, "LoadFullOptimStateDict");
  // The optimizer's own groups in keys, matched with the checkpoint's by their FQNs (as
  // PyTorch's _rekey_sharded_optim_state_dict maps each loaded group's FQNs to flat
  // parameter keys, torch/distributed/fsdp/_optim_utils.py, v2.15.0): another wrapping
  // orders and groups the flat parameters differently.
  const OptimStateDict current = GetOptimStateDict(optimizer, m.named);
  std::vector<std::vector<std::string>> expanded;
  for (const auto& g : current.param_groups) expanded.push_back(ExpandFqns(m, g.params));
  const std::vector<size_t> match = MatchParamGroups(expanded, full.param_groups, "LoadFullOptimStateDict");
  OptimStateDict local;
  local.optimizer = full.optimizer;
  for (size_t g = 0; g < current.param_groups.size(); ++g) {
    local.param_groups.push_back({current.param_groups[g].params, full.param_groups[match[g]].options});
  }
  std::set<std::string> flattened;
  for (size_t i = 0; i < m.handles.size(); ++i) {
    const flat_param::FlatParamHandle& h = *m.handles[i];
    const bool sharded = h.uses_sharded_strategy();
    StateMap flat =
        FlattenOptimState(h, full.state, sharded ? h.rank() : 0, sharded ? h.world_size() : 1, m.prefixes[i]);
    if (!flat.empty()) local.state[m.key(i)] = std::move(flat);
    for (const auto& fqn : m.fqns_of.at(m.key(i))) flattened.insert(fqn);
  }
  for (const auto& [fqn, values] : full.state) {
    if (!flattened.count(fqn)) local.state[fqn] = values;  // unmanaged, or unknown (reported by Set)
  }
  SetOptimStateDict(optimizer, m.named, local);
}

}  // namespace fsdp::optim_state
