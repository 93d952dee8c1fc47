#include "dcp/state_items.h"

#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "fsdp/fsdp1/fsdp_state.h"
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"
#include "fsdp/fsdp1/state_dict.h"
#include "fsdp/fsdp2/fsdp_param.h"
#include "fsdp/fsdp2/state_dict.h"
#include "optim_state/fsdp1_optim_state.h"
#include "optim_state/fsdp2_optim_state.h"

namespace fsdp::dcp::internal {
namespace {}  // namespace

std::string ModelKey(const std::string& fqn) { return kModelPrefix + fqn; }

void CheckExtraState(const std::vector<std::pair<std::string, at::Tensor>>& extra, const char* caller) {
  absl::flat_hash_set<std::string> seen;
  for (const auto& [key, tensor] : extra) {
    TORCH_CHECK(
        !key.empty() && !absl::StartsWith(key, ".") && !absl::EndsWith(key, ".") && !absl::StrContains(key, ".."),
        caller, ": extra_state key '", key, "' is not a dotted name (empty, or an empty part)");
    TORCH_CHECK(
        !absl::StartsWith(key, "model.") && !absl::StartsWith(key, "optim.") && key != "model" && key != "optim",
        caller, ": extra_state key '", key,
        "' would collide with the model's or optimizer's entries (\"model.\", \"optim.\")");
    TORCH_CHECK(seen.insert(key).second, caller, ": extra_state key '", key, "' appears twice");
    TORCH_CHECK(tensor.defined(), caller, ": extra_state '", key, "' is an undefined tensor");
  }
}

std::vector<DcpPathElement> ExtraStatePath(const std::string& key) {
  std::vector<DcpPathElement> path;
  for (absl::string_view part : absl::StrSplit(key, '.')) path.emplace_back(std::string(part));
  return path;
}

void AddExtraState(const std::vector<std::pair<std::string, at::Tensor>>& extra, SaveSources& out, const char* caller) {
  CheckExtraState(extra, caller);
  for (const auto& [key, tensor] : extra) {
    TensorSource s{key, ExtraStatePath(key), nullptr, tensor.detach(), tensor.sizes().vec()};
    out.tensors.push_back(std::move(s));
  }
}
std::string OptimStateKey(const std::string& fqn, const std::string& name) {
  return absl::StrCat(kOptimStatePrefix, fqn, ".", name);
}
std::string ParamGroupKey(size_t group, const std::string& option) {
  return absl::StrCat(kParamGroupsPrefix, group, ".", option);
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

FlatModel CollectFlatPieces(torch::nn::Module& model, comm::ProcessGroupPtr* world, const char* caller) {
  FlatModel out;
  fsdp1::FSDPState* state = fsdp1::GetState(model);
  if (state == nullptr) return out;
  TORCH_CHECK(state->inter_node_group() == nullptr, caller,
              ": FSDP1 hybrid sharding strategies are not supported (no one process group spans the replicas); "
              "use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD, or FSDP2's HSDP");
  const fsdp1::FullyShardedDataParallel root(state);
  for (fsdp1::LocalFlatPiece& p : fsdp1::LocalFlatPieces(root)) {
    out.fqns_of_flat_param[p.flat_param_key].push_back(p.fqn);
    out.by_fqn[p.fqn] =
        FlatPiece{std::move(p.shape), p.flat_start,     p.local.defined() ? p.local.detach() : at::Tensor(),
                  p.offset_in_shard,  p.flat_param_key, p.shard_numel};
  }
  // Tied parameters: the flat parameter lists the first name; the others share its piece.
  absl::flat_hash_map<const c10::TensorImpl*, std::string> first_name;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    auto [it, inserted] = first_name.emplace(item.value().unsafeGetTensorImpl(), item.key());
    if (!inserted && out.by_fqn.count(it->second) && !out.by_fqn.count(item.key())) {
      out.by_fqn[item.key()] = out.by_fqn[it->second];
    }
  }
  *world = state->process_group();
  return out;
}

SaveSources CollectSaveSources(torch::nn::Module& model, const torch::optim::Optimizer* optimizer) {
  SaveSources out;
  const FlatModel flat = CollectFlatPieces(model, &out.world, "dcp");
  const std::vector<fsdp2::NamedParameter> params = fsdp2::NamedParameters(model);  // reshards
  absl::flat_hash_map<const c10::TensorImpl*, const fsdp2::FSDPParam*> by_impl;
  absl::flat_hash_map<std::string, const fsdp2::FSDPParam*> by_fqn;
  for (const auto& p : params) {
    by_fqn.emplace(p.fqn, p.fsdp_param);
    if (p.fsdp_param == nullptr) continue;
    by_impl.emplace(p.param.unsafeGetTensorImpl(), p.fsdp_param);
    if (out.world == nullptr) out.world = p.fsdp_param->sharding_spec().mesh->world();
  }
  const auto add_tensor = [&](std::string key, std::vector<DcpPathElement> path, const fsdp2::FSDPParam* fsdp,
                              const at::Tensor& local) {
    TensorSource s{std::move(key), std::move(path), fsdp, local.detach(), {}};
    s.global_size = fsdp ? fsdp->sharding_spec().shape : local.sizes().vec();
    out.tensors.push_back(std::move(s));
  };
  // Model: named_parameters then named_buffers (tied parameters under each name, as
  // state_dict()).
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (!item.value().defined()) continue;
    if (auto piece = flat.by_fqn.find(item.key()); piece != flat.by_fqn.end()) {  // FSDP1: this rank's piece
      if (!piece->second.local.defined()) continue;
      TensorSource s{ModelKey(item.key()),
                     {std::string("model"), item.key()},
                     nullptr,
                     piece->second.local,
                     piece->second.shape,
                     piece->second.flat_start};
      out.tensors.push_back(std::move(s));
      continue;
    }
    auto it = by_impl.find(item.value().unsafeGetTensorImpl());
    const fsdp2::FSDPParam* fsdp = it == by_impl.end() ? nullptr : it->second;
    add_tensor(ModelKey(item.key()), {std::string("model"), item.key()}, fsdp,
               fsdp ? fsdp->ShardedDTensor().to_local() : item.value());
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    if (item.value().defined())
      add_tensor(ModelKey(item.key()), {std::string("model"), item.key()}, nullptr, item.value());
  }
  if (optimizer == nullptr) return out;

