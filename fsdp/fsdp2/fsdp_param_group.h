// FSDPParamGroup: the parameters of one fully_shard call, communicated together, and the
// state machine of unshard / reshard around forward and backward (_fsdp_param_group.py).
#ifndef FSDP_FSDP_FSDP2_FSDP_PARAM_GROUP_H_
#define FSDP_FSDP_FSDP2_FSDP_PARAM_GROUP_H_

#include <c10/util/Exception.h>

#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/profiler_range.h"
#include "fsdp/common/autograd_hooks.h"
#include "fsdp/fsdp2/fsdp_collectives.h"
#include "fsdp/fsdp2/fsdp_param.h"

namespace fsdp::fsdp2 {

class FSDPParamGroup;

// State shared by all groups under one root: the order in which groups finished forward
// (with multiplicity), used for implicit backward prefetching.
struct FSDPCommContext {
  std::vector<FSDPParamGroup*> post_forward_order;
  AllGatherBufferPool all_gather_buffers;
  // The last reduce-scatter in flight (PyTorch's reduce_scatter_state): the next one
  // waits for it, so at most one reduce-scatter input is alive.
  device::EventPtr reduce_scatter_event;
  // Set by the first error inside an FSDP hook (a failed collective, ...): parameters may
  // be unsharded and gradients partially reduced, so every later FSDP call fails with it
  // (fsdp::FSDPStateBase::Guard / CheckNotPoisoned).
  std::string poisoned_by;

  // The root's FullyShardOptions::stream_options (the root's context serves the tree).
  device::StreamOptions stream_options;
  // The streams for `device`, created on first use with stream_options (the environment
  // variable FSDP_CPU_STREAMS overrides them: device::ApplyStreamEnvOverride).
  const CommStreams& Streams(c10::Device device);
  // Null before the first Streams call; then streams() holds the streams.
  device::StreamPool* stream_pool() const { return stream_pool_.get(); }
  const CommStreams& streams() const { return streams_; }
  // The compute stream waits for the last reduce-scatter in flight (if any) and forgets it.
  void WaitForLastReduceScatter();

 private:
  device::StreamPoolPtr stream_pool_;
  std::vector<device::StreamPtr> owned_streams_;
  CommStreams streams_;
};

class FSDPParamGroup {
 public:
  // `params` must be distinct tensors; `module_infos` parallel to them.
  FSDPParamGroup(std::vector<at::Tensor> params, std::vector<ParamModuleInfo> module_infos, FSDPMeshInfo mesh_info,
                 std::optional<FSDPMeshInfo> post_forward_mesh_info, const std::vector<int64_t>& shard_dims,
                 MixedPrecisionPolicy mp_policy, OffloadPolicy offload_policy,
                 std::vector<std::optional<dtensor::DTensorSpec>> tp_specs,
                 c10::Device device = c10::Device(c10::kCPU));

  // Idempotent; re-reads parameter dtypes and pads parameters changed since construction.
  void LazyInit(std::shared_ptr<FSDPCommContext> comm_ctx);

  // Runtime (PyTorch's methods).
  void Unshard(bool async_op = false);
  void WaitForUnshard();
  void Reshard();
  void PreForward();
  void PostForward();
  void PreBackward(bool default_prefetch);
  void PostBackward();
  void FinalizeBackward();
  // Unshards `target` as if in `state` (forward / backward prefetch).
  static void PrefetchUnshard(FSDPParamGroup* target, TrainingState state);

  // Arranges for PostBackward to run in the coming backward (the forward pass's first
  // module calls it with its inputs); returns `inputs`, changed only where a parameter is
  // frozen. Where an input requires grad (grad mode on), a group whose parameters all
  // require grad post-backwards once autograd has accumulated the gradient of each: a
  // post-accumulate-grad hook per parameter, counted down from PreBackward. PyTorch's FSDP2
  // routes the inputs through RegisterPostBackwardFunction instead, one more autograd node
  // per module per step (FSDP1 hooks its flat parameter's AccumulateGrad, as here). A
  // parameter that gets no gradient leaves the post-backward to the root's final callback,
  // as does a pass whose inputs need no gradient (as PyTorch). A group with a frozen
  // parameter, whose data the backward may read after the last gradient arrived, routes the
  // inputs that require grad through an identity autograd node whose backward runs
  // PostBackward, as PyTorch.
  // `guard` runs the post-backward body (the owning state's poisoning guard); the hooks,
  // installed by the first call in grad mode, stay for the group's lifetime.
  std::vector<at::Tensor> RegisterPostBackward(const std::vector<at::Tensor>& inputs,
                                               const std::function<void(std::function<void()>)>& guard);

