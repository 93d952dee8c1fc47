// FSDPState: what one fully_shard call attaches to its module: the parameter group and the
// forward / backward hooks, plus the root's lazy initialization (_fsdp_state.py).
#ifndef FSDP_FSDP_FSDP2_FSDP_STATE_H_
#define FSDP_FSDP_FSDP2_FSDP_STATE_H_

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/common/fsdp_state_base.h"
#include "fsdp/fsdp2/fsdp_param_group.h"
#include "fsdp/hooked_module/hooked_module.h"

namespace fsdp::fsdp2 {

class FSDPState;

// Shared by all states under one root after lazy init.
struct FSDPStateContext {
  std::vector<FSDPState*> all_states;  // root first, then module-tree order
  FSDPState* iter_forward_root = nullptr;
  bool post_backward_final_callback_queued = false;
  bool is_last_backward = true;
  // FSDPModule::set_manual_backward_finalization: no backward finalizes; the caller's
  // finalize_backward() does (supersedes is_last_backward, as PyTorch 2.15).
  bool manual_backward_finalization = false;
  // FSDPModule::set_post_optim_event: the next root pre-forward waits the all-gather
  // streams on it instead of on the compute stream, then clears it (_fsdp_state.py).
  device::EventPtr post_optim_event;
  // End-of-backward callbacks run so far (the step the non-finite sentinel names, from 1).
  int64_t backward_steps = 0;
};

// Attached to its module as a forward hook (fsdp/hooked_module/hooked_module.h); the module's hook
// list owns it.
class FSDPState final : public ::fsdp::FSDPStateBase {
 public:
  FSDPState(torch::nn::Module* module, MixedPrecisionPolicy mp_policy, bool auto_reshard_after_forward);
  // One state for the modules of fully_shard(list) (PyTorch's FSDPState.init with several
  // modules): one parameter group, attached to each module through an FSDPGroupMemberHook.
  FSDPState(std::vector<torch::nn::Module*> modules, MixedPrecisionPolicy mp_policy, bool auto_reshard_after_forward);
  FSDPState(const FSDPState&) = delete;
  FSDPState& operator=(const FSDPState&) = delete;

  // Hooks around the module's forward. PreForward returns the (possibly cast, autograd-
  // wrapped) tensor arguments in order; PostForward rewrites the output tensors in place.
  std::vector<at::Tensor> PreForward(std::vector<at::Tensor> tensor_args) override;
  void PostForward(const std::vector<at::Tensor*>& outputs) override;
  const char* api_name() const override { return "fully_shard"; }

  // The hooks of module `module` of a fully_shard(list) group (PyTorch's
  // _register_group_forward_hooks, _fsdp_state.py): the first of the listed modules to run
  // forward in a pass fills modules_to_run with all of them and runs PreForward (unshard,
  // root pre-forward); a later one only waits for the unshard. Each module's post-forward
  // removes it from modules_to_run; the one that empties it runs the full PostForward
  // (reshard, pre-backward hook on its output); the others only cast the output dtype. A
  // module that never runs leaves the group incomplete: the iteration's forward root
  // completes it in its own post-forward (_force_complete_incomplete_states).
  std::vector<at::Tensor> GroupPreForward(torch::nn::Module* module, std::vector<at::Tensor> tensor_args);
  void GroupPostForward(torch::nn::Module* module, const std::vector<at::Tensor*>& outputs);

  // Lazy initialization; on the first forward through this state it becomes the root.
  void LazyInit();
  // FSDPModule::finalize_backward on the root: every group's post-backward with the current
  // settings (the reduce-scatter of the gradients accumulated since the last one), then the
  // end-of-backward work. A no-op before the root's first forward.
  void FinalizeBackwardManually();

