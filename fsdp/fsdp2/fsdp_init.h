// fully_shard's initialization steps, internal to //fsdp/fsdp2 (fully_shard.cc runs them in
// this order): PyTorch 2.15's torch/distributed/fsdp/_fully_shard/_fsdp_init.py.
//
// Contract: each step checks what it is given and throws a c10::Error naming the module or
// parameter (messages start with "fully_shard" or are PyTorch's own); none changes a module,
// so a failing fully_shard leaves the model as it was. Not thread-safe: one fully_shard at a
// time per module tree.
#ifndef FSDP_FSDP_FSDP2_FSDP_INIT_H_
#define FSDP_FSDP_FSDP2_FSDP_INIT_H_

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "dtensor/dtensor_spec.h"
#include "fsdp/fsdp2/fsdp_api.h"
#include "fsdp/fsdp2/fsdp_param.h"
#include "fsdp/fsdp2/fsdp_param_group.h"
#include "fsdp/fsdp2/fsdp_state.h"
#include "fsdp/fsdp2/mesh_info.h"

namespace fsdp::fsdp2::internal {

// The data-parallel mesh info of options.mesh: FSDP (1-D), HSDP (2-D, named dims), DDP
// (options.replicate) or the SPMD mesh's dims (options.dp_mesh_dims).
FSDPMeshInfo GetMeshInfo(const FullyShardOptions& options);

// The post-forward mesh for reshard_after_forward (_get_post_forward_mesh_info): the mesh
// itself (true), none (false, or 1), or groups of k consecutive shard ranks (an int k).
std::optional<FSDPMeshInfo> GetPostForwardMeshInfo(const std::variant<bool, int64_t>& reshard,
                                                   const FSDPMeshInfo& mesh_info);

// The modules that get the hooks: those of `modules` that are no descendant of another one
// (torch/distributed/utils.py _get_root_modules, which fully_shard's @contract applies), in
// order; `names[i]` is how messages call the i-th root ("" for the single-module form).
// Checks: non-empty, no null, each module once, each a fsdp::HookedModule without FSDP yet.
std::vector<torch::nn::Module*> GetRootModules(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                                               bool is_list, std::vector<std::string>& names);

// The modules fully_shard manages (_get_managed_modules): the roots' subtrees without those
// already fully_shard'ed, each module once, in pre-order.
std::vector<torch::nn::Module*> GetManagedModules(const std::vector<torch::nn::Module*>& roots);

// The parameters of the managed modules FSDP shards (_get_managed_states with
// _verify_managed_param), in registration order, each tensor once (a tied one lists its
// other registrations in ParamModuleInfo::shared), without options.ignored_params.
// Checks: a tensor already managed by a fully_shard'ed submodule is refused (tied across
// groups), and each parameter is on options.device or the meta device.
struct ManagedParams {
  std::vector<at::Tensor> params;
  std::vector<ParamModuleInfo> infos;
  std::vector<int64_t> shard_dims;                            // options.shard_placement_fn's, else 0
  std::vector<std::optional<dtensor::DTensorSpec>> tp_specs;  // of a DistributedParameterModule
};
ManagedParams GetManagedParams(const std::vector<torch::nn::Module*>& managed,
                               const std::vector<torch::nn::Module*>& roots, const std::vector<std::string>& root_names,
                               const FullyShardOptions& options);

// Gives each parameter whose module is an AllGatherExtensionProvider its extension.
void InitAllGatherExtensions(FSDPParamGroup& group, const MixedPrecisionPolicy& mp_policy);

// Attaches `state` to the roots, outermost: itself for one root, an FSDPGroupMemberHook per
// root for fully_shard(list).
void RegisterForwardHooks(const std::vector<torch::nn::Module*>& roots, const std::shared_ptr<FSDPState>& state);

}  // namespace fsdp::fsdp2::internal

#endif  // FSDP_FSDP_FSDP2_FSDP_INIT_H_
