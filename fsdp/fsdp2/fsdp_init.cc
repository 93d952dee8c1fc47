// fully_shard's initialization, split as PyTorch 2.15 splits it
// (torch/distributed/fsdp/_fully_shard/_fsdp_init.py): the mesh info, the root and managed
// modules, the managed parameters with their checks, and the hooks.
#include "fsdp/fsdp2/fsdp_init.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "distributed_parameters/distributed_parameters.h"
#include "fsdp/fsdp2/fsdp_state.h"
#include "fsdp/hooked_module/hooked_module.h"

namespace fsdp::fsdp2::internal {
namespace {
// Modules fully_shard manages: the subtrees of the roots, not descending into modules that
// already have an FSDP state, each module once (_get_managed_modules).
void CollectManagedModulesFrom(torch::nn::Module& module, bool is_root, std::vector<torch::nn::Module*>& out,
                               absl::flat_hash_set<const torch::nn::Module*>& visited) {
  if (!is_root && GetState(module) != nullptr) return;
  if (!visited.insert(&module).second) return;
  out.push_back(&module);
  for (const auto& child : module.children()) CollectManagedModulesFrom(*child, false, out, visited);
}

// `what`: how messages name modules[i] ("modules[1]" for a list, the type name otherwise).
std::string Describe(const std::string& what, const torch::nn::Module& m) {
  return what.empty() ? m.name() : absl::StrCat(what, " (", m.name(), ")");
}

// The FQN prefix ("a.b.", "" for a root) of each module under the roots, for messages.
absl::flat_hash_map<const torch::nn::Module*, std::string> ModulePrefixes(const std::vector<torch::nn::Module*>& roots,
                                                                          const std::vector<std::string>& root_names) {
  absl::flat_hash_map<const torch::nn::Module*, std::string> fqn;
  for (size_t r = 0; r < roots.size(); ++r) {
    const std::string prefix = root_names[r].empty() ? "" : root_names[r] + ".";
    for (const auto& named : roots[r]->named_modules("", /*include_self=*/true)) {
      fqn.emplace(named.value().get(), prefix + (named.key().empty() ? "" : named.key() + "."));
    }
  }
  return fqn;
}

// Parameters a fully_shard'ed submodule already manages; registering one of them here too
// (weights tied across groups) would let this group read it while the other has it sharded.
absl::flat_hash_map<const c10::TensorImpl*, const FSDPParam*> ManagedBelow(
    const std::vector<torch::nn::Module*>& roots) {
  absl::flat_hash_map<const c10::TensorImpl*, const FSDPParam*> managed_below;
  for (torch::nn::Module* root : roots) {
    for (FSDPState* s : CollectStates(*root)) {
      if (s->param_group() == nullptr) continue;
      for (const auto& p : s->param_group()->fsdp_params()) {
        managed_below.emplace(p->param().unsafeGetTensorImpl(), p.get());
      }
    }
  }
  return managed_below;
}

// The tensor-parallel spec of module m's parameter `name`, if m is a TP module.
std::optional<dtensor::DTensorSpec> TensorParallelSpec(torch::nn::Module& m, const std::string& name) {
  const auto* tp = distributed_parameters::FindDistributedParameters(m);
  if (tp == nullptr) return std::nullopt;
  for (const auto& [param, spec] : tp->named_parameter_specs()) {
    if (param == name) return spec;
  }
  return std::nullopt;
}

}  // namespace

std::optional<FSDPMeshInfo> GetPostForwardMeshInfo(const std::variant<bool, int64_t>& reshard,
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

FSDPMeshInfo GetMeshInfo(const FullyShardOptions& options) {
  TORCH_CHECK(options.mesh != nullptr, "fully_shard: options.mesh is null");
  const auto& mesh = options.mesh;
  TORCH_CHECK(options.dp_mesh_dims || mesh->ndim() == 1 || mesh->ndim() == 2,
              "fully_shard expects a 1D or 2D DeviceMesh but got ", mesh->ToString());
  if (options.dp_mesh_dims) {
    TORCH_CHECK(!options.replicate, "fully_shard: replicate is not supported with dp_mesh_dims");
    return FSDPMeshInfo::Spmd(mesh, options.dp_mesh_dims->shard.names, options.dp_mesh_dims->replicate.names);
  }
  if (options.replicate) return FSDPMeshInfo::Ddp(mesh);
  if (mesh->ndim() == 1) return FSDPMeshInfo::Fsdp(mesh);
  TORCH_CHECK(!mesh->dim_names().empty(), "Please init the 2D mesh for HSDP with mesh_dim_names specified");
  return FSDPMeshInfo::Hsdp(mesh);
}

// The others are managed through their listed ancestor, as in PyTorch.
std::vector<torch::nn::Module*> GetRootModules(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
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
                "> (fsdp/hooked_module/hooked_module.h), or derive it from fsdp::HookedModule");
    if (auto existing = hooks->FindForwardHook<::fsdp::FSDPStateBase>()) {
      TORCH_CHECK(std::string(existing->api_name()) != "fully_shard", "fully_shard: ", Describe(names[i], module),
                  " is already fully_shard'ed");
      TORCH_CHECK(false, "fully_shard: ", Describe(names[i], module), " is already managed by FSDP1 (",
                  existing->api_name(), "); a module takes one FSDP");
    }
  }
  return roots;
}

