#include "optim_state/fsdp2_optim_state.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "absl/container/flat_hash_map.h"
#include "fsdp/per_param/fsdp_param.h"
#include "fsdp/per_param/state_dict.h"

namespace fsdp::optim_state {
namespace {

using per_param::NamedParameter;

// Every rank holds state for the same parameters: all-reduce MIN and MAX of the per-parameter
// "has state" flags (a rank without state would otherwise skip a gather and hang the rest).
void CheckStateAgreement(const std::vector<NamedParameter>& params, const OptimStateDict& local) {
  comm::ProcessGroupPtr world;
  for (const auto& p : params) {
    if (p.fsdp_param) world = p.fsdp_param->sharding_spec().mesh->world();
  }
  if (!world || world->size() == 1) return;
  at::Tensor has = at::empty({static_cast<int64_t>(params.size())}, at::kInt);
  for (size_t i = 0; i < params.size(); ++i) has[i] = local.state.count(params[i].fqn) ? 1 : 0;
  at::Tensor lo = has.clone(), hi = has.clone();
  world->all_reduce(lo, comm::ReduceOp::Min())->wait();
  world->all_reduce(hi, comm::ReduceOp::Max())->wait();
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(lo[i].item<int>() == hi[i].item<int>(), "GetFullOptimStateDict: some ranks have optimizer state for '",
                params[i].fqn, "' and others do not (this rank: ", has[i].item<int>() ? "has" : "lacks", " it)");
  }
}

}  // namespace

NamedParams NamedOptimizerParams(torch::nn::Module& root) {
  NamedParams out;
  for (const auto& p : per_param::NamedParameters(root)) out.emplace_back(p.fqn, p.param);
  return out;
}

OptimStateDict GetFullOptimStateDict(torch::nn::Module& root, const torch::optim::Optimizer& optimizer,
                                     bool rank0_only) {
  const std::vector<NamedParameter> params = per_param::NamedParameters(root);
  NamedParams named;
  for (const auto& p : params) named.emplace_back(p.fqn, p.param);
  OptimStateDict full = GetOptimStateDict(optimizer, named);
  CheckStateAgreement(params, full);
  bool keep = true;
  for (const auto& p : params) {
    if (p.fsdp_param != nullptr) keep = !rank0_only || p.fsdp_param->sharding_spec().mesh->world()->rank() == 0;
  }
  for (const auto& p : params) {
    auto it = full.state.find(p.fqn);
    if (p.fsdp_param == nullptr || it == full.state.end()) continue;
    for (auto& [name, value] : it->second) {  // std::map: the same order on every rank
      if (Classify(value) != StateKind::kPositiveDimTensor) continue;
      at::Tensor gathered = per_param::GatherLikeParam(*p.fsdp_param, std::get<at::Tensor>(value));
      // Ranks that keep nothing hold one gathered tensor at a time (the local shard stays).
      if (keep) value = std::move(gathered);
    }
  }
  if (!keep) return OptimStateDict{};
  return full;
}

void LoadFullOptimStateDict(torch::nn::Module& root, torch::optim::Optimizer& optimizer, const OptimStateDict& full) {
  const std::vector<NamedParameter> params = per_param::NamedParameters(root);
  NamedParams named;
  absl::flat_hash_map<std::string, per_param::FSDPParam*> fsdp_params;
  for (const auto& p : params) {
    named.emplace_back(p.fqn, p.param);
    fsdp_params.emplace(p.fqn, p.fsdp_param);
  }
  OptimStateDict local = full;
  for (auto& [fqn, values] : local.state) {
    auto it = fsdp_params.find(fqn);
    if (it == fsdp_params.end() || it->second == nullptr) continue;  // SetOptimStateDict reports unknown FQNs
    for (auto& [name, value] : values) {
      if (Classify(value) != StateKind::kPositiveDimTensor) continue;
      const at::Tensor& t = std::get<at::Tensor>(value);
      TORCH_CHECK(t.sizes().vec() == it->second->sharding_spec().shape, "LoadFullOptimStateDict: state '", name,
                  "' of '", fqn, "' has shape ", t.sizes(), " but the parameter's global shape is ",
                  c10::IntArrayRef(it->second->sharding_spec().shape));
      value = per_param::LocalShardOf(*it->second, t).clone();
    }
  }
  SetOptimStateDict(optimizer, named, local);
}

}  // namespace fsdp::optim_state
