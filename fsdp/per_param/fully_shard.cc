#include "fsdp/per_param/fully_shard.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "dtensor/tensor_parallel.h"
#include "fsdp/per_param/fsdp_state.h"

namespace fsdp::per_param {
namespace {

// The post-forward mesh for reshard_after_forward (_get_post_forward_mesh_info).
std::optional<FSDPMeshInfo> PostForwardMeshInfo(const std::variant<bool, int64_t>& reshard,
                                                const FSDPMeshInfo& mesh_info) {
  if (std::holds_alternative<bool>(reshard)) {
    if (std::get<bool>(reshard)) return mesh_info;
    return std::nullopt;
  }
  const int64_t k = std::get<int64_t>(reshard);
  const int64_t shard_size = mesh_info.shard_size();
  TORCH_CHECK(k >= 1 && k <= shard_size && shard_size % k == 0,
              "If passing reshard_after_forward as an int, it should be a factor of ", shard_size, ", not ", k);
  if (k == 1) return std::nullopt;  // one rank: the same as false (PyTorch warns)
  if (k == shard_size) return mesh_info;
  // Groups of k consecutive ranks of the shard group: a (shard/k, k) mesh over it.
  auto mesh = mesh::DeviceMesh::Create(mesh_info.shard_group(), {shard_size / k, k},
                                       {"post_forward_replicate", "post_forward_shard"});
  return FSDPMeshInfo::Hsdp(mesh);
}

// Modules fully_shard manages: the subtree of `root`, not descending into modules that
// already have an FSDP state (_get_managed_modules).
void CollectManagedModules(torch::nn::Module& module, bool is_root, std::vector<torch::nn::Module*>& out) {
  if (!is_root && GetState(module) != nullptr) return;
  out.push_back(&module);
  for (const auto& child : module.children()) CollectManagedModules(*child, false, out);
}

}  // namespace

FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, FullyShardOptions options) {
  TORCH_CHECK(module != nullptr, "fully_shard: module is null");
  ::fsdp::HookedModule* hooks = ::fsdp::AsHooked(*module);
  TORCH_CHECK(hooks != nullptr, "fully_shard: ", module->name(),
              " cannot run forward hooks; construct it as fsdp::Hooked<", module->name(),
              "> (fsdp/common/hooked_module.h), or derive it from fsdp::HookedModule");
  if (auto existing = hooks->FindForwardHook<::fsdp::FSDPStateBase>()) {
    TORCH_CHECK(std::string(existing->api_name()) != "fully_shard", "fully_shard: ", module->name(),
                " is already fully_shard'ed");
    TORCH_CHECK(false, "fully_shard: ", module->name(), " is already managed by FSDP1 (", existing->api_name(),
                "); a module takes one FSDP");
  }
  TORCH_CHECK(options.mesh != nullptr, "fully_shard: options.mesh is null");
  const auto& mesh = options.mesh;
  TORCH_CHECK(options.dp_mesh_dims || mesh->ndim() == 1 || mesh->ndim() == 2,
              "fully_shard expects a 1D or 2D DeviceMesh but got ", mesh->ToString());
  FSDPMeshInfo mesh_info;
  if (options.dp_mesh_dims) {
    TORCH_CHECK(!options.replicate, "fully_shard: replicate is not supported with dp_mesh_dims");
    mesh_info = FSDPMeshInfo::Spmd(mesh, options.dp_mesh_dims->shard, options.dp_mesh_dims->replicate);
  } else if (options.replicate) {
    mesh_info = FSDPMeshInfo::Ddp(mesh);
  } else if (mesh->ndim() == 1) {
    mesh_info = FSDPMeshInfo::Fsdp(mesh);
  } else {
    TORCH_CHECK(!mesh->dim_names().empty(), "Please init the 2D mesh for HSDP with mesh_dim_names specified");
    mesh_info = FSDPMeshInfo::Hsdp(mesh);
  }
  const bool auto_reshard = !options.reshard_after_forward.has_value();
  std::optional<FSDPMeshInfo> post_forward;
  if (mesh_info.shards()) {
    post_forward = PostForwardMeshInfo(options.reshard_after_forward.value_or(true), mesh_info);
  }

  absl::flat_hash_set<const c10::TensorImpl*> seen;
  for (const auto& t : options.ignored_params) seen.insert(t.unsafeGetTensorImpl());
  // Parameters a fully_shard'ed submodule already manages; registering one of them here too
  // (weights tied across groups) would let this group read it while the other has it
  // sharded.
  absl::flat_hash_map<const c10::TensorImpl*, const FSDPParam*> managed_below;
  for (FSDPState* s : CollectStates(*module)) {
    if (s->param_group() == nullptr) continue;
    for (const auto& p : s->param_group()->fsdp_params()) {
      managed_below.emplace(p->param().unsafeGetTensorImpl(), p.get());
    }
  }
  std::vector<torch::nn::Module*> managed;
  CollectManagedModules(*module, true, managed);
  std::vector<at::Tensor> params;
  std::vector<ParamModuleInfo> infos;
  std::vector<int64_t> shard_dims;
  std::vector<std::optional<dtensor::DTensorSpec>> tp_specs;
  absl::flat_hash_map<const c10::TensorImpl*, size_t> index_of;
  for (torch::nn::Module* m : managed) {
    const auto* tp = dynamic_cast<const dtensor::DistributedParameterModule*>(m);
    const auto specs = tp ? tp->named_parameter_specs() : std::vector<std::pair<std::string, dtensor::DTensorSpec>>{};
    for (const auto& item : m->named_parameters(/*recurse=*/false)) {
      const at::Tensor& p = item.value();
      if (!p.defined()) continue;
      auto it = index_of.find(p.unsafeGetTensorImpl());
      if (it != index_of.end()) {  // tied: the same tensor registered again
        infos[it->second].shared.emplace_back(m, item.key());
        continue;
      }
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;  // ignored
      if (auto below = managed_below.find(p.unsafeGetTensorImpl()); below != managed_below.end()) {
        absl::flat_hash_map<const torch::nn::Module*, std::string> fqn;
        for (const auto& named : module->named_modules("", /*include_self=*/true)) {
          fqn.emplace(named.value().get(), named.key().empty() ? "" : named.key() + ".");
        }
        const ParamModuleInfo& owner = below->second->module_info();
        TORCH_CHECK(false, "fully_shard: parameter '", fqn[m], item.key(), "' is the same tensor as '",
                    fqn[owner.module], owner.param_name,
                    "', which a fully_shard'ed submodule already manages. Tied parameters must belong to "
                    "one FSDP group: fully_shard their lowest common ancestor instead of the submodule.");
      }
      // A meta parameter gets its shard allocated on options.device (deferred init).
      TORCH_CHECK(p.device() == options.device || p.is_meta(), "Expects the parameter to already be moved to device ",
                  options.device, " but got ", p.device(), " (", m->name(), ".", item.key(),
                  "; the meta device is accepted too)");
      index_of.emplace(p.unsafeGetTensorImpl(), params.size());
      params.push_back(p);
      infos.push_back(ParamModuleInfo{m, item.key(), {}});
      std::optional<int64_t> dim;
      if (options.shard_placement_fn) dim = options.shard_placement_fn(p, item.key());
      shard_dims.push_back(dim.value_or(0));
      std::optional<dtensor::DTensorSpec> spec;
      for (const auto& [name, s] : specs) {
        if (name == item.key()) spec = s;
      }
      tp_specs.push_back(spec);
    }
  }
  auto state = std::make_shared<FSDPState>(module.get(), options.mp_policy, auto_reshard);
  state->comm_ctx().stream_options = options.stream_options;
  if (!params.empty()) {
    auto group = std::make_unique<FSDPParamGroup>(params, infos, mesh_info, post_forward, shard_dims, options.mp_policy,
                                                  options.offload_policy, tp_specs, options.device);
    for (const auto& p : group->fsdp_params()) {
      const auto* provider = dynamic_cast<const AllGatherExtensionProvider*>(p->module_info().module);
      if (provider == nullptr) continue;
      if (auto extension = provider->all_gather_extension(p->module_info().param_name)) {
        p->SetAllGatherExtension(std::move(extension), options.mp_policy);
      }
    }
    state->set_param_group(std::move(group));
  }
  hooks->AddForwardHook(state, ::fsdp::HookPosition::kOutermost);
  return FSDPModule(state.get());
}

