#include "fsdp/per_param/fully_shard.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
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

// Modules fully_shard manages: the subtrees of the roots, not descending into modules that
// already have an FSDP state, each module once (_get_managed_modules).
void CollectManagedModules(torch::nn::Module& module, bool is_root, std::vector<torch::nn::Module*>& out,
                           absl::flat_hash_set<const torch::nn::Module*>& visited) {
  if (!is_root && GetState(module) != nullptr) return;
  if (!visited.insert(&module).second) return;
  out.push_back(&module);
  for (const auto& child : module.children()) CollectManagedModules(*child, false, out, visited);
}

// `what`: how messages name modules[i] ("modules[1]" for a list, the type name otherwise).
std::string Describe(const std::string& what, const torch::nn::Module& m) {
  return what.empty() ? m.name() : absl::StrCat(what, " (", m.name(), ")");
}

// The modules that get the hooks: those of `modules` that are no descendant of another one
// (torch/distributed/utils.py _get_root_modules, which fully_shard's @contract applies), in
// order. The others are managed through their listed ancestor, as in PyTorch. `names[i]` is
// how messages call the i-th root.
std::vector<torch::nn::Module*> RootModules(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                                            bool is_list, std::vector<std::string>& names) {
  TORCH_CHECK(!modules.empty(),
              "fully_shard: modules must not be empty (got an empty list); pass the modules whose parameters form "
              "one FSDP group");
  absl::flat_hash_map<const torch::nn::Module*, size_t> first_index;
  for (size_t i = 0; i < modules.size(); ++i) {
    const std::string what = is_list ? absl::StrCat("modules[", i, "]") : "module";
    TORCH_CHECK(modules[i] != nullptr, "fully_shard: ", what, " is null");
    auto [it, inserted] = first_index.emplace(modules[i].get(), i);
    // PyTorch: the second insertion of the state fails ("fully_shard has already been
    // applied to the following module").
    TORCH_CHECK(inserted, "fully_shard: ", Describe(what, *modules[i]), " is the same module as modules[", it->second,
                "]; list each module once");
  }
  absl::flat_hash_set<const torch::nn::Module*> below;  // strict descendants of listed modules
  for (const auto& m : modules) {
    for (const auto& d : m->modules(/*include_self=*/false)) below.insert(d.get());
  }
  std::vector<torch::nn::Module*> roots;
  for (size_t i = 0; i < modules.size(); ++i) {
    if (below.contains(modules[i].get())) continue;
    roots.push_back(modules[i].get());
    names.push_back(is_list ? absl::StrCat("modules[", i, "]") : "");
  }
  for (size_t i = 0; i < roots.size(); ++i) {
    torch::nn::Module& module = *roots[i];
    ::fsdp::HookedModule* hooks = ::fsdp::AsHooked(module);
    TORCH_CHECK(hooks != nullptr, "fully_shard: ", Describe(names[i], module),
                " cannot run forward hooks; construct it as fsdp::Hooked<", module.name(),
                "> (fsdp/common/hooked_module.h), or derive it from fsdp::HookedModule");
    if (auto existing = hooks->FindForwardHook<::fsdp::FSDPStateBase>()) {
      TORCH_CHECK(std::string(existing->api_name()) != "fully_shard", "fully_shard: ", Describe(names[i], module),
                  " is already fully_shard'ed");
      TORCH_CHECK(false, "fully_shard: ", Describe(names[i], module), " is already managed by FSDP1 (",
                  existing->api_name(), "); a module takes one FSDP");
    }
  }
  return roots;
}

