// The learning-rate schedule of a training job, as torchtitan's
// (torchtitan/components/optimizer/lr_scheduler.py, LRSchedulersContainer): linear warmup,
// an optional stable phase, then linear / sqrt / cosine decay down to min_lr_factor
// (Warmup-Stable-Decay), applied as torch's LambdaLR applies a factor: each param group's lr
// is its initial lr times the factor of the current step.
//
// Contract: LRSchedulerConfig mirrors torchtitan's `[lr_scheduler]` table field by field,
// with its defaults; WarmupStableDecay validates it (a negative or non-finite value is a
// c10::Error naming the key and the value) and keeps torchtitan's adjustments (warmup steps
// beyond the total are cut to it, so are warmup + decay steps; one virtual step at the end so
// the last step's lr is not 0). LRSchedulers steps one or more optimizers together; its
// checkpoint state is last_epoch only, as torchtitan's state_dict(). Not thread-safe.
#ifndef FSDP_TRAIN_LR_SCHEDULER_H_
#define FSDP_TRAIN_LR_SCHEDULER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace fsdp::train {

enum class LRDecayType { kLinear, kSqrt, kCosine };

// "linear", "sqrt", "cosine" (torchtitan's decay_type values); anything else is a c10::Error
// naming lr_scheduler.decay_type and the value.
LRDecayType ParseLRDecayType(std::string_view name);
const char* LRDecayTypeName(LRDecayType type);

// torchtitan's LRSchedulersContainer.Config.
struct LRSchedulerConfig {
  int64_t warmup_steps = 200;
  std::optional<int64_t> total_steps;  // the schedule's length; training.steps when unset
  std::optional<double> decay_ratio;   // the decay's share of the steps; unset: decay right after warmup
  LRDecayType decay_type = LRDecayType::kLinear;
  double min_lr_factor = 0.0;  // the lr decays to lr * min_lr_factor
};

// The factor of each 0-indexed step.
class WarmupStableDecay {
 public:
  // `training_steps`: training.steps, the length when config.total_steps is unset.
  WarmupStableDecay(const LRSchedulerConfig& config, int64_t training_steps);

  // The lr factor after `step` scheduler steps (0: before the first training step). A step in
  // the decay phase of a schedule without decay steps (past total_steps + 1 when decay_ratio is
  // 0) is a c10::Error, where torchtitan asserts.
  double Factor(int64_t step) const;

  int64_t warmup_steps() const { return warmup_steps_; }
  int64_t stable_steps() const { return stable_steps_; }
  int64_t decay_steps() const { return decay_steps_; }

 private:
  int64_t warmup_steps_, stable_steps_, decay_steps_;
  LRDecayType decay_type_;
  double min_lr_factor_;
};

// torch's LambdaLR over each optimizer with one schedule (torchtitan steps them together).
// Construction records each param group's lr as its initial lr and sets the factor of step 0.
// The optimizers must outlive this object.
class LRSchedulers {
 public:
  LRSchedulers(std::vector<torch::optim::Optimizer*> optimizers, WarmupStableDecay schedule);

  // After a training step: last_epoch + 1, every group's lr = initial lr * Factor(last_epoch).
  void Step();
  int64_t last_epoch() const { return last_epoch_; }
  // Each optimizer's groups' lrs as last computed, optimizer by optimizer (get_last_lr()).
  const std::vector<double>& last_lrs() const { return last_lrs_; }

  // The checkpoint state (torchtitan's state_dict: {"last_epoch": ...}). Loading recomputes
  // last_lrs() and leaves the optimizers' lrs to their own state (as torchtitan's
  // load_state_dict, where the optimizer's checkpoint restores its lr); a negative epoch is a
  // c10::Error.
  void LoadLastEpoch(int64_t last_epoch);

 private:
  std::vector<double> LrsAt(int64_t epoch) const;
  // Every group's lr, in order; they become last_lrs().
  void SetLrs(std::vector<double> lrs);

  std::vector<torch::optim::Optimizer*> optimizers_;
  WarmupStableDecay schedule_;
  std::vector<double> initial_lrs_;  // every group of every optimizer, in order
  std::vector<double> last_lrs_;
  int64_t last_epoch_ = 0;
};

}  // namespace fsdp::train

#endif  // FSDP_TRAIN_LR_SCHEDULER_H_
