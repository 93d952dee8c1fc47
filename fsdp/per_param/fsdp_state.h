// FSDPState: what one fully_shard call attaches to its module: the parameter group and the
// forward / backward hooks, plus the root's lazy initialization (_fsdp_state.py).
#ifndef FSDP_FSDP_PER_PARAM_FSDP_STATE_H_
#define FSDP_FSDP_PER_PARAM_FSDP_STATE_H_

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <vector>

#include "fsdp/common/fsdp_state_base.h"
#include "fsdp/common/hooked_module.h"
#include "fsdp/per_param/fsdp_param_group.h"

namespace fsdp::per_param {

class FSDPState;

// Shared by all states under one root after lazy init.
struct FSDPStateContext {
  std::vector<FSDPState*> all_states;  // root first, then module-tree order
  FSDPState* iter_forward_root = nullptr;
  bool post_backward_final_callback_queued = false;
  bool is_last_backward = true;
  // FSDPModule::set_post_optim_event: the next root pre-forward waits the all-gather
  // streams on it instead of on the compute stream, then clears it (_fsdp_state.py).
  device::EventPtr post_optim_event;
};

// Attached to its module as a forward hook (fsdp/common/hooked_module.h); the module's hook
// list owns it.
class FSDPState final : public ::fsdp::FSDPStateBase {
 public:
  FSDPState(torch::nn::Module* module, MixedPrecisionPolicy mp_policy, bool auto_reshard_after_forward);
  FSDPState(const FSDPState&) = delete;
  FSDPState& operator=(const FSDPState&) = delete;

  // Hooks around the module's forward. PreForward returns the (possibly cast, autograd-
  // wrapped) tensor arguments in order; PostForward rewrites the output tensors in place.
  std::vector<at::Tensor> PreForward(std::vector<at::Tensor> tensor_args) override;
  void PostForward(const std::vector<at::Tensor*>& outputs) override;
  const char* api_name() const override { return "fully_shard"; }

  // Lazy initialization; on the first forward through this state it becomes the root.
  void LazyInit();

  torch::nn::Module* module() const { return module_; }
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

  torch::nn::Module* module_;
  MixedPrecisionPolicy mp_policy_;
  bool auto_reshard_after_forward_;
  std::unique_ptr<FSDPParamGroup> param_group_;
  std::optional<bool> is_root_;
  TrainingState training_state_ = TrainingState::kIdle;
  std::shared_ptr<FSDPStateContext> state_ctx_;
  std::shared_ptr<FSDPCommContext> comm_ctx_;
};

// The FSDP states of `root`'s module tree (including root), in module order.
std::vector<FSDPState*> CollectStates(torch::nn::Module& root);
// The state attached to `module` by fully_shard, or nullptr.
FSDPState* GetState(torch::nn::Module& module);

}  // namespace fsdp::per_param

#endif  // FSDP_FSDP_PER_PARAM_FSDP_STATE_H_
