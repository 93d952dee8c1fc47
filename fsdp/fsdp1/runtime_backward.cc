// FSDP1 runtime, backward half (torch/distributed/fsdp/_runtime_utils.py): pre-backward hook,
// post-backward hook (reshard, gradient reduction with the communication hook, sharded
// gradient accumulation, no_sync), the end-of-backward final callback.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "fsdp/common/autograd_hooks.h"
#include "fsdp/common/nonfinite.h"
#include "fsdp/fsdp1/fsdp_state.h"

namespace fsdp::fsdp1 {

void FSDPState::PreBackwardHook() {
  FlatParamHandle* handle = handle_.get();
  // Once per handle per backward, however many outputs carry the hook.
  if (handle && handle->runtime().ran_pre_backward_hook) return;
  static const comm::ProfilerLabel kLabel("FullyShardedDataParallel._pre_backward_hook");
  comm::ProfilerRange range(kLabel);
  if (*is_root_ && !post_backward_callback_queued_) {
    // Attach the final callback to the outermost backward.
    RegisterPostBackwardFinalCallback();
    for (FlatParamHandle* h : ctx_->exec_order_data.all_handles()) h->ResetFlatParamGradInfoIfNeeded();
  } else if (handle) {
    TORCH_CHECK(training_state_ == FSDPTrainingState::IDLE, "Expects the FSDP state of ", name(),
                " to be IDLE in its pre-backward but got ", ToString(training_state_));
  }
  training_state_ = FSDPTrainingState::FORWARD_BACKWARD;
  if (handle == nullptr) return;
  handle->set_training_state(HandleTrainingState::BACKWARD_PRE);
  // Counts only where every original requires grad (as RegisterPostBackward chose).
  grad_countdown_.Arm();
  if (handle->runtime().needs_pre_backward_unshard) {
    if (!handle->runtime().prefetched) Unshard(*handle);
    // The backward reads the unsharded flat parameter (gathered or prefetched).
    handle->WaitForUnshard();
  }
  // A mistargeted prefetch must not unshard this handle again.
  handle->runtime().needs_pre_backward_unshard = false;
  {
    static const comm::ProfilerLabel kPrefetch("FullyShardedDataParallel._pre_backward_prefetch");
    comm::ProfilerRange prefetch(kPrefetch);
    PrefetchHandle(handle, PrefetchMode::BACKWARD);
  }
  handle->PrepareGradientForBackward();
  handle->runtime().ran_pre_backward_hook = true;
}

void FSDPState::OnPostBackwardFunction() {
  // A module that ran forward k times post-backwards after its last use in backward.
  if (pending_post_backward_ > 0) --pending_post_backward_;
  if (pending_post_backward_ > 0) return;
  PostBackwardHook();
}

void FSDPState::PostBackwardHook() {
  grad_countdown_.Disarm();  // when the node or the end-of-backward callback runs it instead
  FlatParamHandle* handle = handle_.get();
  if (handle == nullptr) return;
  at::NoGradGuard no_grad;
  FlatParameter& fp = handle->flat_param();
  if (!fp.param.requires_grad()) {
    // _post_backward_reshard_only_hook: frozen parameters only reshard (the pre-backward may
    // not have run if the outputs needed no gradient).
    static const comm::ProfilerLabel kReshardOnly("FullyShardedDataParallel._post_backward_hook_reshard_only");
    comm::ProfilerRange range(kReshardOnly);
    training_state_ = FSDPTrainingState::FORWARD_BACKWARD;
    handle->set_training_state(HandleTrainingState::BACKWARD_POST);
    PostBackwardReshard();
    return;
  }
  static const comm::ProfilerLabel kLabel("FullyShardedDataParallel._post_backward_hook");
  comm::ProfilerRange range(kLabel);
  TORCH_CHECK(training_state_ == FSDPTrainingState::FORWARD_BACKWARD, "Expects the FSDP state of ", name(),
              " to be FORWARD_BACKWARD in its post-backward but got ", ToString(training_state_));
  // Reentrant activation checkpointing may run the post-backward again (BACKWARD_POST).
  const HandleTrainingState hts = handle->training_state();
  TORCH_CHECK(hts == HandleTrainingState::BACKWARD_PRE || hts == HandleTrainingState::BACKWARD_POST,
              "Expects `BACKWARD_PRE` or `BACKWARD_POST` state but got ", ToString(hts));
  handle->set_training_state(HandleTrainingState::BACKWARD_POST);
  // On the CPU the previous handle's reduction finishes first (it overlapped this handle's
  // backward computation): PyTorch reduce-scatters synchronously there, so Gloo's copy of the
  // previous gradient (ProcessGroupGloo clones a reduce-scatter's input) is gone before this
  // gradient is flattened and the peak holds one reduction at a time. CUDA frees through the
  // caching allocator's stream tracking instead.
  if (fp.param.is_cpu()) {
    streams().post_backward->Synchronize();
    streams().all_reduce->Synchronize();
  }
  // C++: what autograd accumulated into the original parameters becomes flat_param.grad
  // (PyTorch's FlatParameter AccumulateGrad), while the flat parameter is unsharded.
  if (fp.param.sizes() == c10::IntArrayRef(fp.unpadded_unsharded_size)) handle->FlattenOrigGrads();
  if (!fp.param.grad().defined()) return;  // the catch-all reshard in the final callback
  fp.post_backward_called = true;
  TORCH_CHECK(!fp.param.grad().requires_grad(), "FSDP does not support gradients of gradients");
  if (sync_gradients && options_.detect_nonfinite_grads) FlagNonfiniteGradients(fp);
  PostBackwardReshard();
  if (!sync_gradients) {
    if (handle->use_orig_params()) handle->UseUnshardedGradViews();
    return;
  }
  ReduceGrad();
}

void FSDPState::FlagNonfiniteGradients(const FlatParameter& fp) {
  // The unsharded flat gradient's segments, padding skipped: one per original parameter.
  const at::Tensor grad = fp.param.grad().reshape({-1});
  std::vector<at::Tensor> flags;
  int64_t offset = 0;
  for (size_t i = 0; i < fp.numels_with_padding.size(); ++i) {
    const int64_t n = fp.numels_with_padding[i];
    // A NaN or Inf element makes the sum non-finite; one read, no per-element flags.
    if (!fp.is_padding_mask[i]) flags.push_back(at::logical_not(at::isfinite(grad.narrow(0, offset, n).sum())));
    offset += n;
  }
  nonfinite_flags_ = at::stack(flags);
}

void FSDPState::CheckNonfiniteGradients() {
  std::vector<std::string> fqns;
  std::vector<at::Tensor> flags;
  for (FSDPState* s : ctx_->all_states) {
    FlatParamHandle* h = s->handle_.get();
    if (h == nullptr || !s->options_.detect_nonfinite_grads) continue;
    const FlatParameter& fp = h->flat_param();
    at::Tensor f = std::move(s->nonfinite_flags_);
    s->nonfinite_flags_ = at::Tensor();
    const int64_t n = static_cast<int64_t>(fp.fqns.size());
    flags.push_back(f.defined() ? f.to(at::kCPU).to(at::kByte) : at::zeros({n}, at::kByte));
    // The root's FQNs are its module's own (its state's name is "<root>").
    const bool root = s->is_root_.value_or(false) || s->fqn_.empty();
    for (const std::string& fqn : fp.fqns) fqns.push_back(root ? fqn : s->fqn_ + "." + fqn);
  }
  if (fqns.empty()) return;
  const at::Tensor mine = at::cat(flags).contiguous();
  at::Tensor all = at::empty({process_group_->size(), mine.numel()}, mine.options());
  process_group_->all_gather_into_tensor(all, mine)->wait();
  const std::optional<NonfiniteVerdict> verdict = JudgeNonfinite(all, fqns);
  TORCH_CHECK(!verdict, "Non-finite gradient (FSDPOptions::detect_nonfinite_grads): ",
              verdict->Describe("held NaN or Inf in its unreduced gradient"), " at backward step ",
              ctx_->backward_steps, " (the first in module order of ", verdict->flagged_parameters,
              " such parameter(s))");
}

void FSDPState::PostBackwardReshard() {
  Reshard(*handle_, ShouldFreeInBackward());
  static const comm::ProfilerLabel kLabel("FullyShardedDataParallel._post_backward_prefetch");
  comm::ProfilerRange range(kLabel);
  PrefetchHandle(handle_.get(), PrefetchMode::BACKWARD);
}

bool FSDPState::ShouldFreeInBackward() const {
  if (!handle_->uses_sharded_strategy()) return false;
  // Without gradient sync, strategies that keep parameters after forward keep them (more
  // memory, less communication), as a heuristic.
  return sync_gradients || ReshardsAfterForward(handle_->sharding_strategy());
}

void FSDPState::ReduceGrad() {
  FlatParamHandle& handle = *handle_;
  // _reduce_grad / _reduce_grad_no_shard: cast to the reduce dtype, pre-divide,
  // reduce-scatter (NO_SHARD: all-reduce) or the communication hook, the inter-node
  // all-reduce for hybrid strategies, post-divide, cast back, accumulate, offload.
  handle.ReduceScatterGrad(IsHybrid(handle.sharding_strategy()) ? inter_node_group_ : nullptr, comm_hook);
  // _post_backward_use_sharded_grad_views: delayed until after the reduction.
  if (handle.use_orig_params()) {
    handle.ResetIsGradNone();
    handle.UseShardedGradViews();
  }
}

void FSDPState::RegisterPostBackwardFinalCallback() {
  TORCH_CHECK(*is_root_, "Only the root FSDP instance should register the post-backward callback");
  if (post_backward_callback_queued_) return;
  TORCH_CHECK(training_state_ == FSDPTrainingState::IDLE, "Expects the root FSDP state to be IDLE when queueing ",
              "the post-backward callback but got ", ToString(training_state_));
  post_backward_callback_queued_ = true;
  QueueEndOfBackwardCallback(
      [this] { Guard("post-backward final callback", [this] { PostBackwardFinalCallback(); }); });
}

void FSDPState::PostBackwardFinalCallback() {
  TORCH_CHECK(*is_root_, "The post-backward callback should only be called on the root FSDP instance");
  at::NoGradGuard no_grad;
  ctx_->exec_order_data.NextIter();
  // C++: modules whose inputs needed no gradient (e.g. the root) post-backward here, in the
  // same order on every rank, before the wait below covers their reductions too.
  for (FSDPState* s : ctx_->all_states) {
    FlatParamHandle* h = s->handle_.get();
    if (h && h->training_state() == HandleTrainingState::BACKWARD_PRE) s->PostBackwardHook();
  }
  // The sharded gradients are read from here on (accumulation, optimizer).
  WaitForPostBackwardStreams();
  ++ctx_->backward_steps;
  for (FSDPState* s : ctx_->all_states) {
    FlatParamHandle* h = s->handle_.get();
    s->pending_post_backward_ = 0;
    s->grad_countdown_.Disarm();
    s->CatchAllReshard();
    s->FinalizeParams();
    s->training_state_ = FSDPTrainingState::IDLE;
    if (h) {
      HandleRuntimeState& rt = h->runtime();
      rt.ran_pre_backward_hook = false;
      rt.needs_pre_backward_unshard = false;
      rt.post_forward_index.reset();
      rt.prefetched = false;
      h->set_training_state(HandleTrainingState::IDLE);
    }
  }
  // Reset for cases like one forward and several backwards.
  post_backward_callback_queued_ = false;
  CheckNonfiniteGradients();  // last: the states are idle, the gradients final
}

void FSDPState::WaitForPostBackwardStreams() {
  const FlatParamStreams& s = streams();
  s.current->WaitStream(*s.post_backward);
  s.current->WaitStream(*s.all_reduce);  // HYBRID_SHARD's inter-node all-reduces
  // An unshard nobody waited for (a prefetch whose module did not run) must be issued before
  // any later collective the host issues directly (state dicts, clip_grad_norm).
  s.current->WaitStream(*s.unshard);
  bool offload = false;
  for (FSDPState* state : ctx_->all_states) offload = offload || (state->handle_ && state->handle_->offload_params());
  // The CPU gradients are read by the host, which device-side waits do not order (PyTorch
  // synchronizes the current stream).
  if (offload) {
    s.post_backward->Synchronize();
    s.all_reduce->Synchronize();
  }
}

void FSDPState::CatchAllReshard() {
  // Parameters unsharded by a pre-backward whose post-backward did not run (an output not
  // used in this backward's loss).
  if (!handle_) return;
  FlatParameter& fp = handle_->flat_param();
  const bool already_resharded =
      fp.param.data_ptr() == fp.local_shard.data_ptr() && !handle_->skipped_use_sharded_views();
  if (!already_resharded) Reshard(*handle_, ShouldFreeInBackward());
  TORCH_CHECK(fp.param.data_ptr() == fp.local_shard.data_ptr() && !handle_->skipped_use_sharded_views(),
              "FSDP: the flat parameter of ", name(), " is not resharded at the end of backward");
}

void FSDPState::FinalizeParams() {
  if (!handle_) return;
  FlatParameter& fp = handle_->flat_param();
  if (!fp.param.requires_grad()) return;
  // no_sync: .grad stays the unsharded gradient of the no_sync backwards, saved_grad_shard
  // the sharded gradient of the last synchronized one.
  if (!sync_gradients) return;
  handle_->PrepareGradientForOptim();
  fp.post_backward_called = false;
}

}  // namespace fsdp::fsdp1
