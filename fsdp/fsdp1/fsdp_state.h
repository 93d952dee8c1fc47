// FSDPState: what wrap_fsdp attaches to one module (PyTorch's FullyShardedDataParallel
// instance state, _FSDPState): its FlatParamHandle (if it manages parameters), its options,
// and the runtime of torch/distributed/fsdp/_runtime_utils.py around its forward and backward:
//
//   forward   PreForward:  _root_pre_forward (lazy init on the first call: this state becomes
//                          the root) + _pre_forward (unshard, forward prefetch, post-backward
//                          registration, input casts)
//             PostForward: _post_forward (reshard per strategy, pre-backward hooks on outputs)
//   backward  pre-backward: a tensor pre-hook on each forward output's producing node
//                          (_pre_backward_hook: unshard, BACKWARD_PRE prefetch, gradient
//                          preparation; the root queues the final callback on the autograd
//                          engine)
//             post-backward: once autograd has accumulated the gradient of every original
//                          parameter of the handle (_post_backward_hook: flatten the
//                          originals' gradients, reshard, BACKWARD_POST prefetch,
//                          reduce-scatter / all-reduce, accumulate)
//             end:         _post_backward_final_callback (post-backward of handles whose
//                          hooks did not run it, catch-all reshard, finalize gradients)
//
// C++ mapping: PyTorch's post-backward hook sits on the FlatParameter's AccumulateGrad; here
// autograd accumulates into the original parameters (flat_param.h), so a post-accumulate-grad
// hook sits on each original instead (fsdp::GradientCountdown, armed in the pre-backward) and
// the post-backward runs once every use of the module in that backward has contributed. A
// handle with a frozen original, whose data the backward may still read after the last
// gradient arrived, routes the forward inputs through an identity autograd node instead
// (fsdp::RegisterPostBackwardCallback), which runs the post-backward after the module's last
// use. Handles whose post-backward neither ran (a parameter without a gradient, inputs that
// need none, e.g. the root) get it in the final callback. A module called k times in one
// forward reduces once.
//
// Streams (flat_param_streams.h, PyTorch's _init_streams): the root creates them at lazy
// init and every handle of its tree issues on them. The root's pre-forward makes the unshard
// stream wait for the compute stream (the optimizer step wrote the shards); all-gathers run on
// the unshard stream and the compute stream waits for a handle's before using it (pre-forward,
// pre-backward); reductions run on the post-backward stream after the compute stream's work;
// the final callback makes the compute stream wait for the post-backward streams.
#ifndef FSDP_FSDP_FSDP1_FSDP_STATE_H_
#define FSDP_FSDP_FSDP1_FSDP_STATE_H_

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "comm/profiler_range.h"
#include "fsdp/common/autograd_hooks.h"
#include "fsdp/common/fsdp_state_base.h"
#include "fsdp/fsdp1/exec_order.h"
#include "fsdp/fsdp1/flat_param.h"
#include "fsdp/fsdp1/flat_param_streams.h"
#include "fsdp/fsdp1/fsdp_options.h"
#include "fsdp/hooked_module/hooked_module.h"

namespace fsdp::fsdp1 {

class FSDPState;
class SummonFullParams;

// PyTorch's TrainingState (of an FSDP instance; handles have HandleTrainingState).
enum class FSDPTrainingState { IDLE, FORWARD_BACKWARD, SUMMON_FULL_PARAMS };
const char* ToString(FSDPTrainingState s);

// Shared by every state under one root after lazy init.
struct FSDPRuntimeContext {
  std::vector<FSDPState*> all_states;  // root first, module pre-order
  ExecOrderData exec_order_data;
  FreeEventQueue free_event_queue;
  // The root's streams, created at lazy init on the root's device (null before).
  std::unique_ptr<FlatParamStreamContext> streams;
  // Set by the first error inside an FSDP hook (a failed or timed-out collective, ...):
  // flat parameters may be unsharded and gradients partially reduced, so every later FSDP
  // call of the tree fails with it (fsdp::FSDPStateBase::Guard / CheckNotPoisoned).
  std::string poisoned_by;
  // End-of-backward callbacks run so far (the step the non-finite sentinel names, from 1).
  int64_t backward_steps = 0;
};

// Attached to its module as a forward hook (fsdp/hooked_module/hooked_module.h); the module's hook
// list owns it.
class FSDPState final : public ::fsdp::FSDPStateBase {
 public:
  // `process_group`: the shard group (hybrid: intra-node); `inter_node_group`: hybrid only.
  // `handle`: null when the module manages no parameters.
  FSDPState(torch::nn::Module* module, FSDPOptions options, comm::ProcessGroupPtr process_group,
            comm::ProcessGroupPtr inter_node_group, std::unique_ptr<FlatParamHandle> handle);
  FSDPState(const FSDPState&) = delete;
  FSDPState& operator=(const FSDPState&) = delete;

  // Around the module's forward: PreForward returns the tensor arguments (moved to the
  // device, cast, autograd-wrapped) in order; PostForward hooks the output tensors.
  std::vector<at::Tensor> PreForward(std::vector<at::Tensor> args) override;
  void PostForward(const std::vector<at::Tensor*>& outputs) override;
  const char* api_name() const override { return "wrap_fsdp"; }

  // _lazy_init: no-op once done; the first state it runs on becomes the root.
  void LazyInit();

  torch::nn::Module* module() const { return module_; }
  FlatParamHandle* handle() const { return handle_.get(); }
  const FSDPOptions& options() const { return options_; }
  ShardingStrategy sharding_strategy() const { return options_.sharding_strategy; }
  const comm::ProcessGroupPtr& process_group() const { return process_group_; }
  const comm::ProcessGroupPtr& inter_node_group() const { return inter_node_group_; }
  std::optional<bool> is_root() const { return is_root_; }
  FSDPTrainingState training_state() const { return training_state_; }
  FSDPRuntimeContext& runtime_ctx() { return *ctx_; }
  const std::vector<FSDPState*>& all_states() const { return ctx_->all_states; }
  bool use_full_prec_in_eval() const { return use_full_prec_in_eval_; }
  // For messages: the module's name relative to the root (after lazy init), else its type.
  std::string name() const;