std::vector<torch::nn::Module*> GetManagedModules(const std::vector<torch::nn::Module*>& roots) {
  std::vector<torch::nn::Module*> managed;
  absl::flat_hash_set<const torch::nn::Module*> visited;
  for (torch::nn::Module* root : roots) CollectManagedModulesFrom(*root, true, managed, visited);
  return managed;
}

ManagedParams GetManagedParams(const std::vector<torch::nn::Module*>& managed,
                               const std::vector<torch::nn::Module*>& roots, const std::vector<std::string>& root_names,
                               const FullyShardOptions& options) {
  absl::flat_hash_set<const c10::TensorImpl*> seen;
  for (const auto& t : options.ignored_params) seen.insert(t.unsafeGetTensorImpl());
  const auto managed_below = ManagedBelow(roots);
  ManagedParams out;
  absl::flat_hash_map<const c10::TensorImpl*, size_t> index_of;
  for (torch::nn::Module* m : managed) {
    for (const auto& item : m->named_parameters(/*recurse=*/false)) {
      const at::Tensor& p = item.value();
      if (!p.defined()) continue;
      if (auto it = index_of.find(p.unsafeGetTensorImpl()); it != index_of.end()) {
        out.infos[it->second].shared.emplace_back(m, item.key());  // tied: the same tensor again
        continue;
      }
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;  // ignored
      if (auto below = managed_below.find(p.unsafeGetTensorImpl()); below != managed_below.end()) {
        auto fqn = ModulePrefixes(roots, root_names);
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
      index_of.emplace(p.unsafeGetTensorImpl(), out.params.size());
      out.params.push_back(p);
      out.infos.push_back(ParamModuleInfo{m, item.key(), {}});
      std::optional<int64_t> dim;
      if (options.shard_placement_fn) dim = options.shard_placement_fn(p, item.key());
      out.shard_dims.push_back(dim.value_or(0));
      out.tp_specs.push_back(TensorParallelSpec(*m, item.key()));
    }
  }
  return out;
}

void InitAllGatherExtensions(FSDPParamGroup& group, const MixedPrecisionPolicy& mp_policy) {
  for (const auto& p : group.fsdp_params()) {
    // The module itself, or its forward replacement (a float8 linear, float8/float8_linear.h).
    torch::nn::Module* module = p->module_info().module;
    const auto* provider = dynamic_cast<const AllGatherExtensionProvider*>(module);
    if (provider == nullptr) {
      const HookedModule* hooked = AsHooked(*module);
      if (hooked != nullptr)
        provider = dynamic_cast<const AllGatherExtensionProvider*>(hooked->forward_replacement().get());
    }
    if (provider == nullptr) continue;
    if (auto extension = provider->all_gather_extension(p->module_info().param_name)) {
      p->SetAllGatherExtension(std::move(extension), mp_policy);
    }
  }
}

void RegisterForwardHooks(const std::vector<torch::nn::Module*>& roots, const std::shared_ptr<FSDPState>& state) {
  if (roots.size() == 1) {
    // One module (or a list with one root): the state itself is the hook (PyTorch registers
    // plain hooks when len(modules) == 1).
    ::fsdp::AsHooked(*roots[0])->AddForwardHook(state, ::fsdp::HookPosition::kOutermost);
    return;
  }
  // Outermost, as the single case: FSDP's pre-forward first, its post-forward last.
  for (torch::nn::Module* root : roots) {
    ::fsdp::AsHooked(*root)->AddForwardHook(std::make_shared<FSDPGroupMemberHook>(state, root),
                                            ::fsdp::HookPosition::kOutermost);
  }
}

}  // namespace fsdp::fsdp2::internal