FSDPModule::FSDPModule(FSDPState* state) : state_(state) {}

FSDPState* FSDPModule::state() const { return state_.Get("FSDPModule"); }

::fsdp::ForwardHook& FSDPModule::forward_hook() const { return *state(); }

std::optional<FSDPModule> AsFSDPModule(torch::nn::Module& module) {
  FSDPState* s = GetState(module);
  if (s == nullptr) return std::nullopt;
  return FSDPModule(s);
}

FSDPState* FSDPHooks::fsdp_state() const { return FindForwardHook<FSDPState>().get(); }

FSDPParamGroup* FSDPModule::param_group() const { return state()->param_group(); }

std::vector<FSDPState*> FSDPModule::States(bool recurse) const {
  FSDPState* s = state();
  return recurse ? CollectStates(*s->module()) : std::vector<FSDPState*>{s};
}

void FSDPModule::unshard(bool async_op) {
  state()->LazyInit();
  if (FSDPParamGroup* g = param_group()) {
    g->Unshard(async_op);
    if (!async_op) g->WaitForUnshard();
  }
}

void FSDPModule::wait_for_unshard() {
  if (FSDPParamGroup* g = param_group()) g->WaitForUnshard();
}

void FSDPModule::reshard() {
  state()->LazyInit();
  if (FSDPParamGroup* g = param_group()) g->Reshard();
}

