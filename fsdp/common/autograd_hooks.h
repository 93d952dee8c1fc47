// The autograd mechanics that replace PyTorch's module / tensor hooks in both FSDPs.
#ifndef FSDP_FSDP_COMMON_AUTOGRAD_HOOKS_H_
#define FSDP_FSDP_COMMON_AUTOGRAD_HOOKS_H_

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

namespace fsdp {

// Routes the tensors of `inputs` that require grad through one identity autograd node
// whose backward calls `callback` once all of their gradients are computed (the module
// consuming them has finished its backward); an output that got no gradient passes zeros
// on, as autograd.Function does. Each replacement shares its input's data and version
// counter and is not an autograd view (in-place changes to it are allowed). Returns `inputs` with those tensors
// replaced; unchanged (no callback) when grad mode is off or none requires grad.
std::vector<at::Tensor> RegisterPostBackwardCallback(const std::vector<at::Tensor>& inputs,
                                                     std::function<void()> callback);

// Runs `callback` each time autograd has accumulated a gradient into the leaf `param`'s
// .grad (PyTorch's Tensor.register_post_accumulate_grad_hook; PyTorch's FSDP1 hooks its flat
// parameter's AccumulateGrad node at that same moment, _register_post_backward_hook in
// torch/distributed/fsdp/_runtime_utils.py): once per backward, after every use of `param`
// in that graph contributed. A hook already installed on `param` keeps running, before this
// one. The hook lives with the tensor, which may outlive whoever installed it: destroying
// this object disarms it (later backwards skip it). Not thread-safe; `callback` runs on the
// autograd engine's thread and its exceptions propagate out of backward().
class PostAccumulateGradCallback {
 public:
  PostAccumulateGradCallback(const at::Tensor& param, std::function<void()> callback);
  ~PostAccumulateGradCallback();
  PostAccumulateGradCallback(const PostAccumulateGradCallback&) = delete;
  PostAccumulateGradCallback& operator=(const PostAccumulateGradCallback&) = delete;

 private:
  std::shared_ptr<std::function<void()>> callback_;
};

// The post-backward trigger of both FSDPs: a PostAccumulateGradCallback on each parameter of
// a group counts one backward's gradients down to `on_all`. Install once; Arm at the group's
// pre-backward (it counts only where every parameter requires grad: a frozen one may still be
// read by the backward after the last gradient arrived, which the count cannot see); Disarm
// when the post-backward runs some other way (the end-of-backward callback). A parameter that
// gets no gradient leaves the count above zero. Not thread-safe (one rank's FSDP state).
class GradientCountdown {
 public:
  GradientCountdown() = default;
  GradientCountdown(const GradientCountdown&) = delete;
  GradientCountdown& operator=(const GradientCountdown&) = delete;

  bool installed() const { return !hooks_.empty(); }
  // Requires !installed() and `params` leaves.
  void Install(std::vector<at::Tensor> params, std::function<void()> on_all);
  // True iff installed and every parameter requires grad.
  bool AllRequireGrad() const;
  // Counts this backward's gradients (disarmed where AllRequireGrad() is false).
  void Arm() { pending_ = AllRequireGrad() ? static_cast<int>(params_.size()) : 0; }
  void Disarm() { pending_ = 0; }

 private:
  void OnGradient();

  std::vector<at::Tensor> params_;
  std::function<void()> on_all_;
  std::vector<std::unique_ptr<PostAccumulateGradCallback>> hooks_;  // last: disarmed first
  int pending_ = 0;
};

// Runs `callback` in every backward once `output`'s gradient is computed, before the node
// that produced `output` runs: what PyTorch's FSDP pre-backward does with Tensor.register_hook
// on module outputs (_fsdp_state.py, _runtime_utils.py in 2.15), as a tensor pre-hook on the
// producing node directly, without the tensor's hook list that register_hook builds each
// forward. Requires `output` to require grad.
void RunWhenGradientComputed(const at::Tensor& output, std::function<void()> callback);

// Queues `callback` on the autograd engine to run once at the end of the current backward
// (call it from inside a backward, e.g. a tensor hook).
void QueueEndOfBackwardCallback(std::function<void()> callback);

}  // namespace fsdp

#endif  // FSDP_FSDP_COMMON_AUTOGRAD_HOOKS_H_
