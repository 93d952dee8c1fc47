// FSDP1 runtime, forward half (torch/distributed/fsdp/_runtime_utils.py): lazy root
// initialization, root pre-forward, pre-/post-forward, unshard / reshard with the rate
// limiter, prefetching. Backward half: runtime_backward.cc.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_join.h"
#include "env/environment.h"
#include "fsdp/common/autograd_hooks.h"
#include "fsdp/fsdp1/fsdp_state.h"

namespace fsdp::fsdp1 {
namespace {

// _cast_forward_inputs: floating tensors to `dtype`.
void CastFloating(std::vector<at::Tensor>& args, c10::ScalarType dtype) {
  for (at::Tensor& t : args) {
    if (t.defined() && t.is_floating_point() && t.scalar_type() != dtype) t = t.to(dtype);
  }
}

std::string BoolSet(const std::set<bool>& values) {
  std::vector<std::string> out;
  for (bool v : values) out.push_back(v ? "true" : "false");
  return "{" + absl::StrJoin(out, ", ") + "}";
}

}  // namespace

const char* ToString(FSDPTrainingState s) {
  switch (s) {
    case FSDPTrainingState::IDLE: return "IDLE";
    case FSDPTrainingState::FORWARD_BACKWARD: return "FORWARD_BACKWARD";
    case FSDPTrainingState::SUMMON_FULL_PARAMS: return "SUMMON_FULL_PARAMS";
  }
  return "?";
}

FSDPState* GetState(torch::nn::Module& module) { return ::fsdp::FindForwardHook<FSDPState>(module).get(); }

std::vector<FSDPState*> CollectStates(torch::nn::Module& root) { return ::fsdp::CollectForwardHooks<FSDPState>(root); }

FSDPState::FSDPState(torch::nn::Module* module, FSDPOptions options, comm::ProcessGroupPtr process_group,
                     comm::ProcessGroupPtr inter_node_group, std::unique_ptr<FlatParamHandle> handle)
    : FSDPStateBase("flat parameters"),
      module_(module),
      options_(std::move(options)),
      process_group_(std::move(process_group)),
      inter_node_group_(std::move(inter_node_group)),
      handle_(std::move(handle)),
      ctx_(std::make_shared<FSDPRuntimeContext>()),
      use_full_prec_in_eval_(options_.use_full_prec_in_eval || env::IsOne(env::kUseFullPrecInEval)) {}

std::string FSDPState::name() const { return fqn_.empty() ? module_->name() : fqn_; }

// ----------------------------------------------------------------------------------------
// Lazy initialization

void FSDPState::LazyInit() {
  if (is_root_.has_value()) return;  // already lazily initialized
  // Only the root runs this: it marks every other state in its tree non-root.
  is_root_ = true;
  TORCH_CHECK(training_state_ == FSDPTrainingState::IDLE, "FSDP lazy init expects the state to be IDLE but got ",
              ToString(training_state_));
  ctx_->all_states = CollectStates(*module_);
  for (const auto& item : module_->named_modules("", /*include_self=*/true)) {
    if (FSDPState* s = GetState(*item.value())) s->fqn_ = item.key().empty() ? "<root>" : item.key();
  }
  CheckFlatParamsOnExpectedDevice();
  CastBuffersForComputation();
  std::vector<FlatParamHandle*> handles;
  for (FSDPState* s : ctx_->all_states) {
    if (s->handle_) handles.push_back(s->handle_.get());
  }
  ctx_->exec_order_data.Init(handles);
  ShareStateAndInitHandleAttrs();
}

void FSDPState::CheckFlatParamsOnExpectedDevice() const {
  for (FSDPState* s : ctx_->all_states) {
    const FlatParamHandle* h = s->handle_.get();
    if (h == nullptr) continue;
    const c10::Device device = h->flat_param().param.device();
    TORCH_CHECK(h->offload_params() || device == options_.device,
                "An FSDP-managed module unexpectedly has parameters on ", device, ". Make sure to move the module to ",
                options_.device, " before training.");
    TORCH_CHECK(!h->offload_params() || device.is_cpu(),
                "An FSDP-managed module with parameter CPU offloading enabled has parameters on ", device,
                ". Make sure to not move the module from CPU when offloading parameters.");
  }
}

void FSDPState::ShareStateAndInitHandleAttrs() {
  // HOMOGENEOUS_ATTR_NAMES: checked before anything changes.
  std::set<bool> use_orig_params, limit_all_gathers, use_full_prec_in_eval;
  for (FSDPState* s : ctx_->all_states) {
    use_orig_params.insert(s->options_.use_orig_params);
    limit_all_gathers.insert(s->options_.limit_all_gathers);
    use_full_prec_in_eval.insert(s->use_full_prec_in_eval_);
  }
  TORCH_CHECK(use_orig_params.size() == 1, "Expects one homogeneous value for use_orig_params but got ",
              BoolSet(use_orig_params));
  TORCH_CHECK(limit_all_gathers.size() == 1, "Expects one homogeneous value for limit_all_gathers but got ",
              BoolSet(limit_all_gathers));
  TORCH_CHECK(use_full_prec_in_eval.size() == 1, "Expects one homogeneous value for use_full_prec_in_eval but got ",
              BoolSet(use_full_prec_in_eval));
  // _init_streams: one set of streams (and one collective sequencer) for the root's tree.
  ctx_->streams = std::make_unique<FlatParamStreamContext>(options_.device, options_.stream_options);
  const FlatParamStreams* streams = &ctx_->streams->streams();
  if (handle_) {
    handle_->InitFlatParamAttributes();
    handle_->SetStreams(streams);
  }
  for (FSDPState* s : ctx_->all_states) {
    if (s == this) continue;
    TORCH_CHECK(!s->is_root_.has_value() || !*s->is_root_,
                "Non-root FSDP instance's `_is_root` should not have been set yet or should have been set to `False` "
                "(",
                s->name(), " ran forward as an FSDP root before its ancestor ", name(),
                "): run the first forward through the root");
    s->is_root_ = false;
    s->ctx_ = ctx_;
    if (s->handle_) {
      s->handle_->InitFlatParamAttributes();
      s->handle_->SetStreams(streams);
    }
  }
}

const FlatParamStreams& FSDPState::streams() const {
  TORCH_CHECK(ctx_->streams != nullptr, "FSDP state of ", name(),
              " has no streams yet: they are created at lazy init (the root's first forward)");
  return ctx_->streams->streams();
}

namespace {

// _cast_buffers_to_dtype_and_device: in place (the module keeps the tensor); non-floating
// buffers and those without a dtype only move to the device.
void CastBuffer(const at::Tensor& buffer, std::optional<c10::ScalarType> dtype, c10::Device device) {
  at::NoGradGuard no_grad;
  if (!at::isFloatingType(buffer.scalar_type()) || !dtype) {
    if (buffer.device() != device) buffer.set_data(buffer.to(device));
  } else if (buffer.device() != device || buffer.scalar_type() != *dtype) {
    buffer.set_data(buffer.to(device, *dtype));
  }
}

}  // namespace

// _get_buffers_and_dtypes_for_computation + _cast_buffers_to_dtype_and_device
// (torch/distributed/fsdp/_runtime_utils.py): the states bottom-up, so a buffer takes its
// owning (innermost) FSDP module's buffer_dtype; ignored buffers are left alone.
void FSDPState::CastBuffersForComputation() {
  TORCH_INTERNAL_ASSERT(is_root_.value_or(false), "Expects the root to cast buffers");
  absl::flat_hash_set<const c10::TensorImpl*> visited;
  for (auto it = ctx_->all_states.rbegin(); it != ctx_->all_states.rend(); ++it) {
    FSDPState* s = *it;
    const auto& mp = s->options_.mixed_precision;
    for (const at::Tensor& b : s->module_->buffers(/*recurse=*/true)) {
      if (!b.defined() || !visited.insert(b.unsafeGetTensorImpl()).second) continue;
      if (s->ignored.buffers.contains(b.unsafeGetTensorImpl())) continue;
      CastBuffer(b, mp ? mp->buffer_dtype : std::nullopt, options_.device);
    }
  }
}

// _root_pre_forward: forward passes that force full precision (eval with
// use_full_prec_in_eval) get the buffers in their original dtypes; the next one that does
// not casts them back.
void FSDPState::CastBuffersForRootPreForward() {
  bool full_prec = false;
  if (handle_) {
    full_prec = handle_->force_full_precision();
  } else {
    for (FSDPState* s : ctx_->all_states) full_prec = full_prec || (s->handle_ && s->handle_->force_full_precision());
  }
  if (full_prec) {
    for (const auto& [buffer, dtype] : orig_buffer_dtypes) CastBuffer(buffer, dtype, options_.device);
    needs_buffer_dtype_restore_check_ = true;
  } else if (needs_buffer_dtype_restore_check_) {
    CastBuffersForComputation();
    needs_buffer_dtype_restore_check_ = false;
  }
}

// ----------------------------------------------------------------------------------------
// Forward

std::vector<at::Tensor> FSDPState::PreForward(std::vector<at::Tensor> args) {
  // summon_full_params' rule (torch/distributed/fsdp/fully_sharded_data_parallel.py: forward
  // and backward cannot be started inside it); checked before Guard: it poisons nothing.
  TORCH_CHECK(training_state_ != FSDPTrainingState::SUMMON_FULL_PARAMS &&
                  !(handle_ && handle_->training_state() == HandleTrainingState::SUMMON_FULL_PARAMS),
              "FSDP forward of '", name(), "' inside SummonFullParams: forward and backward cannot be started while ",
              "the full parameters are summoned; leave the scope first");
  std::vector<at::Tensor> out;
  static const comm::ProfilerLabel kForward("FullyShardedDataParallel.forward");
  forward_range_.reset();  // a forward that threw before its post-forward
  forward_range_.emplace(kForward);
  Guard("pre-forward", [&] { out = PreForwardImpl(std::move(args)); });
  return out;
}

void FSDPState::PostForward(const std::vector<at::Tensor*>& outputs) {
  Guard("post-forward", [&] {
    static const comm::ProfilerLabel kPostForward("FullyShardedDataParallel._post_forward");
    comm::ProfilerRange range(kPostForward);
    PostForwardImpl(outputs);
  });
  forward_range_.reset();
}

std::vector<at::Tensor> FSDPState::PreForwardImpl(std::vector<at::Tensor> args) {
  args = RootPreForward(std::move(args));
  static const comm::ProfilerLabel kPreForward("FullyShardedDataParallel._pre_forward");
  comm::ProfilerRange range(kPreForward);
  FlatParamHandle* handle = handle_.get();
  // Activation checkpointing's recomputed forward: the pre-backward unsharded already.
  if (handle && handle->training_state() == HandleTrainingState::BACKWARD_PRE) return args;
  training_state_ = FSDPTrainingState::FORWARD_BACKWARD;
  ctx_->exec_order_data.RecordPreForward(handle, module_->is_training());
  if (handle) handle->set_training_state(HandleTrainingState::FORWARD);
  PreForwardUnshard();
  if (handle && handle->offload_params() && !handle->flat_param().cpu_grad.defined()) {
    FlatParameter& fp = handle->flat_param();
    fp.cpu_grad = at::zeros_like(fp.local_shard, fp.local_shard.options().device(at::kCPU));
  }
  const bool should_cast_forward_inputs = handle && !handle->force_full_precision();
  const auto& mp = options_.mixed_precision;
  if (should_cast_forward_inputs && mp && mp->cast_forward_inputs && mp->param_dtype) {
    CastFloating(args, *mp->param_dtype);
  }
  return RegisterPostBackward(args);
}

std::vector<at::Tensor> FSDPState::RootPreForward(std::vector<at::Tensor> args) {
  static const comm::ProfilerLabel kLabel("FullyShardedDataParallel._root_pre_forward");
  comm::ProfilerRange range(kLabel);
  LazyInit();
  TORCH_INTERNAL_ASSERT(is_root_.has_value(), "Expects a root FSDP to have been set");
  if (!*is_root_) return args;  // the wrapper path: non-roots do not cast here
  CastBuffersForRootPreForward();
  // _wait_for_computation_stream: the all-gathers (and low precision casts) read the shards
  // the optimizer step wrote on the compute stream.
  streams().unshard->WaitStream(*streams().current);
  if (options_.forward_prefetch) {
    for (FSDPState* s : ctx_->all_states) {
      if (!s->handle_) continue;
      s->handle_->runtime().needs_pre_forward_unshard = true;
      s->handle_->runtime().prefetched = false;
    }
  }
  for (FlatParamHandle* h : ctx_->exec_order_data.all_handles()) h->ResetFlatParamGradInfoIfNeeded();
  // _to_kwargs: forward inputs to the compute device.
  for (at::Tensor& t : args) {
    if (t.defined() && t.device() != options_.device) t = t.to(options_.device);
  }
  return RootCastForwardInput(std::move(args));
}

std::vector<at::Tensor> FSDPState::RootCastForwardInput(std::vector<at::Tensor> args) const {
  const bool not_forcing_full_precision = handle_ ? !handle_->force_full_precision() : true;
  const auto& mp = options_.mixed_precision;
  const bool should_cast = (module_->is_training() || !use_full_prec_in_eval_) && not_forcing_full_precision && mp &&
                           mp->cast_root_forward_inputs;
  if (should_cast && mp->param_dtype) CastFloating(args, *mp->param_dtype);
  return args;
}

void FSDPState::PreForwardUnshard() {
  FlatParamHandle* handle = handle_.get();
  if (handle == nullptr) return;
  // A prefetched handle is unsharded already.
  if (!handle->runtime().prefetched) Unshard(*handle);
  handle->runtime().needs_pre_forward_unshard = false;
  // The forward reads the unsharded flat parameter (prefetched or just gathered); waiting
  // before the next prefetch keeps that all-gather overlapping with this forward.
  handle->WaitForUnshard();
  static const comm::ProfilerLabel kLabel("FullyShardedDataParallel._pre_forward_prefetch");
  comm::ProfilerRange range(kLabel);
  PrefetchHandle(handle, PrefetchMode::FORWARD);
}

std::vector<at::Tensor> FSDPState::RegisterPostBackward(const std::vector<at::Tensor>& args) {
  if (!handle_) return args;
  if (!grad_countdown_.installed()) {
    grad_countdown_.Install(handle_->orig_params(), [this] { Guard("post-backward", [this] { PostBackwardHook(); }); });
  }
  // With a frozen original the backward may still read it after the last gradient arrived
  // (use_orig_params with mixed requires_grad): then the node below.
  if (grad_countdown_.AllRequireGrad() && handle_->flat_param().param.requires_grad()) return args;
  // Otherwise the post-backward runs once the inputs' gradients are computed (for frozen
  // parameters: _post_backward_reshard_only_hook).
  if (!at::GradMode::is_enabled()) return args;
  bool any = false;
  for (const at::Tensor& t : args) any = any || (t.defined() && t.requires_grad());
  if (!any) return args;  // post-backward in the final callback
  ++pending_post_backward_;
  return RegisterPostBackwardCallback(args, [this] { Guard("post-backward", [this] { OnPostBackwardFunction(); }); });
}

void FSDPState::PostForwardImpl(const std::vector<at::Tensor*>& outputs) {
  FlatParamHandle* handle = handle_.get();
  if (handle && handle->training_state() == HandleTrainingState::BACKWARD_PRE) return;
  ctx_->exec_order_data.RecordPostForward(handle);
  PostForwardReshard();
  RegisterPreBackwardHooks(outputs);
  training_state_ = FSDPTrainingState::IDLE;
  if (handle) handle->set_training_state(HandleTrainingState::IDLE);
}

void FSDPState::PostForwardReshard() {
  if (!handle_) return;
  // The root keeps its parameters: backward starts with it.
  const bool free_unsharded_flat_param = !*is_root_ && ReshardsAfterForward(handle_->sharding_strategy());
  Reshard(*handle_, free_unsharded_flat_param);
}

void FSDPState::RegisterPreBackwardHooks(const std::vector<at::Tensor*>& outputs) {
  if (!at::GradMode::is_enabled()) return;
  if (*is_root_) post_backward_callback_queued_ = false;
  FlatParamHandle* handle = handle_.get();
  if (handle) {
    handle->runtime().needs_pre_backward_unshard = false;
    // Conservatively assume the handle is used in backward since it ran forward.
    handle->runtime().ran_pre_backward_hook = false;
  }
  for (at::Tensor* t : outputs) {
    if (!t->defined() || !t->requires_grad()) continue;
    RunWhenGradientComputed(*t, [this] { Guard("pre-backward", [this] { PreBackwardHook(); }); });
    if (handle) handle->runtime().needs_pre_backward_unshard = true;
  }
}

// ----------------------------------------------------------------------------------------
// Unshard / reshard / prefetch

void FSDPState::Unshard(FlatParamHandle& handle) {
  handle.PreUnshard();
  if (options_.limit_all_gathers) {
    // The rate limiter: the host blocks until the oldest queued free happened on the device,
    // so that no more than two unsharded flat parameters' memory is in flight.
    if (device::EventPtr event = ctx_->free_event_queue.DequeueIfNeeded()) {
      static const comm::ProfilerLabel kLabel("FullyShardedDataParallel.rate_limiter");
      comm::ProfilerRange range(kLabel);
      event->Synchronize(streams().timeout);
      ctx_->free_event_queue.CountSynchronized();
    }
  }
  handle.Unshard();  // the all-gather on the unshard stream; the user waits (WaitForUnshard)
  handle.PostUnshard();
}

void FSDPState::Reshard(FlatParamHandle& handle, bool free_unsharded_flat_param) {
  handle.Reshard(free_unsharded_flat_param);
  if (options_.limit_all_gathers && free_unsharded_flat_param) {
    // Recorded on the compute stream after the freed parameter's last use.
    ctx_->free_event_queue.Enqueue(streams().current->RecordEvent());
  }
  handle.PostReshard();
  // Freed or not, the next access must unshard to get the shapes right.
  handle.runtime().prefetched = false;
}

void FSDPState::PrefetchHandle(FlatParamHandle* current, PrefetchMode mode) {
  if (current == nullptr) return;
  FlatParamHandle* target = GetHandleToPrefetch(*current);
  if (target == nullptr) return;
  // Emulate the target's training state so Unshard picks the right views.
  const HandleTrainingState prev = target->training_state();
  target->set_training_state(mode == PrefetchMode::BACKWARD ? HandleTrainingState::BACKWARD_PRE
                                                            : HandleTrainingState::FORWARD);
  Unshard(*target);
  target->set_training_state(prev);
  target->runtime().prefetched = true;
  // On the CPU the prefetched all-gather finishes before this handle's computation goes on,
  // as PyTorch's CPU collectives do (no streams: `all_gather_into_tensor` returns done).
  // ProcessGroupGloo gathers through a temporary flat buffer the size of the whole output,
  // kept until its Work is waited: left in flight, it would be live beside this handle's
  // unsharded gradient, one unit above PyTorch's peak (bench/e2e, FSDP1 compute rows).
  if (target->flat_param().param.is_cpu()) target->WaitForUnshard();
}

FlatParamHandle* FSDPState::GetHandleToPrefetch(FlatParamHandle& current) const {
  const HandleTrainingState ts = current.training_state();
  TORCH_CHECK(ts == HandleTrainingState::BACKWARD_PRE || ts == HandleTrainingState::BACKWARD_POST ||
                  ts == HandleTrainingState::FORWARD,
              "Prefetching is only supported in (BACKWARD_PRE, BACKWARD_POST, FORWARD) but currently in ",
              ToString(ts));
  const ExecOrderData& eod = ctx_->exec_order_data;
  const auto& bp = options_.backward_prefetch;
  if ((ts == HandleTrainingState::BACKWARD_PRE && bp == BackwardPrefetch::BACKWARD_PRE) ||
      (ts == HandleTrainingState::BACKWARD_POST && bp == BackwardPrefetch::BACKWARD_POST)) {
    FlatParamHandle* candidate = eod.GetHandleToBackwardPrefetch(current);
    if (candidate && candidate->runtime().needs_pre_backward_unshard && !candidate->runtime().prefetched) {
      return candidate;
    }
  } else if (ts == HandleTrainingState::FORWARD && options_.forward_prefetch) {
    FlatParamHandle* candidate = eod.GetHandleToForwardPrefetch(current);
    if (candidate && candidate->runtime().needs_pre_forward_unshard && !candidate->runtime().prefetched) {
      return candidate;
    }
  }
  return nullptr;
}

}  // namespace fsdp::fsdp1