void FSDPModule::set_requires_gradient_sync(bool requires_gradient_sync, bool recurse) {
  for (FSDPState* s : States(recurse)) {
    if (FSDPParamGroup* g = s->param_group()) {
      g->reduce_grads = requires_gradient_sync;
      g->all_reduce_grads = requires_gradient_sync;
    }
  }
}

void FSDPModule::set_requires_all_reduce(bool requires_all_reduce, bool recurse) {
  for (FSDPState* s : States(recurse)) {
    if (FSDPParamGroup* g = s->param_group()) g->all_reduce_grads = requires_all_reduce;
  }
}

void FSDPModule::set_reshard_after_forward(bool reshard_after_forward, bool recurse) {
  for (FSDPState* s : States(recurse)) {
    FSDPParamGroup* g = s->param_group();
    if (g == nullptr || !g->mesh_info().shards()) continue;
    if (reshard_after_forward) {
      g->set_post_forward_mesh_info(g->mesh_info());
    } else {
      g->clear_post_forward_mesh_info();
    }
  }
}

void FSDPModule::set_reshard_after_backward(bool reshard_after_backward, bool recurse) {
  for (FSDPState* s : States(recurse)) {
    if (FSDPParamGroup* g = s->param_group()) g->reshard_after_backward = reshard_after_backward;
  }
}

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) {
  state()->states_to_forward_prefetch.clear();
  for (const auto& m : modules) state()->states_to_forward_prefetch.push_back(m.state());
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  state()->states_to_backward_prefetch.clear();
  for (const auto& m : modules) state()->states_to_backward_prefetch.push_back(m.state());
}

void FSDPModule::set_is_last_backward(bool is_last_backward) {
  state()->state_ctx().is_last_backward = is_last_backward;
}

void FSDPModule::set_gradient_divide_factor(double factor) {
  TORCH_CHECK(factor > 0, "set_gradient_divide_factor: factor must be > 0, got ", factor);
  for (FSDPState* s : States(true)) {
    if (FSDPParamGroup* g = s->param_group()) g->gradient_divide_factor = factor;
  }
}

void FSDPModule::set_force_sum_reduction_for_comms(bool enable) {
  if (FSDPParamGroup* g = param_group()) g->force_sum_reduction_for_comms = enable;
}

void FSDPModule::set_all_reduce_hook(std::function<void(const at::Tensor&)> hook) {
  // One group per fully_shard call here, so PyTorch's "multiple param groups" error cannot
  // arise. A module without parameters has no reduction to hook.
  if (FSDPParamGroup* g = param_group()) g->all_reduce_hook = std::move(hook);
}

void FSDPModule::set_post_optim_event(device::EventPtr event) {
  state()->state_ctx().post_optim_event = std::move(event);
}

void FSDPModule::set_unshard_in_backward(bool unshard_in_backward) {
  if (FSDPParamGroup* g = param_group()) g->unshard_in_backward = unshard_in_backward;
}

}  // namespace fsdp::per_param
