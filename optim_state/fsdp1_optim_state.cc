#include "optim_state/fsdp1_optim_state.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/object_collectives.h"
#include "fsdp/fsdp1/flat_param.h"
#include "fsdp/fsdp1/flat_shard_conversion.h"
#include "fsdp/fsdp1/fsdp_state.h"
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"

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

std::map<std::string, StateMap> UnflattenOptimState(const fsdp1::FlatParamHandle& handle, const StateMap& flat_state,
                                                    const comm::ProcessGroupPtr& shard_group,
                                                    const std::string& prefix) {
  const fsdp1::FlatParameter& fp = handle.flat_param();
  std::map<std::string, StateMap> out;
  for (const auto& [name, value] : flat_state) {
    if (Classify(value) != StateKind::kPositiveDimTensor) {
      for (const auto& fqn : fp.fqns) out[prefix + fqn][name] = value;
      continue;
    }
    for (auto& [fqn, t] : fsdp1::UnflattenShard(handle, std::get<at::Tensor>(value), shard_group, prefix)) {
      out[fqn][name] = std::move(t);
    }
  }
  return out;
}

StateMap FlattenOptimState(const fsdp1::FlatParamHandle& handle, const std::map<std::string, StateMap>& full,
                           int64_t rank, int64_t world_size, const std::string& prefix) {
  const fsdp1::FlatParameter& fp = handle.flat_param();
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
      const at::Tensor shard = fsdp1::FlatShardOf(handle, tensors, rank, world_size, *dtypes.begin(), prefix);
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
// stands for in FQNs. Handles with use_orig_params put their original parameters in the
// optimizer instead, under their FQNs; those of sharded strategies hold this rank's 1-D part
// (PyTorch's sharded views), listed in orig_handles.
struct FlatModelParams {
  NamedParams named;  // flat parameters first (named[i] <-> handles[i]), then the others
  std::vector<fsdp1::FlatParamHandle*> handles;
  std::vector<std::string> prefixes;
  std::map<std::string, std::vector<std::string>> fqns_of;  // key -> original FQNs
  std::vector<fsdp1::FlatParamHandle*> orig_handles;        // use_orig_params, sharded
  std::vector<std::string> orig_prefixes;
  std::set<std::string> orig_fqns;  // the original FQNs of orig_handles
  const std::string& key(size_t i) const { return named[i].first; }
};

FlatModelParams ModelParams(const fsdp1::FullyShardedDataParallel& root, const char* caller) {
  torch::nn::Module& module = root.module();
  FlatModelParams out;
  std::set<const c10::TensorImpl*> managed;
  std::vector<fsdp1::FlatParamHandle*> orig_handles;
  for (fsdp1::FSDPState* s : fsdp1::CollectStates(module)) {
    fsdp1::FlatParamHandle* h = s->handle();
    if (h == nullptr) continue;
    if (h->use_orig_params()) {
      orig_handles.push_back(h);
      continue;
    }
    out.handles.push_back(h);
    out.prefixes.push_back(fsdp1::HandlePrefix(module, *h));
    std::vector<std::string> fqns;
    for (const auto& fqn : h->flat_param().fqns) fqns.push_back(out.prefixes.back() + fqn);
    const std::string key = Names(fqns);
    out.named.emplace_back(key, h->flat_param().param);
    out.fqns_of[key] = std::move(fqns);
    managed.insert(h->flat_param().param.unsafeGetTensorImpl());
  }
  // use_orig_params: the optimizer holds the original tensors (tied ones once, under the
  // flat parameter's name for them, its first registration).
  for (fsdp1::FlatParamHandle* h : orig_handles) {
    const std::string prefix = fsdp1::HandlePrefix(module, *h);
    const fsdp1::FlatParameter& fp = h->flat_param();
    for (int64_t i = 0; i < fp.num_params; ++i) {
      out.named.emplace_back(prefix + fp.fqns[i], h->orig_params()[i]);
      managed.insert(h->orig_params()[i].unsafeGetTensorImpl());
      if (h->uses_sharded_strategy()) out.orig_fqns.insert(prefix + fp.fqns[i]);
    }
    if (h->uses_sharded_strategy()) {  // NO_SHARD: full originals, state as is
      out.orig_handles.push_back(h);
      out.orig_prefixes.push_back(prefix);
    }
  }
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (!managed.insert(item.value().unsafeGetTensorImpl()).second) continue;
    TORCH_CHECK(!out.fqns_of.contains(item.key()), caller, ": parameter '", item.key(),
                "' is named like a flat parameter's key");
    out.named.emplace_back(item.key(), item.value());
  }
  return out;
}

