#include "fsdp/fsdp2/fsdp_param_group.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/profiler_range.h"
#include "fsdp/common/autograd_hooks.h"

namespace fsdp::fsdp2 {
namespace {}  // namespace

FSDPParamGroup::FSDPParamGroup(std::vector<at::Tensor> params, std::vector<ParamModuleInfo> module_infos,
                               FSDPMeshInfo mesh_info, std::optional<FSDPMeshInfo> post_forward_mesh_info,
                               const std::vector<int64_t>& shard_dims, MixedPrecisionPolicy mp_policy,
                               OffloadPolicy offload_policy, std::vector<std::optional<dtensor::DTensorSpec>> tp_specs,
                               c10::Device device)
    : mesh_info_(std::move(mesh_info)),
      post_forward_mesh_info_(std::move(post_forward_mesh_info)),
      mp_policy_(std::move(mp_policy)) {
  for (size_t i = 0; i < params.size(); ++i) {
    fsdp_params_.push_back(std::make_unique<FSDPParam>(params[i], module_infos[i], mesh_info_, post_forward_mesh_info_,
                                                       shard_dims[i], mp_policy_, offload_policy, tp_specs[i], device));
    fsdp_param_ptrs_.push_back(fsdp_params_.back().get());
  }
  set_module_fqn("");
}

void FSDPParamGroup::set_module_fqn(std::string fqn) {
  module_fqn_ = std::move(fqn);
  const auto with_fqn = [&](const char* label) {
    return comm::ProfilerLabel(module_fqn_.empty() ? std::string(label) : absl::StrCat(label, " (", module_fqn_, ")"));
  };
  labels_.pre_forward = with_fqn("FSDP::pre_forward");
  labels_.post_forward = with_fqn("FSDP::post_forward");
  labels_.pre_backward = with_fqn("FSDP::pre_backward");
  labels_.all_gather = with_fqn("FSDP::all_gather");
  labels_.all_gather_copy_out = with_fqn("FSDP::all_gather_copy_out");
  labels_.post_backward_reshard = with_fqn("FSDP::post_backward_reshard");
  labels_.post_backward_reduce = with_fqn("FSDP::post_backward_reduce");
  labels_.forward_prefetch = comm::ProfilerLabel(absl::StrCat("FSDP::forward_prefetch for ", module_fqn_));
  labels_.backward_prefetch = comm::ProfilerLabel(absl::StrCat("FSDP::backward_prefetch for ", module_fqn_));
}

void FSDPParamGroup::InitMixedPrecisionDtypes() {
  std::set<c10::ScalarType> orig;
  std::set<std::optional<c10::ScalarType>> reduce;
  for (const auto& p : fsdp_params_) {
    p->InitDtypeAttrs(mp_policy_);
    orig.insert(p->orig_dtype());
    reduce.insert(p->reduce_dtype());
  }
  auto names = [](const auto& set) {
    std::vector<std::string> out;
    for (const auto& d : set) {
      if constexpr (std::is_same_v<std::decay_t<decltype(d)>, c10::ScalarType>) {
        out.push_back(c10::toString(d));
      } else {
        out.push_back(d ? c10::toString(*d) : "None");
      }
    }
    return absl::StrJoin(out, ", ");
  };
  TORCH_CHECK(orig.size() == 1, "FSDP expects uniform original parameter dtype but got {", names(orig), "}");
  TORCH_CHECK(reduce.size() == 1, "FSDP expects uniform reduce dtype but got {", names(reduce), "}");
  orig_dtype_ = *orig.begin();
  reduce_dtype_ = *reduce.begin();
}

const CommStreams& FSDPCommContext::Streams(c10::Device device) {
  if (stream_pool_) return streams_;
  stream_pool_ = device::StreamPool::Create(device, device::ApplyStreamEnvOverride(stream_options));
  for (const char* name : {"all_gather_copy_in", "all_gather", "reduce_scatter", "all_reduce"}) {
    owned_streams_.push_back(stream_pool_->NewStream(name));
  }
  streams_ = {&stream_pool_->current(), owned_streams_[0].get(), owned_streams_[1].get(),
              owned_streams_[2].get(),  owned_streams_[3].get(), &stream_pool_->sequencer()};
  return streams_;
}

void FSDPCommContext::WaitForLastReduceScatter() {
  if (device::EventPtr event = std::exchange(reduce_scatter_event, nullptr)) streams_.current->WaitEvent(event);
}

const CommStreams& FSDPParamGroup::streams() {
  if (!comm_ctx_) return ThreadInlineStreams();  // no root context yet
  return comm_ctx_->Streams(fsdp_params_.front()->device());
}

void FSDPParamGroup::LazyInit(std::shared_ptr<FSDPCommContext> comm_ctx) {
  comm_ctx_ = std::move(comm_ctx);
  if (is_sharded() && !reset_sharded_params_) {
    for (const auto& p : fsdp_params_) p->ResetShardedParam();
    reset_sharded_params_ = true;
  }
  InitMixedPrecisionDtypes();
}

bool FSDPParamGroup::use_post_forward_mesh() const {
  return reshard_after_forward() && post_forward_mesh_info_->mesh != mesh_info_.mesh;
}

const comm::ProcessGroupPtr& FSDPParamGroup::all_gather_group() const {
  return sharded_state_ == ShardedState::kShardedPostForward ? post_forward_mesh_info_->shard_group()
                                                             : mesh_info_.shard_group();
}

void FSDPParamGroup::Unshard(bool async_op) {
  if (all_gather_result_.has_value()) return;  // already issued, pending wait
  if (is_unsharded()) return;
  if (!unshard_in_backward && training_state_ == TrainingState::kPreBackward) return;
  const CommStreams& s = streams();
  // PyTorch's get_all_gather_streams: implicit prefetching (forward, pre-backward) uses
  // the all-gather streams; an explicit async_op unshard stays on the compute stream.
  const bool side_streams =
      !async_op && (training_state_ == TrainingState::kForward || training_state_ == TrainingState::kPreBackward);
  comm::ProfilerRange range(labels_.all_gather);
  // DDP has no shard group: the "sharded" data is the full parameter, copied locally.
  all_gather_result_ =
      ForeachAllGather(fsdp_param_ptrs(), mesh_info_.shards() ? all_gather_group() : nullptr,
                       side_streams ? *s.all_gather_copy_in : *s.current, side_streams ? *s.all_gather : *s.current,
                       *s.sequencer, comm_ctx_ ? &comm_ctx_->all_gather_buffers : nullptr);
  // PyTorch issues it with c10d's async_op=False, which on a CPU group (Gloo) returns only
  // once the all-gather finished; a prefetch then holds just the gathered output until its
  // copy-out. Left in flight, ProcessGroupGloo's temporary flat copy of the whole output
  // would stay live beside the current module's gradients (bench/e2e's allocation peak).
  if (!async_op && all_gather_result_->buffer.is_cpu()) s.current->WaitEvent(all_gather_result_->event);
}

void FSDPParamGroup::WaitForUnshard() {
  if (!all_gather_result_.has_value()) return;  // no preceding unshard
  comm::ProfilerRange range(labels_.all_gather_copy_out);
  ForeachAllGatherCopyOut(*all_gather_result_, fsdp_param_ptrs(), *streams().current);
  for (const auto& p : fsdp_params_) p->InitUnshardedParam();
  ToUnsharded();
  all_gather_result_.reset();
}

void FSDPParamGroup::Reshard() {
  if (training_state_ == TrainingState::kForward) {
    if (!reshard_after_forward()) return;
    if (use_post_forward_mesh()) {
      ToShardedPostForward();
      return;
    }
  }
  ToSharded();
}

void FSDPParamGroup::PreForward() {
  comm::ProfilerRange range(labels_.pre_forward);
  training_state_ = TrainingState::kForward;
  Unshard(unshard_async_op);
  WaitForUnshard();
}

void FSDPParamGroup::PostForward() {
  comm::ProfilerRange range(labels_.post_forward);
  Reshard();
  post_forward_indices_.push_back(static_cast<int>(comm_ctx_->post_forward_order.size()));
  comm_ctx_->post_forward_order.push_back(this);
  training_state_ = TrainingState::kIdle;
}

void FSDPParamGroup::PreBackward(bool default_prefetch) {
  if (training_state_ == TrainingState::kPreBackward) return;
  comm::ProfilerRange range(labels_.pre_backward);
  training_state_ = TrainingState::kPreBackward;
  // Counted only where the forward chose the gradient hooks (RegisterPostBackward); Arm
  // re-reads the requires_grad flags, as the user may have frozen a parameter since.
  if (post_backward_from_grads_) {
    grad_countdown_.Arm();
  } else {
    grad_countdown_.Disarm();
  }
  Unshard(unshard_async_op);  // no-op if prefetched
  WaitForUnshard();
  if (default_prefetch) BackwardPrefetch();
}

void FSDPParamGroup::PostBackward() {
  training_state_ = TrainingState::kPostBackward;
  grad_countdown_.Disarm();  // when the end-of-backward callback runs it instead
  for (const auto& p : fsdp_params_) p->AccumulateUnshardedGradIfNeeded();
  if (!reduce_grads) {
    comm::ProfilerRange range(labels_.post_backward_reshard);
    if (reshard_after_backward) Reshard();
    for (const auto& p : fsdp_params_) p->ToAccumulatedGradIfNeeded();
    return;
  }
  // Take the autograd-computed gradients before resharding (they belong to the unsharded
  // parameters).
  std::vector<FSDPParam*> with_grad;
  std::vector<at::Tensor> grads;
  with_grad.reserve(fsdp_params_.size());  // one allocation each (both move into the reduction)
  grads.reserve(fsdp_params_.size());
  for (const auto& p : fsdp_params_) {
    at::Tensor g = p->TakeUnshardedGrad();
    if (!g.defined()) continue;
    with_grad.push_back(p.get());
    grads.push_back(std::move(g));
  }
  if (detect_nonfinite_grads && !with_grad.empty()) {
    std::vector<at::Tensor> flags;
    flags.reserve(fsdp_params_.size());
    size_t k = 0;
    for (const auto& p : fsdp_params_) {
      if (k < with_grad.size() && with_grad[k] == p.get()) {
        // A NaN or Inf element makes the sum non-finite; one read, no per-element flags.
        flags.push_back(at::logical_not(at::isfinite(grads[k++].sum())));
      } else {
        flags.push_back(at::zeros({}, grads[0].options().dtype(at::kBool)));
      }
    }
    nonfinite_flags_ = at::stack(flags);
  }
  if (reshard_after_backward) {
    comm::ProfilerRange range(labels_.post_backward_reshard);
    Reshard();
  }
  if (with_grad.empty()) return;
  comm::ProfilerRange range(labels_.post_backward_reduce);
  const CommStreams& s = streams();
  if (comm_ctx_) comm_ctx_->WaitForLastReduceScatter();
  WaitForPostBackward();  // an earlier backward's reduction of these gradients
  ReduceOptions options;
  if (mesh_info_.shards()) options.reduce_scatter_group = mesh_info_.shard_group();
  if (mesh_info_.replicates()) options.all_reduce_group = mesh_info_.replicate_group();
  options.orig_dtype = orig_dtype_;
  options.reduce_dtype = reduce_dtype_;
  options.gradient_divide_factor = gradient_divide_factor;
  options.force_sum_reduction_for_comms = force_sum_reduction_for_comms;
  options.all_reduce_grads = all_reduce_grads;
  options.all_reduce_hook = all_reduce_hook;
  ReduceEvents events = ForeachReduce(std::move(with_grad), std::move(grads), options, &partial_reduce_output_, s);
  if (comm_ctx_) comm_ctx_->reduce_scatter_event = std::move(events.reduce_scatter);
  post_reduce_event_ = std::move(events.post_reduce);
}

void FSDPParamGroup::WaitForPostBackward() {
  if (!post_reduce_event_) return;
  device::EventPtr event = std::move(post_reduce_event_);
  post_reduce_event_ = nullptr;
  streams().current->WaitEvent(event);
  // Offloaded gradients are read by the host (CPU optimizer): a device-side wait is not
  // enough (PyTorch's grad_offload_event.synchronize()).
  for (const auto& p : fsdp_params_) {
    if (p->offload_to_cpu()) {
      event->Synchronize(comm_ctx_ ? comm_ctx_->stream_pool()->options().timeout : comm::kDefaultTimeout);
      break;
    }
  }
}

void FSDPParamGroup::FinalizeBackward() {
  WaitForPostBackward();
  if (all_gather_result_.has_value()) {  // a mistargeted prefetch: wait and drop it
    streams().current->WaitEvent(all_gather_result_->event);
    if (all_gather_result_->pool) all_gather_result_->pool->Give(std::move(all_gather_result_->buffer));
    all_gather_result_.reset();
  }
  post_forward_indices_.clear();
}

void FSDPParamGroup::BackwardPrefetch() {
  if (post_forward_indices_.empty()) return;  // cleared by an earlier backward
  const int current = post_forward_indices_.back();
  post_forward_indices_.pop_back();
  const int target = current - 1;
  if (target < 0) return;
  // Reverse post-forward order: may mistarget if this backward skips modules.
  PrefetchUnshard(comm_ctx_->post_forward_order[target], TrainingState::kPreBackward);
}

void FSDPParamGroup::PrefetchUnshard(FSDPParamGroup* target, TrainingState state) {
  comm::ProfilerRange range(state == TrainingState::kForward ? target->labels_.forward_prefetch
                                                             : target->labels_.backward_prefetch);
  const TrainingState old = target->training_state_;
  target->training_state_ = state;
  try {
    target->Unshard(target->unshard_async_op);
  } catch (...) {
    target->training_state_ = old;
    throw;
  }
  target->training_state_ = old;
}

void FSDPParamGroup::ToSharded() {
  if (is_sharded()) return;
  for (const auto& p : fsdp_params_) p->ToSharded();
  sharded_state_ = ShardedState::kSharded;
}

void FSDPParamGroup::ToShardedPostForward() {
  if (sharded_state_ == ShardedState::kShardedPostForward) return;
  for (const auto& p : fsdp_params_) p->ToShardedPostForward();
  sharded_state_ = ShardedState::kShardedPostForward;
}

void FSDPParamGroup::ToUnsharded() {
  if (is_unsharded()) return;
  for (const auto& p : fsdp_params_) p->ToUnsharded();
  sharded_state_ = ShardedState::kUnsharded;
}

std::vector<at::Tensor> FSDPParamGroup::RegisterPostBackward(const std::vector<at::Tensor>& inputs,
                                                             const std::function<void(std::function<void()>)>& guard) {
  if (!at::GradMode::is_enabled()) return inputs;
  if (!grad_countdown_.installed()) {
    std::vector<at::Tensor> params;
    params.reserve(fsdp_param_ptrs_.size());
    for (const FSDPParam* p : fsdp_param_ptrs_) params.push_back(p->param());
    grad_countdown_.Install(std::move(params), [this, guard] { guard([this] { PostBackward(); }); });
  }
  // As PyTorch: where no input requires grad, the post-backward waits for the root's final
  // callback.
  bool any_input_requires_grad = false;
  for (const at::Tensor& t : inputs)
    any_input_requires_grad = any_input_requires_grad || (t.defined() && t.requires_grad());
  post_backward_from_grads_ = false;
  if (!any_input_requires_grad) return inputs;
  // With a frozen parameter the backward may still read it (a frozen layer before a trained
  // one needs its weight for the input gradient) after the last gradient is accumulated.
  if (!grad_countdown_.AllRequireGrad()) {
    return RegisterPostBackwardCallback(inputs, [this, guard] { guard([this] { PostBackward(); }); });
  }
  post_backward_from_grads_ = true;
  return inputs;
}

}  // namespace fsdp::fsdp2