  // The first module (the only one unless fully_shard was given a list).
  torch::nn::Module* module() const { return module_; }
  // Every module this state serves (fully_shard(list): the list's root modules, in order).
  const std::vector<torch::nn::Module*>& modules() const { return modules_; }
  // The group modules still to run forward in this pass (empty when no pass is open).
  const std::vector<torch::nn::Module*>& modules_to_run_forward() const { return modules_to_run_forward_; }
  FSDPParamGroup* param_group() const { return param_group_.get(); }
  void set_param_group(std::unique_ptr<FSDPParamGroup> group) { param_group_ = std::move(group); }
  std::optional<bool> is_root() const { return is_root_; }
  FSDPStateContext& state_ctx() { return *state_ctx_; }
  FSDPCommContext& comm_ctx() { return *comm_ctx_; }
  TrainingState training_state() const { return training_state_; }

  std::vector<FSDPState*> states_to_forward_prefetch;
  std::vector<FSDPState*> states_to_backward_prefetch;

 private:
  std::string& poison_record() const override { return comm_ctx_->poisoned_by; }
  std::vector<at::Tensor> PreForwardImpl(std::vector<at::Tensor> tensor_args);
  void PostForwardImpl(const std::vector<at::Tensor*>& outputs);
  void RootPreForward();
  void PreBackward();
  void RegisterRootPostBackwardFinalCallback();
  void RootPostBackwardFinalCallback();
  // FullyShardOptions::detect_nonfinite_grads: all-gathers the groups' flags, throws on any.
  void CheckNonfiniteGradients();
  void RegisterPreBackwardHooks(const std::vector<at::Tensor*>& outputs);
  void CastOutputs(const std::vector<at::Tensor*>& outputs) const;
  void ForceCompleteIncompleteStates(const std::vector<at::Tensor*>& outputs);
  // A list group cannot be the root ("FSDP requires a single root module").
  void CheckSingleRootModule() const;

  torch::nn::Module* module_;
  std::vector<torch::nn::Module*> modules_;
  std::vector<torch::nn::Module*> modules_to_run_forward_;
  MixedPrecisionPolicy mp_policy_;
  bool auto_reshard_after_forward_;
  std::unique_ptr<FSDPParamGroup> param_group_;
  std::optional<bool> is_root_;
  TrainingState training_state_ = TrainingState::kIdle;
  std::shared_ptr<FSDPStateContext> state_ctx_;
  std::shared_ptr<FSDPCommContext> comm_ctx_;
};

// What fully_shard(list) attaches to each of the listed modules: its forward hooks tell the
// shared state which module ran (a ForwardHook is not told its module). An FSDPStateBase, so
// that FSDP1 and a second fully_shard see the module as taken; the state owns nothing of the
// module, the hooks own the state together.
class FSDPGroupMemberHook final : public ::fsdp::FSDPStateBase {
 public:
  FSDPGroupMemberHook(std::shared_ptr<FSDPState> state, torch::nn::Module* module)
      : FSDPStateBase("parameters"), state_(std::move(state)), module_(module) {}
  std::vector<at::Tensor> PreForward(std::vector<at::Tensor> args) override {
    return state_->GroupPreForward(module_, std::move(args));
  }
  void PostForward(const std::vector<at::Tensor*>& outputs) override { state_->GroupPostForward(module_, outputs); }
  const char* api_name() const override { return "fully_shard"; }
  FSDPState* state() const { return state_.get(); }

 private:
  std::string& poison_record() const override { return state_->comm_ctx().poisoned_by; }
  std::shared_ptr<FSDPState> state_;
  torch::nn::Module* module_;
};

// The FSDP states of `root`'s module tree (including root), in module order, each once (a
// fully_shard(list) state serves several modules).
std::vector<FSDPState*> CollectStates(torch::nn::Module& root);
// The state attached to `module` by fully_shard (directly, or through an FSDPGroupMemberHook
// for fully_shard(list)), or nullptr.
FSDPState* GetState(torch::nn::Module& module);

}  // namespace fsdp::fsdp2

#endif  // FSDP_FSDP_FSDP2_FSDP_STATE_H_