// Every rank's `meta` (small: schemas and scalars) over `group`, in rank order: serialized
// (checkpoint/optim_state_file.h), sizes all-gathered, then the zero-padded bytes. PyTorch
// all-gathers Python objects here (all_gather_object in _allgather_orig_param_states).
std::vector<OptimStateDict> AllGatherDicts(const OptimStateDict& meta, const comm::ProcessGroupPtr& group) {
  const std::vector<std::vector<char>> all = comm::AllGatherBytes(group, SerializeOptimStateDict(meta));
  std::vector<OptimStateDict> out;
  for (size_t r = 0; r < all.size(); ++r) {
    out.push_back(DeserializeOptimStateDict(all[r], absl::StrCat("rank ", r, "'s optimizer state schema")));
  }
  return out;
}

// use_orig_params (sharded strategy): the optimizer holds, per original parameter this rank's
// shard touches, state for its 1-D part (none for the others). PyTorch's
// _allgather_orig_param_states (torch/distributed/fsdp/_optim_utils.py, v2.15.0): every rank
// learns which parameter has which state (names, dtypes, scalar values), then each
// positive-dim state is laid out like the flat parameter's shard (zeros where this rank holds
// none of it), all-gathered and cut into the original parameters. Collective over the
// handle's shard group; every rank returns the full state of every parameter with state.
std::map<std::string, StateMap> GatherOrigParamState(const fsdp1::FlatParamHandle& h,
                                                     const std::map<std::string, StateMap>& local,
                                                     const std::string& prefix) {
  const fsdp1::FlatParameter& fp = h.flat_param();
  OptimStateDict meta;  // positive-dim tensors as 1-element tensors of their dtype
  for (int64_t i = 0; i < fp.num_params; ++i) {
    const std::string fqn = prefix + fp.fqns[i];
    auto it = local.find(fqn);
    if (it == local.end()) continue;
    const fsdp1::ShardParamInfo& info = fp.shard_param_infos[i];
    for (const auto& [name, value] : it->second) {
      if (Classify(value) != StateKind::kPositiveDimTensor) {
        meta.state[fqn][name] = value;
        continue;
      }
      const at::Tensor& t = std::get<at::Tensor>(value);
      TORCH_CHECK(info.in_shard && t.numel() == info.numel_in_shard, "GetFullOptimStateDict: optimizer state '", name,
                  "' of '", fqn, "' has ", t.numel(), " elements but this rank's shard holds ",
                  info.in_shard ? info.numel_in_shard : 0, " of the parameter (use_orig_params)");
      meta.state[fqn][name] = at::zeros({1}, t.options().device(c10::kCPU));
    }
  }
  const std::vector<OptimStateDict> metas = AllGatherDicts(meta, h.process_group());
  std::map<std::string, StateMap> out;           // scalars from the lowest rank holding them
  std::map<std::string, c10::ScalarType> dtype;  // positive-dim state name -> dtype
  for (const OptimStateDict& m : metas) {
    for (const auto& [fqn, values] : m.state) {
      for (const auto& [name, value] : values) {
        if (Classify(value) == StateKind::kPositiveDimTensor) {
          const c10::ScalarType d = std::get<at::Tensor>(value).scalar_type();
          auto [it, inserted] = dtype.emplace(name, d);
          TORCH_CHECK(inserted || it->second == d,
                      "All unflattened parameters comprising a single flattened parameter must have "
                      "positive-dimension tensor state with the same dtype for state ",
                      name, " and unflattened parameter names ", Names(fp.fqns));
          out[fqn].emplace(name, at::Tensor());  // filled below
        } else {
          out[fqn].emplace(name, value);
        }
      }
    }
  }
  for (const auto& [name, d] : dtype) {  // the same names in the same order on every rank
    at::Tensor shard = at::zeros({fp.local_shard.numel()}, at::TensorOptions(d));
    for (int64_t i = 0; i < fp.num_params; ++i) {
      auto it = local.find(prefix + fp.fqns[i]);
      if (it == local.end() || !it->second.count(name)) continue;
      const fsdp1::ShardParamInfo& info = fp.shard_param_infos[i];
      shard.narrow(0, info.offset_in_shard, info.numel_in_shard)
          .copy_(std::get<at::Tensor>(it->second.at(name)).reshape(-1));
    }
    for (auto& [fqn, t] : fsdp1::UnflattenShard(h, shard, h.process_group(), prefix)) {
      auto it = out.find(fqn);
      if (it != out.end() && it->second.count(name)) it->second[name] = std::move(t);
    }
  }
  return out;
}

