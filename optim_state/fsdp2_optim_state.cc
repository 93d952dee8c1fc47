#include "optim_state/fsdp2_optim_state.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "absl/container/flat_hash_map.h"
#include "distributed_parameters/distributed_parameters.h"
#include "dtensor/dtensor.h"
#include "fsdp/fsdp2/fsdp_param.h"
#include "fsdp/fsdp2/state_dict.h"

namespace fsdp::optim_state {
namespace {

using fsdp2::NamedParameter;

NamedParams Named(const std::vector<NamedParameter>& params) {
  NamedParams out;
  for (const auto& p : params) out.emplace_back(p.fqn, p.param);
  return out;
}

// The DTensor layouts of the tensor-parallel parameters no fully_shard manages, by FQN.
absl::flat_hash_map<std::string, dtensor::DTensorSpec> TensorParallelOnly(torch::nn::Module& root,
                                                                          const std::vector<NamedParameter>& params) {
  const auto specs = distributed_parameters::DistributedParameterSpecs(root);
  absl::flat_hash_map<std::string, dtensor::DTensorSpec> out;
  for (const auto& p : params) {
    if (p.fsdp_param != nullptr) continue;
    if (auto it = specs.find(p.param.unsafeGetTensorImpl()); it != specs.end()) out.emplace(p.fqn, it->second);
  }
  return out;
}

}  // namespace

NamedParams NamedOptimizerParams(torch::nn::Module& root) { return Named(fsdp2::NamedParameters(root)); }

OptimStateDict GetFullOptimStateDict(torch::nn::Module& root, const torch::optim::Optimizer& optimizer,
                                     bool rank0_only) {
  const std::vector<NamedParameter> params = fsdp2::NamedParameters(root);
  const auto tp_only = TensorParallelOnly(root, params);
  OptimStateDict full = GetOptimStateDict(optimizer, Named(params));
  comm::ProcessGroupPtr world;
  std::vector<std::string> fqns;
  for (const auto& p : params) {
    fqns.push_back(p.fqn);
    if (p.fsdp_param) world = p.fsdp_param->sharding_spec().mesh->world();
  }
  if (world == nullptr && !tp_only.empty()) world = tp_only.begin()->second.mesh->world();
  CheckStateAgreement(world, fqns, full, "GetFullOptimStateDict");
  const bool keep = !rank0_only || world == nullptr || world->rank() == 0;
  for (const auto& p : params) {
    auto it = full.state.find(p.fqn);
    const auto tp = tp_only.find(p.fqn);
    if ((p.fsdp_param == nullptr && tp == tp_only.end()) || it == full.state.end()) continue;
    for (auto& [name, value] : it->second) {  // std::map: the same order on every rank
      if (Classify(value) != StateKind::kPositiveDimTensor) continue;
      const at::Tensor& local = std::get<at::Tensor>(value);
      at::Tensor gathered;
      if (p.fsdp_param != nullptr) {
        gathered = fsdp2::GatherLikeParam(*p.fsdp_param, local);
      } else {  // a tensor-parallel parameter: its state is laid out as it is
        at::NoGradGuard no_grad;
        gathered = dtensor::DTensor::FromSpec(local, tp->second).full_tensor();
      }
      // Ranks that keep nothing hold one gathered tensor at a time (the local shard stays).
      if (keep) value = std::move(gathered);
    }
  }
  if (!keep) return OptimStateDict{};
  return full;
}

OptimStateDict GetShardedOptimStateDict(torch::nn::Module& root, const torch::optim::Optimizer& optimizer) {
  return GetOptimStateDict(optimizer, NamedOptimizerParams(root));
}

void LoadShardedOptimStateDict(torch::nn::Module& root, torch::optim::Optimizer& optimizer,
                               const OptimStateDict& sharded, StateTensors tensors) {
  SetOptimStateDict(optimizer, NamedOptimizerParams(root), sharded, tensors);
}

void CheckShardedOptimStateDict(torch::nn::Module& root, torch::optim::Optimizer& optimizer,
                                const OptimStateDict& sharded) {
  CheckOptimStateDict(optimizer, NamedOptimizerParams(root), sharded);
}

void LoadFullOptimStateDict(torch::nn::Module& root, torch::optim::Optimizer& optimizer, const OptimStateDict& full) {
  const std::vector<NamedParameter> params = fsdp2::NamedParameters(root);
  const auto tp_only = TensorParallelOnly(root, params);
  absl::flat_hash_map<std::string, fsdp2::FSDPParam*> fsdp_params;
  for (const auto& p : params) fsdp_params.emplace(p.fqn, p.fsdp_param);
  OptimStateDict local = full;
  for (auto& [fqn, values] : local.state) {
    if (const auto tp = tp_only.find(fqn); tp != tp_only.end()) {
      for (auto& [name, value] : values) {
        if (Classify(value) != StateKind::kPositiveDimTensor) continue;
        const at::Tensor& t = std::get<at::Tensor>(value);
        TORCH_CHECK(t.sizes().vec() == tp->second.shape, "LoadFullOptimStateDict: state '", name, "' of '", fqn,
                    "' has shape ", t.sizes(), " but the parameter's global shape is ",
                    c10::IntArrayRef(tp->second.shape));
        // This rank's part under the parameter's layout (no communication: every rank has it).
        value = dtensor::distribute_tensor(t, tp->second.mesh, tp->second.placements, std::nullopt).to_local();
      }
      continue;
    }
    auto it = fsdp_params.find(fqn);
    if (it == fsdp_params.end() || it->second == nullptr) continue;  // SetOptimStateDict reports unknown FQNs
    for (auto& [name, value] : values) {
      if (Classify(value) != StateKind::kPositiveDimTensor) continue;
      const at::Tensor& t = std::get<at::Tensor>(value);
      TORCH_CHECK(t.sizes().vec() == it->second->sharding_spec().shape, "LoadFullOptimStateDict: state '", name,
                  "' of '", fqn, "' has shape ", t.sizes(), " but the parameter's global shape is ",
                  c10::IntArrayRef(it->second->sharding_spec().shape));
      value = fsdp2::LocalShardOf(*it->second, t);  // a view: SetOptimStateDict copies it
    }
  }
  SetOptimStateDict(optimizer, Named(params), local);
}

}  // namespace fsdp::optim_state
