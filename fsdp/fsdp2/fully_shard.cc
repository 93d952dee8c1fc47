#include "fsdp/fsdp2/fully_shard.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "absl/container/flat_hash_map.h"
#include "fsdp/fsdp2/fsdp_init.h"
#include "fsdp/fsdp2/fsdp_state.h"

namespace fsdp::fsdp2 {
namespace {

// fully_shard on one module or on a list (one state, one parameter group, over the managed
// modules of every root): _fully_shard.py's fully_shard with _get_modules_and_states.
FSDPState* FullyShardImpl(const std::vector<std::shared_ptr<torch::nn::Module>>& modules, bool is_list,
                          FullyShardOptions options) {
  std::vector<std::string> root_names;
  const std::vector<torch::nn::Module*> roots = internal::GetRootModules(modules, is_list, root_names);
  const FSDPMeshInfo mesh_info = internal::GetMeshInfo(options);
  const bool auto_reshard = !options.reshard_after_forward.has_value();
  std::optional<FSDPMeshInfo> post_forward;
  if (mesh_info.shards()) {
    post_forward = internal::GetPostForwardMeshInfo(options.reshard_after_forward.value_or(true), mesh_info);
  }
  const std::vector<torch::nn::Module*> managed = internal::GetManagedModules(roots);
  internal::ManagedParams params = internal::GetManagedParams(managed, roots, root_names, options);
  auto state = std::make_shared<FSDPState>(roots, options.mp_policy, auto_reshard);
  state->comm_ctx().stream_options = options.stream_options;
  if (!params.params.empty()) {
    auto group =
        std::make_unique<FSDPParamGroup>(params.params, params.infos, mesh_info, post_forward, params.shard_dims,
                                         options.mp_policy, options.offload_policy, params.tp_specs, options.device);
    internal::InitAllGatherExtensions(*group, options.mp_policy);
    group->detect_nonfinite_grads = options.detect_nonfinite_grads;
    state->set_param_group(std::move(group));
  }
  internal::RegisterForwardHooks(roots, state);
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

std::vector<FSDPGroupInfo> ListFSDPGroups(torch::nn::Module& root) {
  absl::flat_hash_map<const torch::nn::Module*, std::string> module_names;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    module_names.emplace(item.value().get(), item.key());
  }
  absl::flat_hash_map<const c10::TensorImpl*, std::string> param_names;
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    param_names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  std::vector<FSDPGroupInfo> groups;
  for (FSDPState* state : CollectStates(root)) {
    FSDPGroupInfo& group = groups.emplace_back();
    for (const torch::nn::Module* m : state->modules()) {
      const auto name = module_names.find(m);
      TORCH_CHECK(name != module_names.end(), "ListFSDPGroups: module ", m->name(),
                  " of a fully_shard(list) call is outside root's module tree; pass their common parent");
      group.module_fqns.push_back(name->second);
    }
    if (state->param_group() == nullptr) continue;  // fully_shard of a module without parameters
    for (const auto& p : state->param_group()->fsdp_params()) {
      const auto name = param_names.find(p->param().unsafeGetTensorImpl());
      TORCH_CHECK(name != param_names.end(), "ListFSDPGroups: an FSDP parameter of module '", group.module_fqns.front(),
                  "' is not a parameter of root's module tree (", p->ToString(), ")");
      group.params.push_back({name->second, p->sharded_size(), p->param().scalar_type(), p->sharding_spec()});
    }
  }
  return groups;
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

void FSDPModule::set_manual_backward_finalization(bool enabled) {
  FSDPState* s = state();
  TORCH_CHECK(s->is_root() != std::optional<bool>(false),
              "set_manual_backward_finalization must be called on the root fully_shard module");
  TORCH_CHECK(!s->state_ctx().post_backward_final_callback_queued,
              "set_manual_backward_finalization cannot change mode during backward");
  s->state_ctx().manual_backward_finalization = enabled;
}

void FSDPModule::finalize_backward() { state()->FinalizeBackwardManually(); }

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

}  // namespace fsdp::fsdp2