// The inverse for this rank: each original parameter's part of its full state (PyTorch's
// _shard_orig_param_state: positive-dim state flattened and cut to the shard's range, other
// state as is; parameters outside the shard get none). Local.
void ShardOrigParamState(const fsdp1::FlatParamHandle& h, const std::map<std::string, StateMap>& full,
                         const std::string& prefix, std::map<std::string, StateMap>& out) {
  const fsdp1::FlatParameter& fp = h.flat_param();
  for (int64_t i = 0; i < fp.num_params; ++i) {
    const std::string fqn = prefix + fp.fqns[i];
    auto it = full.find(fqn);
    const fsdp1::ShardParamInfo& info = fp.shard_param_infos[i];
    if (it == full.end() || !info.in_shard) continue;
    StateMap& mine = out[fqn];
    for (const auto& [name, value] : it->second) {
      if (Classify(value) != StateKind::kPositiveDimTensor) {
        mine[name] = value;
        continue;
      }
      const at::Tensor& t = std::get<at::Tensor>(value);
      TORCH_CHECK(t.sizes().vec() == fp.shapes[i],
                  "Tensor optimizer state does not have same shape as its parameter: [", absl::StrJoin(t.sizes(), ", "),
                  "] [", absl::StrJoin(fp.shapes[i], ", "), "] (", fqn, ")");
      mine[name] = t.reshape(-1)
                       .narrow(0, info.intra_param_start_idx, info.intra_param_end_idx - info.intra_param_start_idx + 1)
                       .clone();
    }
  }
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

OptimStateDict GetShardedOptimStateDict(const fsdp1::FullyShardedDataParallel& root,
                                        const torch::optim::Optimizer& optimizer) {
  return GetOptimStateDict(optimizer, LocalNames(ModelParams(root, "GetShardedOptimStateDict")));
}

void LoadShardedOptimStateDict(const fsdp1::FullyShardedDataParallel& root, torch::optim::Optimizer& optimizer,
                               const OptimStateDict& sharded) {
  SetOptimStateDict(optimizer, LocalNames(ModelParams(root, "LoadShardedOptimStateDict")), sharded);
}

OptimStateDict GetFullOptimStateDict(const fsdp1::FullyShardedDataParallel& root,
                                     const torch::optim::Optimizer& optimizer, bool rank0_only) {
  const FlatModelParams m = ModelParams(root, "GetFullOptimStateDict");
  const OptimStateDict local = GetOptimStateDict(optimizer, m.named);
  std::vector<std::string> keys;  // state every rank holds alike (not the originals' parts)
  for (const auto& [key, t] : m.named) {
    if (!m.orig_fqns.count(key)) keys.push_back(key);
  }
  comm::ProcessGroupPtr group = m.handles.empty() ? nullptr : m.handles.front()->process_group();
  if (!group && !m.orig_handles.empty()) group = m.orig_handles.front()->process_group();
  CheckStateAgreement(group, keys, local, "GetFullOptimStateDict");
  bool keep = true;
  for (const auto* h : m.handles) keep = keep && (!rank0_only || h->process_group()->rank() == 0);
  for (const auto* h : m.orig_handles) keep = keep && (!rank0_only || h->process_group()->rank() == 0);
  OptimStateDict out;
  out.optimizer = local.optimizer;
  for (size_t i = 0; i < m.handles.size(); ++i) {
    auto it = local.state.find(m.key(i));
    if (it == local.state.end()) continue;
    const fsdp1::FlatParamHandle& h = *m.handles[i];
    auto unflat =
        UnflattenOptimState(h, it->second, h.uses_sharded_strategy() ? h.process_group() : nullptr, m.prefixes[i]);
    if (keep) out.state.merge(unflat);
  }
  for (size_t i = 0; i < m.orig_handles.size(); ++i) {
    auto full = GatherOrigParamState(*m.orig_handles[i], local.state, m.orig_prefixes[i]);
    if (keep) out.state.merge(full);
  }
  if (!keep) return OptimStateDict{};
  for (const auto& [key, values] : local.state) {
    // Parameters no handle manages, and NO_SHARD originals (full on every rank).
    if (!m.fqns_of.count(key) && !m.orig_fqns.count(key)) out.state[key] = values;
  }
  for (const auto& g : local.param_groups) out.param_groups.push_back({ExpandFqns(m, g.params), g.options});
  return out;
}

void LoadFullOptimStateDict(const fsdp1::FullyShardedDataParallel& root, torch::optim::Optimizer& optimizer,
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
    const fsdp1::FlatParamHandle& h = *m.handles[i];
    const bool sharded = h.uses_sharded_strategy();
    StateMap flat =
        FlattenOptimState(h, full.state, sharded ? h.rank() : 0, sharded ? h.world_size() : 1, m.prefixes[i]);
    if (!flat.empty()) local.state[m.key(i)] = std::move(flat);
    for (const auto& fqn : m.fqns_of.at(m.key(i))) flattened.insert(fqn);
  }
  for (size_t i = 0; i < m.orig_handles.size(); ++i) {
    ShardOrigParamState(*m.orig_handles[i], full.state, m.orig_prefixes[i], local.state);
  }
  flattened.insert(m.orig_fqns.begin(), m.orig_fqns.end());
  for (const auto& [fqn, values] : full.state) {
    if (!flattened.count(fqn)) local.state[fqn] = values;  // unmanaged, or unknown (reported by Set)
  }
  SetOptimStateDict(optimizer, m.named, local);
}

}  // namespace fsdp::optim_state
