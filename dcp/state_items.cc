#include "dcp/state_items.h"

#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <variant>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dcp/adapter.h"

namespace fsdp::dcp::internal {
namespace {

std::vector<DcpPathElement> ModelPath(const std::string& fqn) { return {std::string("model"), fqn}; }

TensorSource WholeSource(std::string key, std::vector<DcpPathElement> path, const at::Tensor& t) {
  return {std::move(key), std::move(path), t.detach(), t.sizes().vec(), {WholeBox(t.sizes().vec())}, nullptr};
}

TensorSource ShardedSource(std::string key, std::vector<DcpPathElement> path, const at::Tensor& local,
                           const ShardedParam& p) {
  return {std::move(key), std::move(path), local.detach(), p.global_size(), p.boxes(), &p};
}

}  // namespace

std::string ModelKey(const std::string& fqn) { return kModelPrefix + fqn; }
std::string OptimStateKey(const std::string& fqn, const std::string& name) {
  return absl::StrCat(kOptimStatePrefix, fqn, ".", name);
}
std::string ParamGroupKey(size_t group, const std::string& option) {
  return absl::StrCat(kParamGroupsPrefix, group, ".", option);
}

namespace {

// The object-path element and key part of a dict key: Python's str(k).
std::string KeyPart(const c10::IValue& key, const std::string& where, const char* caller) {
  if (key.isString()) return key.toStringRef();
  TORCH_CHECK(key.isInt(), caller, ": ", where, " has a dict key of type ", key.tagKind(),
              "; a checkpointed state dict's keys are str or int");
  return std::to_string(key.toInt());
}

// Whether the leaf is one torch.save can write and torch.load reads back (no tensors: those
// are leaves of their own, or inside a tuple, which DCP does not enter: refused too).
bool IsStorableValue(const c10::IValue& v) {
  if (v.isNone() || v.isBool() || v.isInt() || v.isDouble() || v.isString()) return true;
  if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) {
      if (!IsStorableValue(e)) return false;
    }
    return true;
  }
  if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (!IsStorableValue(e)) return false;
    }
    return true;
  }
  if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict()) {
      if (!(e.key().isString() || e.key().isInt()) || !IsStorableValue(e.value())) return false;
    }
    return true;
  }
  return false;
}

// torch/distributed/checkpoint/_traverse.py's _is_terminal: a dict never is; a list is unless it
// holds a tensor or a container that is not terminal; anything else is.
bool IsTerminal(const c10::IValue& v) {
  if (v.isGenericDict()) return false;
  if (!v.isList()) return true;
  for (const c10::IValue& e : v.toListRef()) {
    if ((e.isGenericDict() || e.isList()) && !IsTerminal(e)) return false;
    if (e.isTensor()) return false;
  }
  return true;
}

void Traverse(std::vector<DcpPathElement> path, const c10::IValue& value, std::function<void(c10::IValue)> set,
              std::vector<StateLeaf>& out, const char* caller) {
  auto where = [&] {
    std::vector<std::string> parts;
    for (const DcpPathElement& e : path) {
      parts.push_back(std::holds_alternative<std::string>(e) ? std::get<std::string>(e)
                                                             : std::to_string(std::get<int64_t>(e)));
    }
    return absl::StrJoin(parts, ".");
  };
  if (value.isGenericDict()) {
    c10::impl::GenericDict dict = value.toGenericDict();
    for (const auto& e : dict) {
      std::vector<DcpPathElement> child = path;
      child.emplace_back(KeyPart(e.key(), "stateful '" + where() + "'", caller));
      Traverse(
          std::move(child), e.value(),
          [dict, key = e.key()](c10::IValue v) mutable { dict.insert_or_assign(key, std::move(v)); }, out, caller);
    }
  } else if (IsTerminal(value)) {
    const std::string key = where();
    if (value.isTensor()) {
      TORCH_CHECK(value.toTensor().defined(), caller, ": stateful '", key, "' is an undefined tensor");
    } else {
      TORCH_CHECK(IsStorableValue(value), caller, ": stateful '", key, "' is a ", value.tagKind(),
                  " (or holds one), which a checkpoint cannot store: tensors, None, bool, int, float, str, and "
                  "tuples, lists and dicts of those");
    }
    out.push_back({key, std::move(path), value, std::move(set)});
  } else {
    c10::List<c10::IValue> list = value.toList();
    for (size_t i = 0; i < list.size(); ++i) {
      std::vector<DcpPathElement> child = path;
      child.emplace_back(static_cast<int64_t>(i));
      Traverse(
          std::move(child), list.get(i), [list, i](c10::IValue v) mutable { list.set(i, std::move(v)); }, out, caller);
    }
  }
}

}  // namespace