  const optim_state::OptimStateDict sd =
      flat.empty()
          ? optim_state::GetShardedOptimStateDict(model, *optimizer)
          : FlatOptimToPieces(optim_state::GetShardedOptimStateDict(
                                  fsdp1::FullyShardedDataParallel(fsdp1::GetState(model)), *optimizer),
                              flat);
  for (const auto& [fqn, state] : sd.state) {
    auto it = by_fqn.find(fqn);
    TORCH_CHECK(it != by_fqn.end(), "dcp: the optimizer holds state for '", fqn, "', which is not a parameter");
    const fsdp2::FSDPParam* fsdp = it->second;
    for (const auto& [name, value] : state) {
      const std::string key = OptimStateKey(fqn, name);
      std::vector<DcpPathElement> path = {std::string("optim"), std::string("state"), fqn, name};
      if (const at::Tensor* t = std::get_if<at::Tensor>(&value)) {
        if (auto piece = flat.by_fqn.find(fqn); piece != flat.by_fqn.end() && t->dim() > 0) {  // FSDP1
          if (t->numel() == 0) continue;  // this rank holds none of it
          out.tensors.push_back(
              {key, std::move(path), nullptr, t->detach(), piece->second.shape, piece->second.flat_start});
          continue;
        }
        const bool sharded = fsdp != nullptr && t->dim() > 0;
        if (sharded) {
          TORCH_CHECK(t->sizes().vec() == fsdp->sharded_size(), "dcp: optimizer state '", name, "' of '", fqn,
                      "' has shape ", c10::str(c10::IntArrayRef(t->sizes())), " but the parameter's shard has shape ",
                      c10::str(c10::IntArrayRef(fsdp->sharded_size())));
        }
        add_tensor(key, std::move(path), sharded ? fsdp : nullptr, *t);
      } else if (const int64_t* i = std::get_if<int64_t>(&value)) {
        // LibTorch keeps `step` as an int; PyTorch as a 0-d float32 tensor (torch/optim/adam.py
        // _init_group: torch.tensor(0.0, dtype=_get_scalar_dtype())).
        if (name == "step") {
          add_tensor(key, std::move(path), nullptr, at::scalar_tensor(static_cast<double>(*i), at::kFloat));
        } else {
          out.bytes.push_back({key, std::move(path), c10::IValue(*i)});
        }
      } else {
        out.bytes.push_back({key, std::move(path), c10::IValue(std::get<double>(value))});
      }
    }
  }
  const optim_state::OptionMap extra = PythonOnlyOptions(sd.optimizer);
  for (size_t g = 0; g < sd.param_groups.size(); ++g) {
    const optim_state::ParamGroupState& group = sd.param_groups[g];
    optim_state::OptionMap options = group.options;
    for (const auto& [name, value] : extra) options.emplace(name, value);
    for (const auto& [name, value] : options) {
      TORCH_CHECK(name != "params", "dcp: param group ", g, " has an option named 'params'");
      out.bytes.push_back({ParamGroupKey(g, name),
                           {std::string("optim"), std::string("param_groups"), static_cast<int64_t>(g), name},
                           value});
    }
    c10::List<std::string> fqns;
    for (const std::string& fqn : group.params) fqns.push_back(fqn);
    out.bytes.push_back(
        {ParamGroupKey(g, "params"),
         {std::string("optim"), std::string("param_groups"), static_cast<int64_t>(g), std::string("params")},
         c10::IValue(fqns)});
  }
  return out;
}

}  // namespace fsdp::dcp::internal