// fully_shard on one module or on a list (one state, one parameter group, over the managed
// modules of every root): _fully_shard.py's fully_shard with _get_modules_and_states.
FSDPState* FullyShardImpl(const std::vector<std::shared_ptr<torch::nn::Module>>& modules, bool is_list,
                          FullyShardOptions options) {
  std::vector<std::string> root_names;
  const std::vector<torch::nn::Module*> roots = RootModules(modules, is_list, root_names);
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
  for (torch::nn::Module* root : roots) {
    for (FSDPState* s : CollectStates(*root)) {
      if (s->param_group() == nullptr) continue;
      for (const auto& p : s->param_group()->fsdp_params()) {
        managed_below.emplace(p->param().unsafeGetTensorImpl(), p.get());
      }
    }
  }
  std::vector<torch::nn::Module*> managed;
  absl::flat_hash_set<const torch::nn::Module*> visited;
  for (torch::nn::Module* root : roots) CollectManagedModules(*root, true, managed, visited);
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
        for (size_t r = 0; r < roots.size(); ++r) {  // names under the list's roots
          const std::string prefix = root_names[r].empty() ? "" : root_names[r] + ".";
          for (const auto& named : roots[r]->named_modules("", /*include_self=*/true)) {
            fqn.emplace(named.value().get(), prefix + (named.key().empty() ? "" : named.key() + "."));
          }
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
  auto state = std::make_shared<FSDPState>(roots, options.mp_policy, auto_reshard);
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
  if (roots.size() == 1) {
    // One module (or a list with one root): the state itself is the hook, as before
    // (PyTorch registers plain hooks when len(modules) == 1).
    ::fsdp::AsHooked(*roots[0])->AddForwardHook(state, ::fsdp::HookPosition::kOutermost);
  } else {
    // Outermost, as the single case: FSDP's pre-forward first, its post-forward last.
    for (torch::nn::Module* root : roots) {
      ::fsdp::AsHooked(*root)->AddForwardHook(std::make_shared<FSDPGroupMemberHook>(state, root),
                                              ::fsdp::HookPosition::kOutermost);
    }
  }
  return state.get();
}

}  // namespace

FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, FullyShardOptions options) {
  TORCH_CHECK(module != nullptr, "fully_shard: module is null");
  return FSDPModule(FullyShardImpl({module}, /*is_list=*/false, std::move(options)));
}

std::vector<FSDPModule> fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                                    FullyShardOptions options) {
  FSDPState* state = FullyShardImpl(modules, /*is_list=*/true, std::move(options));
  return std::vector<FSDPModule>(modules.size(), FSDPModule(state));
}

std::vector<FSDPModule> fully_shard(std::initializer_list<std::shared_ptr<torch::nn::Module>> modules,
                                    FullyShardOptions options) {
  return fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>(modules), std::move(options));
}

FSDPModule::FSDPModule(FSDPState* state) : state_(state) {}

FSDPState* FSDPModule::state() const { return state_.Get("FSDPModule"); }

::fsdp::ForwardHook& FSDPModule::forward_hook() const { return *state(); }

std::optional<FSDPModule> AsFSDPModule(torch::nn::Module& module) {
  FSDPState* s = GetState(module);
  if (s == nullptr) return std::nullopt;
  return FSDPModule(s);
}

FSDPState* FSDPHooks::fsdp_state() const {
  if (auto state = FindForwardHook<FSDPState>()) return state.get();
  if (auto member = FindForwardHook<FSDPGroupMemberHook>()) return member->state();
  return nullptr;
}

FSDPParamGroup* FSDPModule::param_group() const { return state()->param_group(); }

std::vector<FSDPState*> FSDPModule::States(bool recurse) const {
  FSDPState* s = state();
  if (!recurse) return {s};
  // A list group's handle stands for all its modules: their subtrees, each state once.
  std::vector<FSDPState*> out;
  absl::flat_hash_set<FSDPState*> seen;
  for (torch::nn::Module* m : s->modules()) {
    for (FSDPState* t : CollectStates(*m)) {
      if (seen.insert(t).second) out.push_back(t);
    }
  }
  return out;
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

void FSDPModule::set_unshard_async_op(bool async_op) {
  for (FSDPState* s : States(true)) {
    if (FSDPParamGroup* g = s->param_group()) g->unshard_async_op = async_op;
  }
}

}  // namespace fsdp::per_param
