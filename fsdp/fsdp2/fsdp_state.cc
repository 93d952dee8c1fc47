#include "fsdp/fsdp2/fsdp_state.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "comm/profiler_range.h"
#include "fsdp/common/autograd_hooks.h"
#include "fsdp/common/nonfinite.h"
#include "fsdp/meta/meta.h"

namespace fsdp::fsdp2 {
namespace {

at::Tensor CastFloating(const at::Tensor& t, c10::ScalarType dtype) {
  if (!t.defined() || !at::isFloatingType(t.scalar_type()) || t.scalar_type() == dtype) return t;
  return t.to(dtype);
}

}  // namespace

FSDPState* GetState(torch::nn::Module& module) {
  ::fsdp::HookedModule* hooked = ::fsdp::AsHooked(module);
  if (hooked == nullptr) return nullptr;
  if (auto state = hooked->FindForwardHook<FSDPState>()) return state.get();
  if (auto member = hooked->FindForwardHook<FSDPGroupMemberHook>()) return member->state();
  return nullptr;
}

std::vector<FSDPState*> CollectStates(torch::nn::Module& root) {
  std::vector<FSDPState*> found;
  absl::flat_hash_set<FSDPState*> seen;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    FSDPState* state = GetState(*item.value());
    if (state != nullptr && seen.insert(state).second) found.push_back(state);
  }
  return found;
}

FSDPState::FSDPState(torch::nn::Module* module, MixedPrecisionPolicy mp_policy, bool auto_reshard_after_forward)
    : FSDPState(std::vector<torch::nn::Module*>{module}, std::move(mp_policy), auto_reshard_after_forward) {}

FSDPState::FSDPState(std::vector<torch::nn::Module*> modules, MixedPrecisionPolicy mp_policy,
                     bool auto_reshard_after_forward)
    : FSDPStateBase("parameters"),
      module_(modules.empty() ? nullptr : modules.front()),
      modules_(std::move(modules)),
      mp_policy_(std::move(mp_policy)),
      auto_reshard_after_forward_(auto_reshard_after_forward),
      state_ctx_(std::make_shared<FSDPStateContext>()),
      comm_ctx_(std::make_shared<FSDPCommContext>()) {
  TORCH_CHECK(module_ != nullptr, "FSDPState: no module");
}

void FSDPState::CheckSingleRootModule() const {
  if (modules_.size() <= 1) return;
  std::string names;
  for (const torch::nn::Module* m : modules_) names += (names.empty() ? "" : ", ") + m->name();
  // PyTorch's _lazy_init: "FSDP requires a single root module but got (...)".
  TORCH_CHECK(false, "FSDP requires a single root module but got ", modules_.size(), " modules (", names,
              ") of one fully_shard(list) group: the first forward ran through them without a "
              "fully_shard'ed ancestor; fully_shard their common parent too and run forward through it");
}

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
                "(fsdp::fsdp2::InitMetaParameters, LoadFullStateDict, LoadShardedStateDict or fsdp::dcp::Load)");
  }
  if (auto name = ::fsdp::FindMetaTensor(root)) {
    TORCH_CHECK(false, "FSDP: '", *name,
                "' is still on the meta device: materialize it first "
                "(fsdp::fsdp2::InitMetaParameters or a state dict load)");
  }
}