  // summon_full_params.h: sets the training states, unshards / reshards like the runtime and
  // poisons the tree on failure (Guard).
  friend class SummonFullParams;

  // Set by wrap_fsdp (PyTorch's _ignored_modules / _ignored_params, and the ignored
  // modules' buffers in place of _ignored_buffer_names): this state's and its wrapped
  // descendants' (fsdp_options.h, ignored_modules).
  struct IgnoredStates {
    std::set<const torch::nn::Module*> modules;
    std::vector<at::Tensor> params;
    std::set<const c10::TensorImpl*> param_impls;
    std::set<const c10::TensorImpl*> buffers;
  };
  IgnoredStates ignored;
  // The buffers of the module's tree and their dtypes at wrap time (PyTorch's
  // _buffer_name_to_orig_dtype, _init_buffer_state).
  std::vector<std::pair<at::Tensor, c10::ScalarType>> orig_buffer_dtypes;

  // false inside no_sync(): post-backward keeps unsharded gradients, no communication.
  bool sync_gradients = true;
  CommHook comm_hook;

 private:
  enum class PrefetchMode { BACKWARD, FORWARD };

  // runtime_forward.cc
  std::string& poison_record() const override { return ctx_->poisoned_by; }
  std::vector<at::Tensor> PreForwardImpl(std::vector<at::Tensor> args);
  void PostForwardImpl(const std::vector<at::Tensor*>& outputs);
  void CheckFlatParamsOnExpectedDevice() const;
  void ShareStateAndInitHandleAttrs();
  std::vector<at::Tensor> RootPreForward(std::vector<at::Tensor> args);
  std::vector<at::Tensor> RootCastForwardInput(std::vector<at::Tensor> args) const;
  // buffer_dtype (fsdp_options.h): the root casts the tree's buffers for computation /
  // back to their original dtypes.
  void CastBuffersForComputation();
  void CastBuffersForRootPreForward();
  void PreForwardUnshard();
  void PostForwardReshard();
  void RegisterPreBackwardHooks(const std::vector<at::Tensor*>& outputs);
  std::vector<at::Tensor> RegisterPostBackward(const std::vector<at::Tensor>& args);
  void Unshard(FlatParamHandle& handle);
  void Reshard(FlatParamHandle& handle, bool free_unsharded_flat_param);
  void PrefetchHandle(FlatParamHandle* current, PrefetchMode mode);
  FlatParamHandle* GetHandleToPrefetch(FlatParamHandle& current) const;

  // runtime_backward.cc
  void PreBackwardHook();
  void OnPostBackwardFunction();
  void PostBackwardHook();
  void PostBackwardReshard();
  // FSDPOptions::detect_nonfinite_grads: flags `fp`'s unreduced gradient per original
  // parameter; the root's final callback all-gathers every state's flags and throws on any.
  void FlagNonfiniteGradients(const FlatParameter& fp);
  void CheckNonfiniteGradients();
  bool ShouldFreeInBackward() const;
  void ReduceGrad();
  void RegisterPostBackwardFinalCallback();
  void PostBackwardFinalCallback();
  void CatchAllReshard();
  void FinalizeParams();
  // The root's streams (after lazy init).
  const FlatParamStreams& streams() const;
  // PyTorch's current_stream.wait_stream(post_backward_stream) (+ the all-reduce stream).
  void WaitForPostBackwardStreams();

  torch::nn::Module* module_;
  FSDPOptions options_;
  comm::ProcessGroupPtr process_group_;
  comm::ProcessGroupPtr inter_node_group_;
  std::unique_ptr<FlatParamHandle> handle_;
  std::optional<bool> is_root_;
  FSDPTrainingState training_state_ = FSDPTrainingState::IDLE;
  std::shared_ptr<FSDPRuntimeContext> ctx_;
  bool post_backward_callback_queued_ = false;     // root only
  bool needs_buffer_dtype_restore_check_ = false;  // root only: buffers were cast to full precision
  bool use_full_prec_in_eval_ = false;
  std::string fqn_;  // relative to the root; set at lazy init ("<root>" for the root)
  // Post-backward nodes registered in forward and not yet run in backward (where an
  // original parameter is frozen).
  int pending_post_backward_ = 0;
  // "FullyShardedDataParallel.forward" (PyTorch's wrapper forward): open from the
  // pre-forward hook to the post-forward hook, around the module's own forward.
  std::optional<comm::ProfilerRange> forward_range_;
  // FSDPOptions::detect_nonfinite_grads: one flag per original parameter of the last
  // unreduced gradient (undefined when none was reduced since the last check).
  at::Tensor nonfinite_flags_;
  // A flat parameter whose originals all require grad post-backwards once autograd has
  // accumulated the gradient of each (installed by the first forward, armed by the
  // pre-backward): PyTorch's FSDP1 hooks its flat parameter's AccumulateGrad, whose original
  // parameters are views of it, where ours are leaves of their own.
  GradientCountdown grad_countdown_;
};

// The state wrap_fsdp attached to `module`, or nullptr.
FSDPState* GetState(torch::nn::Module& module);
// The FSDP states of `root`'s module tree (including root), in module pre-order.
std::vector<FSDPState*> CollectStates(torch::nn::Module& root);

}  // namespace fsdp::fsdp1

#endif  // FSDP_FSDP_FSDP1_FSDP_STATE_H_
