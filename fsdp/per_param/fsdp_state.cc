#include "fsdp/per_param/fsdp_state.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "absl/container/flat_hash_map.h"
#include "fsdp/common/autograd_hooks.h"
#include "fsdp/common/meta.h"

namespace fsdp::per_param {
namespace {

at::Tensor CastFloating(const at::Tensor& t, c10::ScalarType dtype) {
  if (!t.defined() || !at::isFloatingType(t.scalar_type()) || t.scalar_type() == dtype) return t;
  return t.to(dtype);
}

}  // namespace

FSDPState* GetState(torch::nn::Module& module) { return ::fsdp::FindForwardHook<FSDPState>(module).get(); }

std::vector<FSDPState*> CollectStates(torch::nn::Module& root) { return ::fsdp::CollectForwardHooks<FSDPState>(root); }

FSDPState::FSDPState(torch::nn::Module* module, MixedPrecisionPolicy mp_policy, bool auto_reshard_after_forward)
    : FSDPStateBase("parameters"),
      module_(module),
      mp_policy_(std::move(mp_policy)),
      auto_reshard_after_forward_(auto_reshard_after_forward),
      state_ctx_(std::make_shared<FSDPStateContext>()),
      comm_ctx_(std::make_shared<FSDPCommContext>()) {}

// Deferred init (meta_init.h): the root's lazy init runs only once every shard holds values
// and nothing is left on the meta device; it throws (and can be retried) otherwise.
static void CheckMaterialized(torch::nn::Module& root) {
  absl::flat_hash_map<const c10::TensorImpl*, const FSDPParam*> unfilled;
  for (const auto& m : root.modules(/*include_self=*/true)) {
    FSDPState* state = GetState(*m);
    if (state == nullptr || state->param_group() == nullptr) continue;
    for (const auto& p : state->param_group()->fsdp_params()) {
      if (p->needs_init()) unfilled.emplace(p->param().unsafeGetTensorImpl(), p.get());
    }
  }
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    TORCH_CHECK(!unfilled.contains(item.value().unsafeGetTensorImpl()), "FSDP: parameter '", item.key(),
                "' was on the meta device at fully_shard and its shard holds no values yet: fill it first "
                "(fsdp::per_param::InitMetaParameters, LoadFullStateDict, LoadShardedStateDict or fsdp::dcp::Load)");
  }
  if (auto name = ::fsdp::FindMetaTensor(root)) {
    TORCH_CHECK(false, "FSDP: '", *name, "' is still on the meta device: materialize it first "
                "(fsdp::per_param::InitMetaParameters or a state dict load)");
  }
}

void FSDPState::LazyInit() {
  if (is_root_.has_value()) return;
  CheckMaterialized(*module_);
  is_root_ = true;
  state_ctx_->all_states.clear();
  for (const auto& item : module_->named_modules("", /*include_self=*/true)) {
    FSDPState* state = GetState(*item.value());
    if (state == nullptr) continue;
    if (state != this) {
      TORCH_CHECK(!state->is_root_.has_value(), "FSDP state has already been lazily initialized for ", item.key(),
                  "\nFSDP requires running forward through the root module first");
      state->is_root_ = false;
    }
    state_ctx_->all_states.push_back(state);
  }
  // The root's parameters would be freed and all-gathered again at once for backward.
  if (param_group_ && auto_reshard_after_forward_) param_group_->clear_post_forward_mesh_info();
  // Parameter and module names relative to the root, for messages and state dicts.
  absl::flat_hash_map<const c10::TensorImpl*, std::string> names;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  absl::flat_hash_map<const torch::nn::Module*, std::string> module_names;
  for (const auto& item : module_->named_modules("", true)) module_names.emplace(item.value().get(), item.key());
  for (FSDPState* state : state_ctx_->all_states) {
    state->state_ctx_ = state_ctx_;
    state->comm_ctx_ = comm_ctx_;
    if (!state->param_group_) continue;
    state->param_group_->set_module_fqn(module_names[state->module_]);
    for (const auto& p : state->param_group_->fsdp_params()) {
      auto it = names.find(p->param().unsafeGetTensorImpl());
      if (it != names.end()) p->set_fqn(it->second);
    }
    state->param_group_->LazyInit(comm_ctx_);
  }
}