std::vector<StateLeaf> FlattenStateful(const StatefulItems& items, std::vector<StateDict>& state_dicts,
                                       const char* caller) {
  absl::flat_hash_set<std::string> seen;
  std::vector<StateLeaf> leaves;
  state_dicts.clear();
  state_dicts.reserve(items.size());
  for (const auto& [name, object] : items) {
    TORCH_CHECK(!name.empty() && !absl::StrContains(name, "."), caller, ": stateful name '", name,
                "' is empty or contains '.'");
    TORCH_CHECK(name != "model" && name != "optim", caller, ": stateful name '", name,
                "' would collide with the model's or optimizer's entries");
    TORCH_CHECK(seen.insert(name).second, caller, ": stateful name '", name, "' appears twice");
    TORCH_CHECK(object != nullptr, caller, ": stateful '", name, "' is null");
    state_dicts.push_back(object->state_dict());
    StateDict* sd = &state_dicts.back();  // reserved: stays put
    for (const auto& [key, value] : *sd) {
      Traverse(
          {name, key}, value, [sd, key = key](c10::IValue v) { sd->insert_or_assign(key, std::move(v)); }, leaves,
          caller);
    }
  }
  return leaves;
}

void AddStateful(const StatefulItems& items, SaveSources& out, const char* caller) {
  std::vector<StateDict> state_dicts;
  for (StateLeaf& leaf : FlattenStateful(items, state_dicts, caller)) {
    if (leaf.value.isTensor()) {
      out.tensors.push_back(WholeSource(leaf.key, std::move(leaf.object_path), leaf.value.toTensor()));
    } else {
      out.bytes.push_back({leaf.key, std::move(leaf.object_path), std::move(leaf.value)});
    }
  }
}

optim_state::OptionMap PythonOnlyOptions(const std::string& optimizer) {
  const c10::IValue none, no(false), yes(true);
  if (optimizer == "Adam" || optimizer == "AdamW") {
    return {{"maximize", no},       {"foreach", none}, {"capturable", no},
            {"differentiable", no}, {"fused", none},   {"decoupled_weight_decay", c10::IValue(optimizer == "AdamW")}};
  }
  if (optimizer == "SGD" || optimizer == "Adagrad") {
    return {{"maximize", no}, {"foreach", none}, {"differentiable", no}, {"fused", none}};
  }
  if (optimizer == "RMSprop") {
    return {{"capturable", no}, {"foreach", none}, {"maximize", no}, {"differentiable", no}};
  }
  return {};
}

namespace {

using StoredFqn = std::function<std::string(const std::string&)>;

// The model's entries under their stored names: this rank's part of each sharded parameter,
// every other tensor whole.
void AddModel(torch::nn::Module& model, const ModelAdapter& adapter, const StoredFqn& stored_fqn, SaveSources& out) {
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (!item.value().defined()) continue;
    const std::string fqn = stored_fqn(item.key());
    if (const ShardedParam* p = adapter.Sharded(item.key())) {
      if (p->local().defined()) out.tensors.push_back(ShardedSource(ModelKey(fqn), ModelPath(fqn), p->local(), *p));
      continue;
    }
    out.tensors.push_back(WholeSource(ModelKey(fqn), ModelPath(fqn), item.value()));
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    const std::string fqn = stored_fqn(item.key());
    if (item.value().defined()) out.tensors.push_back(WholeSource(ModelKey(fqn), ModelPath(fqn), item.value()));
  }
}

// One optimizer state value of parameter `fqn` (sharded: its layout, else null).
void AddStateValue(const std::string& fqn, const std::string& name, const optim_state::StateValue& value,
                   const ShardedParam* sharded, SaveSources& out) {
  const std::string key = OptimStateKey(fqn, name);
  std::vector<DcpPathElement> path = {std::string("optim"), std::string("state"), fqn, name};
  if (const at::Tensor* t = std::get_if<at::Tensor>(&value)) {
    if (sharded == nullptr || t->dim() == 0) {
      out.tensors.push_back(WholeSource(key, std::move(path), *t));
      return;
    }
    TORCH_CHECK(t->sizes().vec() == sharded->local_size(), "dcp: optimizer state '", name, "' of '", fqn,
                "' has shape ", c10::str(c10::IntArrayRef(t->sizes())), " but the parameter's shard has shape ",
                c10::str(c10::IntArrayRef(sharded->local_size())));
    // Even without boxes on this rank: a full save gathers it on every rank.
    out.tensors.push_back(ShardedSource(key, std::move(path), *t, *sharded));
  } else if (const int64_t* i = std::get_if<int64_t>(&value)) {
    // LibTorch keeps `step` as an int; PyTorch as a 0-d float32 tensor (torch/optim/adam.py
    // _init_group: torch.tensor(0.0, dtype=_get_scalar_dtype())).
    if (name == "step") {
      out.tensors.push_back(WholeSource(key, std::move(path), at::scalar_tensor(static_cast<double>(*i), at::kFloat)));
    } else {
      out.bytes.push_back({key, std::move(path), c10::IValue(*i)});
    }
  } else {
    out.bytes.push_back({key, std::move(path), c10::IValue(std::get<double>(value))});
  }
}

