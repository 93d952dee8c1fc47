// What the trainer's tests share (trainer_test.cc, trainer_resume_test.cc,
// trainer_device_test.cc): the small job on
// the shipped corpus, a run of it on threaded ranks, and the tolerance a run on a mesh is held
// to against one rank.
#ifndef FSDP_TRAIN_TRAINER_TEST_SUPPORT_H_
#define FSDP_TRAIN_TRAINER_TEST_SUPPORT_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/process_group.h"
#include "testing/multi_rank.h"
#include "train/config.h"
#include "train/trainer.h"

namespace fsdp::train::test_support {

// A small job on the shipped corpus: float32 (so that the comparisons see reduction order,
// not bf16 rounding), 6 steps with warmup and decay.
inline constexpr int64_t kSteps = 6;
inline JobConfig SmallJob(const std::vector<std::string>& overrides) {
  std::vector<std::string> args = {"--model.dim=64",
                                   "--model.n_layers=2",
                                   "--model.n_heads=4",
                                   "--model.n_kv_heads=2",
                                   "--training.seq_len=32",
                                   "--training.global_batch_size=8",
                                   "--training.local_batch_size=2",
                                   absl::StrCat("--training.steps=", kSteps),
                                   "--training.mixed_precision_param=float32",
                                   "--activation_checkpoint.mode=none",
                                   "--lr_scheduler.warmup_steps=2",
                                   "--lr_scheduler.decay_ratio=0.5",
                                   "--debug.seed=5",
                                   "--dataloader.dataset_path=train/testdata/corpus/train"};
  args.insert(args.end(), overrides.begin(), overrides.end());
  return ParseConfig("", "test", ParseCommandLine(args).overrides);
}

inline std::vector<StepResult> Train(int world_size, const std::vector<std::string>& overrides) {
  const JobConfig config = SmallJob(overrides);
  std::vector<std::vector<StepResult>> per_rank(world_size);
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, world_size, [&](const comm::ProcessGroupPtr& pg) {
    Trainer trainer(config, pg);
    for (int64_t s = 0; s < kSteps; ++s) per_rank[pg->rank()].push_back(trainer.Step());
  });
  for (int r = 1; r < world_size; ++r) {  // every rank reports the same global step
    for (int64_t s = 0; s < kSteps; ++s) {
      EXPECT_EQ(per_rank[r][s].loss, per_rank[0][s].loss) << "rank " << r << " step " << s;
      EXPECT_EQ(per_rank[r][s].grad_norm, per_rank[0][s].grad_norm) << "rank " << r << " step " << s;
    }
  }
  return per_rank[0];
}

inline double MaxRelDiff(const std::vector<StepResult>& a, const std::vector<StepResult>& b,
                         double StepResult::*field) {
  double d = 0;
  for (size_t s = 0; s < a.size(); ++s) d = std::max(d, std::abs(a[s].*field - b[s].*field) / std::abs(b[s].*field));
  return d;
}

// The loss's tolerance is measured, not guessed: the one-rank run against itself with each
// batch taken in two micro-batches (another legitimate order of the same float32 sums) gives
// the spread that summation order alone causes on this machine's kernels; a sharded run sums
// in yet another order, so it must lie within a few such spreads (4x, plus 64 float32 ulps for
// a spread that happens to be tiny). The gradient norm is computed in float32 by torch's norm
// kernels over each rank's shards (as torch.nn.utils.clip_grad_norm_ computes it): its
// rounding grows with the elements summed, sqrt(n) ulps for n of them (a random walk of n
// roundings), n = the largest gradient's, lm_head's 2048 x 64. A wrong shard, a missed
// reduction or a wrong loss scale moves either by 1e-3 or more.
struct Tolerances {
  std::vector<StepResult> reference;  // one rank
  double spread = 0, loss = 0, norm = 0;
};
inline const Tolerances& MeshTolerances() {
  static const Tolerances t = [] {
    constexpr double kEps = std::numeric_limits<float>::epsilon();
    Tolerances t;
    t.reference = Train(1, {"--training.local_batch_size=8"});
    t.spread = MaxRelDiff(Train(1, {"--training.local_batch_size=4"}), t.reference, &StepResult::loss);  // accum 2
    t.loss = 4 * t.spread + 64 * kEps;
    t.norm = 4 * t.spread + std::sqrt(2048.0 * 64.0) * kEps;
    return t;
  }();
  return t;
}

}  // namespace fsdp::train::test_support

#endif  // FSDP_TRAIN_TRAINER_TEST_SUPPORT_H_
