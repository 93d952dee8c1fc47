#include "train/lr_scheduler.h"

#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <numbers>
#include <utility>

namespace fsdp::train {

LRDecayType ParseLRDecayType(std::string_view name) {
  if (name == "linear") return LRDecayType::kLinear;
  if (name == "sqrt") return LRDecayType::kSqrt;
  if (name == "cosine") return LRDecayType::kCosine;
  TORCH_CHECK(false, "lr_scheduler.decay_type = '", name, "' is not one of 'linear', 'sqrt', 'cosine'");
}

const char* LRDecayTypeName(LRDecayType type) {
  switch (type) {
    case LRDecayType::kLinear: return "linear";
    case LRDecayType::kSqrt: return "sqrt";
    case LRDecayType::kCosine: return "cosine";
  }
  return "?";
}

// torchtitan's LRSchedulersContainer.Config.build: the phase lengths, with its adjustments.
WarmupStableDecay::WarmupStableDecay(const LRSchedulerConfig& config, int64_t training_steps)
    : decay_type_(config.decay_type), min_lr_factor_(config.min_lr_factor) {
  TORCH_CHECK(training_steps >= 1, "training.steps = ", training_steps, " must be at least 1");
  TORCH_CHECK(!config.total_steps || *config.total_steps >= 1, "lr_scheduler.total_steps = ", *config.total_steps,
              " must be at least 1");
  TORCH_CHECK(config.warmup_steps >= 0, "lr_scheduler.warmup_steps = ", config.warmup_steps, " is negative");
  TORCH_CHECK(!config.decay_ratio || (std::isfinite(*config.decay_ratio) && *config.decay_ratio >= 0),
              "lr_scheduler.decay_ratio = ", *config.decay_ratio, " must be a number >= 0");
  // Outside [0, 1] the lr would rise while decaying, or turn negative (which AdamW refuses).
  TORCH_CHECK(std::isfinite(config.min_lr_factor) && config.min_lr_factor >= 0 && config.min_lr_factor <= 1,
              "lr_scheduler.min_lr_factor = ", config.min_lr_factor, " must be in [0, 1]");
  const int64_t total = config.total_steps.value_or(training_steps);
  warmup_steps_ = std::min(config.warmup_steps, total);
  if (config.decay_ratio) {
    // Python's round(): to nearest, ties to even, as nearbyint in the default rounding mode.
    decay_steps_ = static_cast<int64_t>(std::nearbyint(static_cast<double>(total) * *config.decay_ratio));
    decay_steps_ = std::min(decay_steps_, total - warmup_steps_);
  } else {
    decay_steps_ = total - warmup_steps_;
  }
  // One virtual step past the end, so that the last step's lr is not 0.
  stable_steps_ = total + 1 - warmup_steps_ - decay_steps_;
}

double WarmupStableDecay::Factor(int64_t step) const {
  TORCH_CHECK(step >= 0, "WarmupStableDecay::Factor: step ", step, " is negative");
  const int64_t warmup_stable = warmup_steps_ + stable_steps_;
  if (step < warmup_steps_) return static_cast<double>(step + 1) / static_cast<double>(warmup_steps_);
  if (step < warmup_stable) return 1.0;
  TORCH_CHECK(decay_steps_ != 0, "the lr schedule has no decay steps, but step ", step,
              " is past its warmup and stable steps (", warmup_stable,
              "): set lr_scheduler.decay_ratio or total_steps");
  const double progress = static_cast<double>(step + 1 - warmup_stable) / static_cast<double>(decay_steps_);
  double adjustment = 0;
  switch (decay_type_) {
    case LRDecayType::kLinear: adjustment = 1 - progress; break;
    case LRDecayType::kSqrt: adjustment = 1 - std::sqrt(progress); break;
    case LRDecayType::kCosine: adjustment = 0.5 * (1.0 + std::cos(std::numbers::pi * progress)); break;
  }
  return min_lr_factor_ + (1 - min_lr_factor_) * adjustment;
}

LRSchedulers::LRSchedulers(std::vector<torch::optim::Optimizer*> optimizers, WarmupStableDecay schedule)
    : optimizers_(std::move(optimizers)), schedule_(schedule) {
  TORCH_CHECK(!optimizers_.empty(), "LRSchedulers: no optimizer to schedule");
  for (size_t k = 0; k < optimizers_.size(); ++k) {
    TORCH_CHECK(optimizers_[k] != nullptr, "LRSchedulers: optimizer ", k, " is null");
    for (auto& group : optimizers_[k]->param_groups()) initial_lrs_.push_back(group.options().get_lr());
  }
  // LambdaLR's initial step: epoch 0.
  SetLrs(LrsAt(0));
}

std::vector<double> LRSchedulers::LrsAt(int64_t epoch) const {
  const double factor = schedule_.Factor(epoch);
  std::vector<double> lrs;
  lrs.reserve(initial_lrs_.size());
  for (double lr : initial_lrs_) lrs.push_back(lr * factor);
  return lrs;
}

void LRSchedulers::SetLrs(std::vector<double> lrs) {
  size_t i = 0;
  for (auto* opt : optimizers_) {
    for (auto& group : opt->param_groups()) {
      TORCH_CHECK(i < lrs.size(), "LRSchedulers: a param group was added after the scheduler was made");
      group.options().set_lr(lrs[i++]);
    }
  }
  last_lrs_ = std::move(lrs);
}

void LRSchedulers::Step() {
  SetLrs(LrsAt(last_epoch_ + 1));
  ++last_epoch_;
}

void LRSchedulers::LoadLastEpoch(int64_t last_epoch) {
  TORCH_CHECK(last_epoch >= 0, "LRSchedulers: last_epoch = ", last_epoch, " is negative");
  last_lrs_ = LrsAt(last_epoch);
  last_epoch_ = last_epoch;
}

}  // namespace fsdp::train
