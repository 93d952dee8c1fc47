// wrap_fsdp (the FullyShardedDataParallel constructor: process groups, strategy, auto-wrap,
// the FlatParamHandle) and the FullyShardedDataParallel handle's methods. clip_grad_norm:
// clip_grad_norm.cc.
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "fsdp/fsdp1/fsdp_state.h"
#include "fsdp/meta/meta.h"

namespace fsdp::fsdp1 {
namespace {

struct Groups {
  comm::ProcessGroupPtr process_group;
  comm::ProcessGroupPtr inter_node_group;
};

// _init_process_group_state (+ _for_hybrid_shard).
Groups ResolveGroups(const FSDPOptions& o) {
  const bool hybrid = IsHybrid(ToHandleShardingStrategy(o.sharding_strategy));
  const char* strategy = ToString(o.sharding_strategy);
  TORCH_CHECK(!(o.device_mesh && (o.process_group || o.inter_node_group)),
              "wrap_fsdp: cannot pass both process_group and device_mesh at the same time. Please just pass only one "
              "of them.");
  Groups g;
  if (o.device_mesh) {
    if (hybrid) {
      TORCH_CHECK(o.device_mesh->ndim() == 2, "wrap_fsdp: ", strategy, " expects device_mesh to have ndim=2 ",
                  "(replicate, shard) but got ", o.device_mesh->ToString());
      g.process_group = o.device_mesh->group(1);
      g.inter_node_group = o.device_mesh->group(0);
    } else {
      TORCH_CHECK(o.device_mesh->ndim() == 1, "wrap_fsdp: ", strategy, " expects a 1-D device_mesh but got ",
                  o.device_mesh->ToString());
      g.process_group = o.device_mesh->group(0);
    }
    return g;
  }
  TORCH_CHECK(o.process_group != nullptr, "wrap_fsdp: options.process_group (or device_mesh) is null");
  if (hybrid) {
    TORCH_CHECK(o.inter_node_group != nullptr, "wrap_fsdp: ", strategy, " needs options.inter_node_group (the ",
                "replica group; process_group is the intra-node shard group) or a 2-D device_mesh, but ",
                "inter_node_group is null");
  } else {
    TORCH_CHECK(o.inter_node_group == nullptr, "wrap_fsdp: options.inter_node_group is only for hybrid strategies, ",
                "but sharding_strategy is ", strategy);
  }
  return {o.process_group, o.inter_node_group};
}

// Modules wrap_fsdp manages: `module`'s tree, not descending into wrapped descendants.
void CollectManagedModules(torch::nn::Module& module, bool is_root, std::vector<torch::nn::Module*>& out) {
  if (!is_root && GetState(module) != nullptr) return;
  out.push_back(&module);
  for (const auto& child : module.children()) CollectManagedModules(*child, false, out);
}

using Ignored = FSDPState::IgnoredStates;

// The parameter elements of `module`'s tree, each tensor once, ignored ones not counted.
int64_t UniqueNumel(const torch::nn::Module& module, const Ignored& ignored) {
  absl::flat_hash_set<const c10::TensorImpl*> seen;
  int64_t n = 0;
  for (const at::Tensor& p : module.parameters()) {
    if (p.defined() && !ignored.param_impls.contains(p.unsafeGetTensorImpl()) &&
        seen.insert(p.unsafeGetTensorImpl()).second) {
      n += p.numel();
    }
  }
  return n;
}

// PyTorch's _recursive_wrap (torch/distributed/fsdp/wrap.py): ignored modules are neither
// visited nor wrapped, ignored parameters not counted; returns the numel wrapped in
// `module`'s tree. The children get the ignored parameters as ignored_states (the
// root_kwargs of FullyShardedDataParallel.__init__).
int64_t RecursiveWrap(const std::shared_ptr<torch::nn::Module>& module, const FSDPOptions& options,
                      const Ignored& ignored, bool only_wrap_children) {
  const int64_t nonwrapped_numel = UniqueNumel(*module, ignored);
  if (!options.auto_wrap_policy(*module, /*recurse=*/true, nonwrapped_numel)) return 0;
  int64_t total_wrapped_numel = 0;
  for (const auto& child : module->children()) {
    if (ignored.modules.contains(child.get())) continue;
    total_wrapped_numel += RecursiveWrap(child, options, ignored, false);
  }
  const int64_t remainder = nonwrapped_numel - total_wrapped_numel;
  // C++: only modules that can run the hooks can be wrapped.
  if (!only_wrap_children && ::fsdp::AsHooked(*module) != nullptr &&
      options.auto_wrap_policy(*module, /*recurse=*/false, remainder)) {
    FSDPOptions child_options = options;
    child_options.auto_wrap_policy = nullptr;
    child_options.ignored_modules.reset();
    child_options.ignored_states.reset();
    if (!ignored.params.empty()) {
      child_options.ignored_states.emplace(ignored.params.begin(), ignored.params.end());
    }
    wrap_fsdp(module, std::move(child_options));
    return nonwrapped_numel;
  }
  return total_wrapped_numel;
}

// _init_ignored_module_states with _check_ignored_states, _get_ignored_modules,
// _get_ignored_params and _get_ignored_buffer_names (torch/distributed/fsdp/_init_utils.py).
// Parameters that wrapped descendants manage are never ignored here (PyTorch excludes
// FSDP-flattened parameters).
Ignored ResolveIgnored(torch::nn::Module& module, const FSDPOptions& o) {
  TORCH_CHECK(!(o.ignored_modules && o.ignored_states),
              "wrap_fsdp: Cannot pass both ignored_modules and ignored_states at the same time. Please just pass "
              "ignored_states.");
  std::vector<std::shared_ptr<torch::nn::Module>> roots;
  std::vector<at::Tensor> params;
  if (o.ignored_states) {
    for (const IgnoredState& s : *o.ignored_states) {
      if (const auto* t = std::get_if<at::Tensor>(&s)) {
        TORCH_CHECK(t->defined(), "wrap_fsdp: ignored_states holds an undefined tensor");
        params.push_back(*t);
      } else {
        roots.push_back(std::get<std::shared_ptr<torch::nn::Module>>(s));
      }
    }
    TORCH_CHECK(params.empty() || roots.empty(),
                "wrap_fsdp: ignored_states expects all nn.Parameter or all nn.Module list elements but got both "
                "parameters and modules");
  } else if (o.ignored_modules) {
    roots = *o.ignored_modules;
  }
  for (const auto& m : roots) {
    TORCH_CHECK(m != nullptr,
                "wrap_fsdp: `ignored_modules` should be an iterable of `torch.nn.Module`s but got a "
                "null module");
    TORCH_CHECK(GetState(*m) == nullptr, "wrap_fsdp: `ignored_modules` should not include FSDP modules");
  }
  Ignored out;
  for (const auto& root : roots) {
    for (const auto& m : root->modules(/*include_self=*/true)) {
      if (GetState(*m) == nullptr) out.modules.insert(m.get());
    }
  }
  if (out.modules.contains(&module)) {
    TORCH_WARN("Trying to ignore the top-level module passed into the FSDP constructor itself will result in all ",
               "parameters being ignored and is not well-supported: ", module.name());
  }
  absl::flat_hash_set<const c10::TensorImpl*> managed_below;
  std::vector<at::Tensor> nested_params;
  for (FSDPState* s : CollectStates(module)) {
    out.modules.insert(s->ignored.modules.begin(), s->ignored.modules.end());
    out.buffers.insert(s->ignored.buffers.begin(), s->ignored.buffers.end());
    nested_params.insert(nested_params.end(), s->ignored.params.begin(), s->ignored.params.end());
    if (s->handle() == nullptr) continue;
    for (const at::Tensor& p : s->handle()->orig_params()) managed_below.insert(p.unsafeGetTensorImpl());
  }
  auto add_param = [&](const at::Tensor& p) {
    if (p.defined() && !managed_below.contains(p.unsafeGetTensorImpl()) &&
        out.param_impls.insert(p.unsafeGetTensorImpl()).second) {
      out.params.push_back(p);
    }
  };
  for (const auto& root : roots) {
    for (const at::Tensor& p : root->parameters(/*recurse=*/true)) add_param(p);
    for (const at::Tensor& b : root->buffers(/*recurse=*/true)) {
      if (b.defined()) out.buffers.insert(b.unsafeGetTensorImpl());
    }
  }
  for (const at::Tensor& p : params) add_param(p);
  for (const at::Tensor& p : nested_params) add_param(p);
  return out;
}

// PyTorch's _materialize_with_param_init_fn (torch/distributed/fsdp/_init_utils.py): the
// modules `module` manages, breadth first, each with its own meta tensors allocated on
// `device`, then passed to param_init_fn.
void MaterializeMetaModules(torch::nn::Module& module, const FSDPOptions& options, c10::Device device,
                            const Ignored& ignored) {
  std::vector<torch::nn::Module*> order{&module};
  for (size_t i = 0; i < order.size(); ++i) {
    for (const auto& child : order[i]->children()) {
      if (GetState(*child) == nullptr && !ignored.modules.contains(child.get())) order.push_back(child.get());
    }
  }
  bool meta = false;
  for (torch::nn::Module* m : order) {
    for (const auto& t : m->parameters(/*recurse=*/false)) meta |= t.defined() && t.is_meta();
    for (const auto& t : m->buffers(/*recurse=*/false)) meta |= t.defined() && t.is_meta();
  }
  if (!meta) return;
  TORCH_CHECK(options.param_init_fn != nullptr, "wrap_fsdp: ", module.name(),
              " has parameters or buffers on the meta device; pass options.param_init_fn to initialize them (PyTorch "
              "falls back to reset_parameters(), which LibTorch modules do not share)");
  for (torch::nn::Module* m : order) {
    for (const auto& t : m->parameters(/*recurse=*/false)) ::fsdp::MaterializeEmpty(t, device);
    for (const auto& t : m->buffers(/*recurse=*/false)) ::fsdp::MaterializeEmpty(t, device);
    at::NoGradGuard no_grad;
    options.param_init_fn(*m);
  }
}

// The buffers of `module`'s tree that sync_module_states has not broadcast yet: PyTorch marks
// each synced buffer (FSDP_SYNCED) so a nested wrap does not sync it again; here the subtree
// of a wrapped descendant that had sync_module_states on is skipped instead (the same set).
void CollectUnsyncedBuffers(torch::nn::Module& module, bool is_root, std::vector<at::Tensor>& out) {
  if (!is_root) {
    if (FSDPState* s = GetState(module); s != nullptr && s->options().sync_module_states) return;
  }
  for (const at::Tensor& b : module.buffers(/*recurse=*/false)) {
    if (b.defined()) out.push_back(b);
  }
  for (const auto& child : module.children()) CollectUnsyncedBuffers(*child, false, out);
}

// _sync_params_and_buffers (torch/distributed/utils.py): rank 0 of `group` broadcasts
// `tensors` (PyTorch's _broadcast_coalesced): one flat broadcast per (device, dtype).
void BroadcastCoalesced(const comm::ProcessGroupPtr& group, const std::vector<at::Tensor>& tensors) {
  if (tensors.empty() || group->size() == 1) return;
  at::NoGradGuard no_grad;
  std::vector<std::vector<at::Tensor>> buckets;
  for (const at::Tensor& t : tensors) {
    auto it = std::find_if(buckets.begin(), buckets.end(), [&](const std::vector<at::Tensor>& b) {
      return b.front().device() == t.device() && b.front().scalar_type() == t.scalar_type();
    });
    if (it == buckets.end()) {
      buckets.push_back({t});
    } else {
      it->push_back(t);
    }
  }
  for (const std::vector<at::Tensor>& bucket : buckets) {
    std::vector<at::Tensor> flat_parts;
    for (const at::Tensor& t : bucket) flat_parts.push_back(t.reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    group->broadcast(flat, /*root=*/0)->wait();
    int64_t offset = 0;
    for (const at::Tensor& t : bucket) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

// _sync_module_params_and_buffers, from _init_param_handle_from_module
// (torch/distributed/fsdp/_init_utils.py): `params` are the parameters this FSDP module
// manages; buffers as CollectUnsyncedBuffers. Hybrid: inter-node first, so each node's local
// rank 0 holds global rank 0's values before the intra-node broadcast.
void SyncModuleStates(torch::nn::Module& module, const std::vector<at::Tensor>& params, const Groups& groups) {
  std::vector<at::Tensor> states;
  CollectUnsyncedBuffers(module, /*is_root=*/true, states);
  for (const at::Tensor& p : params) states.push_back(p);
  for (const at::Tensor& t : states) {
    TORCH_CHECK(!t.is_meta(), "wrap_fsdp: sync_module_states found a parameter or buffer on the meta device in ",
                module.name(), "; materialize it first (options.param_init_fn)");
  }
  if (groups.inter_node_group) BroadcastCoalesced(groups.inter_node_group, states);
  BroadcastCoalesced(groups.process_group, states);
}

}  // namespace

const char* ToString(BackwardPrefetch p) {
  switch (p) {
    case BackwardPrefetch::BACKWARD_PRE: return "BACKWARD_PRE";
    case BackwardPrefetch::BACKWARD_POST: return "BACKWARD_POST";
  }
  return "?";
}

FullyShardedDataParallel wrap_fsdp(const std::shared_ptr<torch::nn::Module>& module, FSDPOptions options) {
  TORCH_CHECK(module != nullptr, "wrap_fsdp: module is null");
  ::fsdp::HookedModule* hooks = ::fsdp::AsHooked(*module);
  TORCH_CHECK(hooks != nullptr, "wrap_fsdp: ", module->name(), " cannot run forward hooks; construct it as ",
              "fsdp::Hooked<", module->name(),
              "> (fsdp/hooked_module/hooked_module.h), or derive it from fsdp::HookedModule");
  if (auto existing = hooks->FindForwardHook<::fsdp::FSDPStateBase>()) {
    TORCH_CHECK(std::string(existing->api_name()) != "wrap_fsdp", "wrap_fsdp: ", module->name(),
                " is already wrapped with FSDP (wrap each module once)");
    TORCH_CHECK(false, "wrap_fsdp: ", module->name(), " is already managed by FSDP2 (", existing->api_name(),
                "); a module takes one FSDP");
  }
  Groups groups = ResolveGroups(options);
  if (!IsHybrid(ToHandleShardingStrategy(options.sharding_strategy)) && groups.process_group->size() == 1) {
    // World size 1: the strategies are equivalent; PyTorch switches to NO_SHARD (and warns).
    options.sharding_strategy = ShardingStrategy::NO_SHARD;
  }
  Ignored ignored = ResolveIgnored(*module, options);
  if (options.auto_wrap_policy) {
    for (const auto& item : module->named_modules("", /*include_self=*/false)) {
      TORCH_CHECK(GetState(*item.value()) == nullptr, "wrap_fsdp: FSDP auto wrapping requires modules to not ",
                  "already have FSDP applied but found ", item.key(), " in ", module->name());
    }
    RecursiveWrap(module, options, ignored, /*only_wrap_children=*/true);
    options.auto_wrap_policy = nullptr;
  }

  MaterializeMetaModules(*module, options, options.cpu_offload.offload_params ? c10::Device(c10::kCPU) : options.device,
                         ignored);

  // Parameters wrapped descendants manage: registering one of them here too (weights tied
  // across FSDP modules) would let this module read it while the other has it sharded.
  absl::flat_hash_map<const c10::TensorImpl*, const FSDPState*> managed_below;
  for (FSDPState* s : CollectStates(*module)) {
    if (s->handle() == nullptr) continue;
    for (const at::Tensor& p : s->handle()->orig_params()) managed_below.emplace(p.unsafeGetTensorImpl(), s);
  }
  absl::flat_hash_map<const torch::nn::Module*, std::string> module_fqn;
  for (const auto& item : module->named_modules("", /*include_self=*/true)) {
    module_fqn.emplace(item.value().get(), item.key());
  }
  auto fqn = [&](const torch::nn::Module* m, const std::string& name) {
    const std::string& prefix = module_fqn[m];
    return prefix.empty() ? name : prefix + "." + name;
  };
  std::vector<torch::nn::Module*> managed;
  CollectManagedModules(*module, /*is_root=*/true, managed);
  std::vector<at::Tensor> params;
  absl::flat_hash_set<const c10::TensorImpl*> seen;
  for (torch::nn::Module* m : managed) {
    for (const auto& item : m->named_parameters(/*recurse=*/false)) {
      const at::Tensor& p = item.value();
      if (!p.defined() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
      if (ignored.param_impls.contains(p.unsafeGetTensorImpl())) continue;  // stays a plain parameter
      if (auto below = managed_below.find(p.unsafeGetTensorImpl()); below != managed_below.end()) {
        TORCH_CHECK(false, "wrap_fsdp: parameter '", fqn(m, item.key()), "' is the same tensor as a parameter of '",
                    module_fqn[below->second->module()], "', which is already wrapped with FSDP. Tied parameters ",
                    "must belong to one FSDP module: wrap their lowest common ancestor instead.");
      }
      const c10::Device expected = options.cpu_offload.offload_params ? c10::Device(c10::kCPU) : options.device;
      TORCH_CHECK(p.device() == expected, "wrap_fsdp: expects parameter '", fqn(m, item.key()), "' on device ",
                  expected, " but got ", p.device(), " (move the module to options.device before wrapping)");
      params.push_back(p);
    }
  }
  if (options.sync_module_states) SyncModuleStates(*module, params, groups);
  std::unique_ptr<FlatParamHandle> handle;
  if (!params.empty()) {
    FlatParamHandleOptions ho;
    ho.device = options.device;
    ho.sharding_strategy = ToHandleShardingStrategy(options.sharding_strategy);
    ho.offload_params = options.cpu_offload.offload_params;
    if (options.mixed_precision) {
      ho.mp_param_dtype = options.mixed_precision->param_dtype;
      ho.mp_reduce_dtype = options.mixed_precision->reduce_dtype;
      ho.keep_low_precision_grads = options.mixed_precision->keep_low_precision_grads;
    }
    ho.process_group = groups.process_group;
    ho.use_orig_params = options.use_orig_params;
    ho.use_full_prec_in_eval = options.use_full_prec_in_eval;
    ho.skip_writeback_check = options.skip_writeback_check;
    handle = std::make_unique<FlatParamHandle>(params, *module, std::move(ho));
    handle->Shard();
  }
  // _init_buffer_state: the dtypes buffer_dtype's casts restore (full state dicts, eval).
  std::vector<std::pair<at::Tensor, c10::ScalarType>> orig_buffer_dtypes;
  for (const at::Tensor& b : module->buffers(/*recurse=*/true)) {
    if (b.defined()) orig_buffer_dtypes.emplace_back(b, b.scalar_type());
  }
  auto state = std::make_shared<FSDPState>(module.get(), std::move(options), std::move(groups.process_group),
                                           std::move(groups.inter_node_group), std::move(handle));
  state->ignored = std::move(ignored);
  state->orig_buffer_dtypes = std::move(orig_buffer_dtypes);
  hooks->AddForwardHook(state, ::fsdp::HookPosition::kOutermost);
  return FullyShardedDataParallel(state.get());
}

AutoWrapPolicy SizeBasedAutoWrapPolicy(int64_t min_num_params) {
  TORCH_CHECK(min_num_params >= 0, "SizeBasedAutoWrapPolicy: min_num_params must be >= 0, got ", min_num_params);
  // PyTorch's force-leaf (MultiheadAttention) and excluded (ModuleList / ModuleDict) types
  // cannot run the hooks in C++, so they are never wrapped anyway.
  return [min_num_params](torch::nn::Module&, bool, int64_t nonwrapped_numel) {
    return nonwrapped_numel >= min_num_params;
  };
}

AutoWrapPolicy ModuleWrapPolicy(std::function<bool(const torch::nn::Module&)> predicate) {
  TORCH_CHECK(predicate != nullptr, "ModuleWrapPolicy: predicate is empty");
  return [predicate = std::move(predicate)](torch::nn::Module& m, bool recurse, int64_t) {
    return recurse || predicate(m);
  };
}

// ----------------------------------------------------------------------------------------
// FullyShardedDataParallel

FullyShardedDataParallel::FullyShardedDataParallel(FSDPState* state) : state_(state) {}

FSDPState* FullyShardedDataParallel::state() const { return state_.Get("FullyShardedDataParallel"); }

torch::nn::Module& FullyShardedDataParallel::module() const { return *state()->module(); }

FlatParamHandle* FullyShardedDataParallel::handle() const { return state()->handle(); }

std::vector<FlatParamHandle*> FullyShardedDataParallel::handles() const {
  std::vector<FlatParamHandle*> out;
  for (FSDPState* s : CollectStates(module())) {
    if (s->handle()) out.push_back(s->handle());
  }
  return out;
}

bool FullyShardedDataParallel::is_root() const {
  state()->LazyInit();
  return state()->is_root().value_or(false);
}

void FullyShardedDataParallel::CheckRoot(const char* what) const {
  TORCH_CHECK(is_root(), "`", what, "()` should only be called on the root FSDP instance, not on ", state()->name());
}

std::vector<at::Tensor> FullyShardedDataParallel::parameters() const {
  std::vector<at::Tensor> out;
  absl::flat_hash_set<const c10::TensorImpl*> seen;
  auto add = [&](const at::Tensor& t) {
    if (seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  };
  absl::flat_hash_set<const c10::TensorImpl*> managed;
  for (FlatParamHandle* h : handles()) {
    for (const at::Tensor& p : h->orig_params()) managed.insert(p.unsafeGetTensorImpl());
    if (h->use_orig_params()) {
      for (const at::Tensor& p : h->orig_params()) add(p);
    } else {
      add(h->flat_param().param);
    }
  }
  for (const at::Tensor& p : module().parameters()) {
    if (p.defined() && !managed.contains(p.unsafeGetTensorImpl())) add(p);
  }
  return out;
}

NoSyncGuard FullyShardedDataParallel::no_sync() {
  CheckRoot("no_sync");
  state()->CheckNotPoisoned("no_sync");
  TORCH_CHECK(state()->training_state() == FSDPTrainingState::IDLE, "`no_sync()` expects the root to be IDLE but ",
              "got ", ToString(state()->training_state()));
  std::vector<std::pair<FSDPState*, bool>> old_flags;
  for (FSDPState* s : CollectStates(module())) {
    old_flags.emplace_back(s, s->sync_gradients);
    s->sync_gradients = false;
  }
  return NoSyncGuard(std::move(old_flags));
}

NoSyncGuard::~NoSyncGuard() {
  for (auto& [state, old_flag] : old_flags_) state->sync_gradients = old_flag;
}

void FullyShardedDataParallel::register_comm_hook(CommHook hook) {
  CheckRoot("register_comm_hook");
  TORCH_CHECK(hook != nullptr, "register_comm_hook: hook is empty");
  for (FSDPState* s : CollectStates(module())) {
    TORCH_CHECK(!IsHybrid(ToHandleShardingStrategy(s->sharding_strategy())),
                "Communication hook is not supported for hybrid strategies: ", ToString(s->sharding_strategy()));
    TORCH_CHECK(s->comm_hook == nullptr, "A communication hook is already registered");
  }
  for (FSDPState* s : CollectStates(module())) s->comm_hook = hook;
}

}  // namespace fsdp::fsdp1