// "optim.param_groups.<i>.<option>" for every option (PyTorch's too) and the FQN list; or,
// flattened (torch/distributed/checkpoint/state_dict.py _flatten_optim_state_dict),
// "optim.param_groups.<fqn>.<option>" for every parameter of the group.
void AddParamGroups(const optim_state::OptimStateDict& sd, bool flatten, SaveSources& out) {
  const optim_state::OptionMap extra = PythonOnlyOptions(sd.optimizer);
  for (size_t g = 0; g < sd.param_groups.size(); ++g) {
    const optim_state::ParamGroupState& group = sd.param_groups[g];
    optim_state::OptionMap options = group.options;
    for (const auto& [name, value] : extra) options.emplace(name, value);
    for (const auto& [name, value] : options) {
      TORCH_CHECK(name != "params", "dcp: param group ", g, " has an option named 'params'");
    }
    if (flatten) {
      for (const std::string& fqn : group.params) {
        for (const auto& [name, value] : options) {
          out.bytes.push_back({absl::StrCat(kParamGroupsPrefix, fqn, ".", name),
                               {std::string("optim"), std::string("param_groups"), fqn, name},
                               value});
        }
      }
      continue;
    }
    const auto path = [g](const std::string& option) -> std::vector<DcpPathElement> {
      return {std::string("optim"), std::string("param_groups"), static_cast<int64_t>(g), option};
    };
    for (const auto& [name, value] : options) out.bytes.push_back({ParamGroupKey(g, name), path(name), value});
    c10::List<std::string> fqns;
    for (const std::string& fqn : group.params) fqns.push_back(fqn);
    out.bytes.push_back({ParamGroupKey(g, "params"), path("params"), c10::IValue(fqns)});
  }
}

}  // namespace

SaveSources CollectSaveSources(torch::nn::Module& model, const ModelAdapter& adapter,
                               const torch::optim::Optimizer* optimizer, bool flatten_param_groups,
                               const StoredFqn& stored_fqn) {
  SaveSources out;
  const StoredFqn name_of = stored_fqn ? stored_fqn : [](const std::string& fqn) { return fqn; };
  if (stored_fqn) {
    absl::flat_hash_map<std::string, std::string> fqn_of;
    const auto check = [&](const std::string& fqn) {
      const auto [it, inserted] = fqn_of.emplace(stored_fqn(fqn), fqn);
      TORCH_CHECK(inserted || it->second == fqn, "dcp: SaveOptions::stored_fqn gives both '", it->second, "' and '",
                  fqn, "' the name '", it->first, "'");
    };
    for (const auto& item : model.named_parameters(/*recurse=*/true)) check(item.key());
    for (const auto& item : model.named_buffers(/*recurse=*/true)) check(item.key());
  }
  AddModel(model, adapter, name_of, out);
  if (optimizer == nullptr) return out;
  optim_state::OptimStateDict sd = adapter.GetOptimState(model, *optimizer);
  absl::flat_hash_set<std::string> params;
  for (const auto& [fqn, param] : UniqueParameters(model)) params.insert(fqn);
  for (const auto& [fqn, state] : sd.state) {
    TORCH_CHECK(params.contains(fqn), "dcp: the optimizer holds state for '", fqn, "', which is not a parameter");
    for (const auto& [name, value] : state) AddStateValue(name_of(fqn), name, value, adapter.Sharded(fqn), out);
  }
  for (optim_state::ParamGroupState& group : sd.param_groups) {
    for (std::string& fqn : group.params) fqn = name_of(fqn);
  }
  AddParamGroups(sd, flatten_param_groups, out);
  return out;
}

}  // namespace fsdp::dcp::internal