void FSDPState::LazyInit() {
  if (is_root_.has_value()) return;
  CheckSingleRootModule();
  CheckMaterialized(*module_);
  is_root_ = true;
  state_ctx_->all_states.clear();
  // A fully_shard(list) state serves several modules: it is met once per module, counted
  // once (PyTorch's visited_states).
  absl::flat_hash_set<FSDPState*> visited;
  for (const auto& item : module_->named_modules("", /*include_self=*/true)) {
    FSDPState* state = GetState(*item.value());
    if (state == nullptr || visited.contains(state)) continue;
    visited.insert(state);
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
    std::string fqn;  // a list group: "q_proj, k_proj" (PyTorch's _init_fqns)
    for (torch::nn::Module* m : state->modules_) {
      auto it = module_names.find(m);
      if (it != module_names.end()) fqn += (fqn.empty() ? "" : ", ") + it->second;
    }
    state->param_group_->set_module_fqn(fqn);
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
  static const comm::ProfilerLabel kLabel("FSDP::root_pre_forward");
  comm::ProfilerRange range(kLabel);
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
  if (!is_root_.has_value()) {
    CheckSingleRootModule();
    CheckMaterialized(*module_);
  }
  return Guard("pre-forward", [&] { return PreForwardImpl(std::move(args)); });
}

void FSDPState::PostForward(const std::vector<at::Tensor*>& outputs) {
  Guard("post-forward", [&] { PostForwardImpl(outputs); });
}

std::vector<at::Tensor> FSDPState::GroupPreForward(torch::nn::Module* /*module*/, std::vector<at::Tensor> args) {
  // The first module of a pass opens it for all (wrapped_pre_hook); PreForward then does
  // the once-per-pass work only when the state is not already in forward.
  if (modules_to_run_forward_.empty()) modules_to_run_forward_ = modules_;
  return PreForward(std::move(args));
}

void FSDPState::GroupPostForward(torch::nn::Module* module, const std::vector<at::Tensor*>& outputs) {
  auto it = std::find(modules_to_run_forward_.begin(), modules_to_run_forward_.end(), module);
  if (it != modules_to_run_forward_.end()) {
    modules_to_run_forward_.erase(it);
    if (modules_to_run_forward_.empty()) {
      PostForward(outputs);
      return;
    }
  }
  // Not the last of the pass (or a repeat call): only output_dtype, as every module would get
  // without the group (wrapped_post_hook's cast_output_dtype).
  Guard("post-forward", [&] { CastOutputs(outputs); });
}

std::vector<at::Tensor> FSDPState::PreForwardImpl(std::vector<at::Tensor> args) {
  // Activation-checkpoint recomputation in backward: the pre-backward hook unsharded.
  if (training_state_ == TrainingState::kPreBackward) return args;
  // A list group's later modules find the state in forward already: root pre-forward and
  // forward prefetch are once per pass (_pre_forward's state_first_in_pass). A single
  // module always enters from idle.
  const bool first_in_pass = training_state_ != TrainingState::kForward;
  training_state_ = TrainingState::kForward;
  if (first_in_pass) RootPreForward();
  if (mp_policy_.cast_forward_inputs && mp_policy_.param_dtype) {
    static const comm::ProfilerLabel kLabel("FSDP::cast_forward_inputs");
    comm::ProfilerRange range(kLabel);
    for (auto& t : args) t = CastFloating(t, *mp_policy_.param_dtype);
  }
  if (param_group_) {
    // Only the pass's first module registers the post-backward function on its inputs (one
    // autograd node per pass, FSDPParamGroup.pre_forward's entering_forward_pass).
    const bool entering_forward_pass = param_group_->training_state() != TrainingState::kForward;
    param_group_->PreForward();
    if (entering_forward_pass) {
      args = param_group_->RegisterPostBackward(
          args, [this](const std::function<void()>& body) { Guard("post-backward", body); });
    }
  }
  if (first_in_pass) {
    for (FSDPState* state : states_to_forward_prefetch) {
      if (state->param_group_) FSDPParamGroup::PrefetchUnshard(state->param_group_.get(), TrainingState::kForward);
    }
  }
  return args;
}

void FSDPState::RegisterPreBackwardHooks(const std::vector<at::Tensor*>& outputs) {
  if (!at::GradMode::is_enabled()) return;
  for (at::Tensor* t : outputs) {
    if (t->defined() && t->requires_grad()) {
      RunWhenGradientComputed(*t, [this] { Guard("pre-backward", [this] { PreBackward(); }); });
    }
  }
}

void FSDPState::CastOutputs(const std::vector<at::Tensor*>& outputs) const {
  if (!mp_policy_.output_dtype) return;
  static const comm::ProfilerLabel kLabel("FSDP::cast_forward_outputs");
  comm::ProfilerRange range(kLabel);
  for (at::Tensor* t : outputs) *t = CastFloating(*t, *mp_policy_.output_dtype);
}

void FSDPState::PostForwardImpl(const std::vector<at::Tensor*>& outputs) {
  if (training_state_ == TrainingState::kPreBackward) return;
  if (param_group_) param_group_->PostForward();
  RegisterPreBackwardHooks(outputs);
  training_state_ = TrainingState::kIdle;
  if (state_ctx_->iter_forward_root == this) {
    ForceCompleteIncompleteStates(outputs);
    state_ctx_->iter_forward_root = nullptr;
  }
  CastOutputs(outputs);
}

// PyTorch's _force_complete_incomplete_states: a list group whose forward ran only some of
// its modules (e.g. chunked loss: the model's forward runs `norm` of fully_shard([norm,
// head]), `head` runs later per chunk) is completed here, on the forward root's output:
// reshard, pre-backward hook, output cast. Reversed, so the deepest state's cast applies
// first, as nested post-forwards would unwind.
void FSDPState::ForceCompleteIncompleteStates(const std::vector<at::Tensor*>& outputs) {
  const std::vector<FSDPState*>& all = state_ctx_->all_states;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    FSDPState* state = *it;
    if (state == this || state->modules_to_run_forward_.empty()) continue;
    if (state->param_group_) state->param_group_->PostForward();
    state->RegisterPreBackwardHooks(outputs);
    state->training_state_ = TrainingState::kIdle;
    state->CastOutputs(outputs);
    state->modules_to_run_forward_.clear();
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
  static const comm::ProfilerLabel kLabel("FSDP::root_post_backward_callback");
  comm::ProfilerRange range(kLabel);
  FSDPStateContext& ctx = *state_ctx_;
  ctx.post_backward_final_callback_queued = false;
  const bool finalize = ctx.is_last_backward && !ctx.manual_backward_finalization;
  // A group left incomplete by standalone calls after the forward (chunked loss) starts the
  // next iteration fresh (PyTorch clears iter_forward_root and _modules_to_run_forward here).
  ctx.iter_forward_root = nullptr;
  for (FSDPState* state : ctx.all_states) {
    state->modules_to_run_forward_.clear();
    FSDPParamGroup* group = state->param_group_.get();
    // Groups whose inputs did not require grad never ran their post-backward.
    if (group && group->training_state() != TrainingState::kPostBackward) group->PostBackward();
    state->training_state_ = TrainingState::kIdle;
    if (group) group->set_training_state(TrainingState::kIdle);
    if (finalize && group) group->FinalizeBackward();
  }
  if (finalize) {
    comm_ctx_->post_forward_order.clear();
    comm_ctx_->WaitForLastReduceScatter();
  }
  ++ctx.backward_steps;
  CheckNonfiniteGradients();
}

void FSDPState::FinalizeBackwardManually() {
  if (!is_root_.has_value()) return;  // never ran forward: nothing to reduce
  TORCH_CHECK(*is_root_, "finalize_backward must be called on the root fully_shard module");
  FSDPStateContext& ctx = *state_ctx_;
  TORCH_CHECK(!ctx.post_backward_final_callback_queued,
              "finalize_backward called during a backward (its end-of-backward callback is still queued)");
  for (FSDPState* state : ctx.all_states) {
    FSDPParamGroup* group = state->param_group_.get();
    if (group) {
      group->PostBackward();
      group->set_training_state(TrainingState::kIdle);
      group->FinalizeBackward();
    }
    state->training_state_ = TrainingState::kIdle;
  }
  comm_ctx_->post_forward_order.clear();
  comm_ctx_->WaitForLastReduceScatter();
}

void FSDPState::CheckNonfiniteGradients() {
  std::vector<std::string> fqns;
  std::vector<at::Tensor> flags;
  comm::ProcessGroupPtr world;
  for (FSDPState* state : state_ctx_->all_states) {
    FSDPParamGroup* group = state->param_group_.get();
    if (group == nullptr || !group->detect_nonfinite_grads) continue;
    at::Tensor f = group->TakeNonfiniteFlags();
    const int64_t n = static_cast<int64_t>(group->fsdp_params().size());
    // The host waits here once per backward (on a GPU, for the flags of every group).
    flags.push_back(f.defined() ? f.to(at::kCPU).to(at::kByte) : at::zeros({n}, at::kByte));
    for (const auto& p : group->fsdp_params()) fqns.push_back(p->fqn());
    if (world == nullptr) world = group->mesh_info().mesh->world();
  }
  if (fqns.empty()) return;
  const at::Tensor mine = at::cat(flags).contiguous();
  at::Tensor all = at::empty({world->size(), mine.numel()}, mine.options());
  world->all_gather_into_tensor(all, mine)->wait();
  const std::optional<NonfiniteVerdict> verdict = JudgeNonfinite(all, fqns);
  TORCH_CHECK(!verdict, "Non-finite gradient (FullyShardOptions::detect_nonfinite_grads): ",
              verdict->Describe("held NaN or Inf in its unreduced gradient"), " at backward step ",
              state_ctx_->backward_steps, " (the first in module order of ", verdict->flagged_parameters,
              " such parameter(s))");
}

}  // namespace fsdp::fsdp2