void FSDPState::RootPreForward() {
  LazyInit();
  if (state_ctx_->iter_forward_root != nullptr) return;
  state_ctx_->iter_forward_root = this;
  // The copy-ins read what the optimizer step wrote: on the compute stream, or where the
  // user's post-optimizer event says (set_post_optim_event; used once, as PyTorch's
  // _root_pre_forward).
  device::EventPtr post_optim = std::move(state_ctx_->post_optim_event);
  state_ctx_->post_optim_event = nullptr;
  if (device::StreamPool* pool = comm_ctx_->stream_pool()) {
    const CommStreams& s = comm_ctx_->streams();
    if (post_optim) {
      s.all_gather_copy_in->WaitEvent(post_optim);
      s.all_gather->WaitEvent(post_optim);
    } else {
      s.all_gather_copy_in->WaitStream(pool->current());
      s.all_gather->WaitStream(pool->current());
    }
  } else if (post_optim) {
    // No streams yet (first forward): nothing was issued on a side stream, so the host
    // waits for the event itself before the first all-gather copy-in.
    post_optim->Synchronize(comm_ctx_->stream_options.timeout);
  }
}

std::vector<at::Tensor> FSDPState::PreForward(std::vector<at::Tensor> args) {
  // Before the poisoning guard: nothing has changed yet, so the user may fill the shards and
  // run again.
  if (!is_root_.has_value()) CheckMaterialized(*module_);
  return Guard("pre-forward", [&] { return PreForwardImpl(std::move(args)); });
}

void FSDPState::PostForward(const std::vector<at::Tensor*>& outputs) {
  Guard("post-forward", [&] { PostForwardImpl(outputs); });
}

std::vector<at::Tensor> FSDPState::PreForwardImpl(std::vector<at::Tensor> args) {
  // Activation-checkpoint recomputation in backward: the pre-backward hook unsharded.
  if (training_state_ == TrainingState::kPreBackward) return args;
  training_state_ = TrainingState::kForward;
  RootPreForward();
  if (mp_policy_.cast_forward_inputs && mp_policy_.param_dtype) {
    for (auto& t : args) t = CastFloating(t, *mp_policy_.param_dtype);
  }
  if (param_group_) {
    param_group_->PreForward();
    args = param_group_->RegisterPostBackward(
        args, [this](const std::function<void()>& body) { Guard("post-backward", body); });
  }
  for (FSDPState* state : states_to_forward_prefetch) {
    if (state->param_group_) FSDPParamGroup::PrefetchUnshard(state->param_group_.get(), TrainingState::kForward);
  }
  return args;
}

void FSDPState::PostForwardImpl(const std::vector<at::Tensor*>& outputs) {
  if (training_state_ == TrainingState::kPreBackward) return;
  if (param_group_) param_group_->PostForward();
  if (at::GradMode::is_enabled()) {
    for (at::Tensor* t : outputs) {
      if (t->defined() && t->requires_grad()) {
        t->register_hook([this](const at::Tensor&) { Guard("pre-backward", [this] { PreBackward(); }); });
      }
    }
  }
  training_state_ = TrainingState::kIdle;
  if (state_ctx_->iter_forward_root == this) state_ctx_->iter_forward_root = nullptr;
  if (mp_policy_.output_dtype) {
    for (at::Tensor* t : outputs) *t = CastFloating(*t, *mp_policy_.output_dtype);
  }
}

void FSDPState::PreBackward() {
  training_state_ = TrainingState::kPreBackward;
  RegisterRootPostBackwardFinalCallback();
  if (!param_group_) return;
  const bool default_prefetch = states_to_backward_prefetch.empty();
  param_group_->PreBackward(default_prefetch);
  if (default_prefetch) return;
  for (FSDPState* state : states_to_backward_prefetch) {
    if (state->param_group_) FSDPParamGroup::PrefetchUnshard(state->param_group_.get(), TrainingState::kPreBackward);
  }
}

void FSDPState::RegisterRootPostBackwardFinalCallback() {
  if (state_ctx_->post_backward_final_callback_queued) return;
  state_ctx_->post_backward_final_callback_queued = true;
  QueueEndOfBackwardCallback(
      [this] { Guard("post-backward final callback", [this] { RootPostBackwardFinalCallback(); }); });
}

void FSDPState::RootPostBackwardFinalCallback() {
  FSDPStateContext& ctx = *state_ctx_;
  ctx.post_backward_final_callback_queued = false;
  for (FSDPState* state : ctx.all_states) {
    FSDPParamGroup* group = state->param_group_.get();
    // Groups whose inputs did not require grad never ran their post-backward.
    if (group && group->training_state() != TrainingState::kPostBackward) group->PostBackward();
    state->training_state_ = TrainingState::kIdle;
    if (group) group->set_training_state(TrainingState::kIdle);
    if (ctx.is_last_backward && group) group->FinalizeBackward();
  }
  if (ctx.is_last_backward) {
    comm_ctx_->post_forward_order.clear();
    if (device::EventPtr event = std::move(comm_ctx_->reduce_scatter_event)) {
      comm_ctx_->reduce_scatter_event = nullptr;
      comm_ctx_->stream_pool()->current().WaitEvent(event);
    }
  }
}

}  // namespace fsdp::per_param