  // Switches (public fields in PyTorch).
  bool reduce_grads = true;
  bool all_reduce_grads = true;
  bool reshard_after_backward = true;
  bool unshard_in_backward = true;
  // FullyShardOptions::detect_nonfinite_grads.
  bool detect_nonfinite_grads = false;
  // One flag per FSDP parameter (bool, the gradients' device): whether its last unreduced
  // gradient held a NaN or Inf; undefined when no reduction ran since the last take.
  at::Tensor TakeNonfiniteFlags() { return std::move(nonfinite_flags_); }
  bool unshard_async_op = false;
  std::optional<double> gradient_divide_factor;
  bool force_sum_reduction_for_comms = false;
  // FSDPModule::set_all_reduce_hook (PyTorch's _all_reduce_hook); empty: none.
  std::function<void(const at::Tensor&)> all_reduce_hook;

  const std::vector<std::unique_ptr<FSDPParam>>& fsdp_params() const { return fsdp_params_; }
  const std::vector<FSDPParam*>& fsdp_param_ptrs() const { return fsdp_param_ptrs_; }
  const FSDPMeshInfo& mesh_info() const { return mesh_info_; }
  const std::optional<FSDPMeshInfo>& post_forward_mesh_info() const { return post_forward_mesh_info_; }
  // The root does not reshard after forward when reshard_after_forward was left unset.
  void clear_post_forward_mesh_info() { post_forward_mesh_info_.reset(); }
  void set_post_forward_mesh_info(FSDPMeshInfo info) { post_forward_mesh_info_ = std::move(info); }
  TrainingState training_state() const { return training_state_; }
  void set_training_state(TrainingState s) { training_state_ = s; }
  ShardedState sharded_state() const { return sharded_state_; }
  bool is_sharded() const { return sharded_state_ == ShardedState::kSharded; }
  bool is_unsharded() const { return sharded_state_ == ShardedState::kUnsharded; }
  const std::string& module_fqn() const { return module_fqn_; }
  // Shared by the groups under one root (null before lazy init).
  FSDPCommContext* comm_ctx() const { return comm_ctx_.get(); }
  void set_module_fqn(std::string fqn);

  // PyTorch's record_function labels of this group (_fsdp_param_group.py _with_fqn):
  // "FSDP::pre_forward (layers.0)", without the parenthesis for the root's "".
  struct ProfilerLabels {
    comm::ProfilerLabel pre_forward, post_forward, pre_backward, all_gather, all_gather_copy_out, post_backward_reshard,
        post_backward_reduce;
    comm::ProfilerLabel forward_prefetch, backward_prefetch;  // "FSDP::forward_prefetch for layers.0": as the target
  };
  const ProfilerLabels& profiler_labels() const { return labels_; }

 private:
  void ToSharded();
  void ToShardedPostForward();
  void ToUnsharded();
  void BackwardPrefetch();
  void InitMixedPrecisionDtypes();
  // The compute stream waits for this group's last gradient reduction (PyTorch's
  // _wait_for_post_backward).
  void WaitForPostBackward();
  const CommStreams& streams();
  bool reshard_after_forward() const { return post_forward_mesh_info_.has_value(); }
  bool use_post_forward_mesh() const;
  const comm::ProcessGroupPtr& all_gather_group() const;

  std::vector<std::unique_ptr<FSDPParam>> fsdp_params_;
  std::vector<FSDPParam*> fsdp_param_ptrs_;  // the same, for the collectives (built once)
  FSDPMeshInfo mesh_info_;
  std::optional<FSDPMeshInfo> post_forward_mesh_info_;
  MixedPrecisionPolicy mp_policy_;
  std::shared_ptr<FSDPCommContext> comm_ctx_;
  TrainingState training_state_ = TrainingState::kIdle;
  ShardedState sharded_state_ = ShardedState::kSharded;
  std::string module_fqn_;
  ProfilerLabels labels_;
  bool reset_sharded_params_ = false;
  c10::ScalarType orig_dtype_ = c10::ScalarType::Float;
  std::optional<c10::ScalarType> reduce_dtype_;
  std::vector<int> post_forward_indices_;
  std::optional<AllGatherResult> all_gather_result_;
  at::Tensor partial_reduce_output_;
  at::Tensor nonfinite_flags_;
  device::EventPtr post_reduce_event_;
  // The post-backward trigger: the parameters' gradient countdown (installed by the first
  // RegisterPostBackward in grad mode) and whether the last forward chose it over the node.
  bool post_backward_from_grads_ = false;
  GradientCountdown grad_countdown_;
};

}  // namespace fsdp::fsdp2

#endif  // FSDP_FSDP_FSDP2_FSDP_PARAM_GROUP_H_
