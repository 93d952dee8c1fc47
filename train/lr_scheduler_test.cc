// The lr schedule against torchtitan's own (train/testdata/golden_lr_schedule.txt, written by
// testing/golden/gen_train.py with torchtitan 0.3.0's LRSchedulersContainer), one test per
// case; then what torchtitan does not check: bad config values and several optimizers.
#include "train/lr_scheduler.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "testing/expect_error.h"
#include "testing/golden_file.h"

namespace fsdp::train {
namespace {

using ::fsdp::testing::GoldenCase;
using ::fsdp::testing::GoldenCaseName;
using ::fsdp::testing::GoldenCases;
using ::fsdp::testing::GoldenFields;
using ::fsdp::testing::GoldenInt;
using ::fsdp::testing::GoldenNum;
using ::fsdp::testing::GoldenNums;

constexpr double kBaseLr = 8e-4;    // the generator's AdamW lr
constexpr int64_t kExtraSteps = 2;  // its steps past training.steps

struct ScheduleCase {
  std::string name;
  int64_t steps = 0;
  LRSchedulerConfig config;
  std::vector<double> lrs;          // after construction, then after each Step (steps + kExtraSteps)
  std::optional<int64_t> error_at;  // the Step (1-based) torchtitan raised at
  int64_t resume_at = 0;            // the last_epoch loaded into a fresh scheduler
  std::vector<double> resumed;      // its last_lrs(), then the lr after each further Step
};

std::vector<ScheduleCase> ReadCases() {
  std::vector<ScheduleCase> cases;
  for (const GoldenFields& f : ::fsdp::testing::ReadGoldenFile("train/testdata/golden_lr_schedule.txt")) {
    if (f[0] == "case") {
      if (f.size() != 8) throw std::runtime_error("a case record has " + std::to_string(f.size()) + " fields");
      ScheduleCase c;
      c.name = f[1];
      c.steps = GoldenInt(f[2]);
      c.config.warmup_steps = GoldenInt(f[3]);
      if (f[4] != "-") c.config.total_steps = GoldenInt(f[4]);
      if (f[5] != "-") c.config.decay_ratio = GoldenNum(f[5]);
      c.config.decay_type = ParseLRDecayType(f[6]);
      c.config.min_lr_factor = GoldenNum(f[7]);
      cases.push_back(std::move(c));
      continue;
    }
    if (cases.empty()) throw std::runtime_error("a '" + f[0] + "' record before any case");
    ScheduleCase& c = cases.back();
    if (f[0] == "lrs" && f.size() == 2) {
      c.lrs = GoldenNums(f[1]);
    } else if (f[0] == "error" && f.size() == 2) {
      c.error_at = GoldenInt(f[1]);
    } else if (f[0] == "resume" && f.size() == 3) {
      c.resume_at = GoldenInt(f[1]);
      c.resumed = GoldenNums(f[2]);
    } else {
      throw std::runtime_error("unknown record '" + f[0] + "' in case " + c.name);
    }
  }
  return cases;
}

// Ours and torchtitan's are the same double operations in the same order (a division, then
// sqrt or cos, a multiply-add, the multiply by the initial lr): sqrt and the arithmetic are
// correctly rounded, glibc's cos (which Python's math.cos calls too) within an ulp, so
// the results agree to a few ulp of the value.
void ExpectLr(double ours, double torchtitan, const std::string& what) {
  EXPECT_NEAR(ours, torchtitan, 4 * DBL_EPSILON * std::abs(torchtitan)) << what;
}

double LrOf(torch::optim::Optimizer& opt) { return opt.param_groups()[0].options().get_lr(); }

class LRScheduleGolden : public ::testing::TestWithParam<GoldenCase<ScheduleCase>> {};

TEST_P(LRScheduleGolden, MatchesTorchtitan) {
  ASSERT_GOLDEN_CASE_LOADED();
  const ScheduleCase& c = *GetParam();
  ASSERT_FALSE(c.lrs.empty());
  torch::nn::Linear model(2, 2);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(kBaseLr));
  LRSchedulers sched({&opt}, WarmupStableDecay(c.config, c.steps));
  ExpectLr(LrOf(opt), c.lrs[0], "after construction");
  for (size_t k = 1; k < c.lrs.size(); ++k) {
    sched.Step();
    ExpectLr(LrOf(opt), c.lrs[k], "after step " + std::to_string(k));
    ExpectLr(sched.last_lrs()[0], c.lrs[k], "last_lrs after step " + std::to_string(k));
  }
  if (c.error_at) {
    ASSERT_EQ(static_cast<int64_t>(c.lrs.size()), *c.error_at) << "torchtitan raised at the step after the last lr";
    EXPECT_ERROR_CONTAINS(sched.Step(), "the lr schedule has no decay steps");
    return;
  }
  ASSERT_EQ(static_cast<int64_t>(c.lrs.size()), c.steps + kExtraSteps + 1);
  torch::optim::AdamW fresh(model->parameters(), torch::optim::AdamWOptions(kBaseLr));
  LRSchedulers resumed({&fresh}, WarmupStableDecay(c.config, c.steps));
  resumed.LoadLastEpoch(c.resume_at);
  EXPECT_EQ(resumed.last_epoch(), c.resume_at);
  ASSERT_EQ(static_cast<int64_t>(c.resumed.size()), c.steps + kExtraSteps - c.resume_at + 1);
  ExpectLr(resumed.last_lrs()[0], c.resumed[0], "last_lrs after loading");
  for (size_t k = 1; k < c.resumed.size(); ++k) {
    resumed.Step();
    ExpectLr(LrOf(fresh), c.resumed[k], "resumed, step " + std::to_string(c.resume_at + static_cast<int64_t>(k)));
  }
}

INSTANTIATE_TEST_SUITE_P(Corpus, LRScheduleGolden,
                         ::testing::ValuesIn(GoldenCases<ScheduleCase>("train/testdata/golden_lr_schedule.txt", 500,
                                                                       ReadCases,
                                                                       [](const ScheduleCase& c) { return c.name; })),
                         GoldenCaseName());

// Every optimizer and param group follows one factor, from its own initial lr (torchtitan's
// container over several optimizers; torch's LambdaLR per group).
TEST(LRSchedulers, EveryGroupOfEveryOptimizerScalesItsOwnLr) {
  torch::nn::Linear a(2, 2), b(3, 1);
  torch::optim::AdamW first(a->parameters(), torch::optim::AdamWOptions(1e-3));
  first.add_param_group(torch::optim::OptimizerParamGroup(
      b->parameters(), std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(3e-2))));
  torch::optim::AdamW second(b->parameters(), torch::optim::AdamWOptions(5e-4));
  LRSchedulerConfig config;
  config.warmup_steps = 4;
  LRSchedulers sched({&first, &second}, WarmupStableDecay(config, 10));
  for (int step = 0; step <= 10; ++step) {
    // Warmup 4 of 10 steps, then linear decay over the other 6, one virtual step at the end.
    const double factor = step < 4 ? (step + 1) / 4.0 : 1.0 - (step + 1 - 5) / 6.0;
    const std::vector<double> want = {1e-3 * factor, 3e-2 * factor, 5e-4 * factor};
    ASSERT_EQ(sched.last_lrs().size(), 3u);
    for (size_t g = 0; g < 3; ++g) {
      EXPECT_NEAR(sched.last_lrs()[g], want[g], 4 * DBL_EPSILON * want[g]) << "step " << step << " group " << g;
    }
    EXPECT_DOUBLE_EQ(first.param_groups()[1].options().get_lr(), sched.last_lrs()[1]);
    EXPECT_DOUBLE_EQ(second.param_groups()[0].options().get_lr(), sched.last_lrs()[2]);
    if (step < 10) sched.Step();
  }
}

TEST(LRSchedulers, BadValuesNameTheirKey) {
  LRSchedulerConfig c;
  c.warmup_steps = -1;
  EXPECT_ERROR_CONTAINS(WarmupStableDecay(c, 10), "lr_scheduler.warmup_steps = -1 is negative");
  c = {};
  c.total_steps = 0;
  EXPECT_ERROR_CONTAINS(WarmupStableDecay(c, 10), "lr_scheduler.total_steps = 0 must be at least 1");
  c = {};
  c.decay_ratio = -0.5;
  EXPECT_ERROR_CONTAINS(WarmupStableDecay(c, 10), "lr_scheduler.decay_ratio = -0.5 must be a number >= 0");
  c.decay_ratio = std::nan("");
  EXPECT_ERROR_CONTAINS(WarmupStableDecay(c, 10), "lr_scheduler.decay_ratio = nan");
  c = {};
  c.min_lr_factor = 1.5;
  EXPECT_ERROR_CONTAINS(WarmupStableDecay(c, 10), "lr_scheduler.min_lr_factor = 1.5 must be in [0, 1]");
  EXPECT_ERROR_CONTAINS(WarmupStableDecay(LRSchedulerConfig{}, 0), "training.steps = 0 must be at least 1");
  EXPECT_ERROR_CONTAINS(ParseLRDecayType("exp"), "lr_scheduler.decay_type = 'exp' is not one of");
  EXPECT_ERROR_CONTAINS(LRSchedulers({}, WarmupStableDecay(LRSchedulerConfig{}, 10)), "no optimizer");
  EXPECT_ERROR_CONTAINS(LRSchedulers({nullptr}, WarmupStableDecay(LRSchedulerConfig{}, 10)), "optimizer 0 is null");
  torch::nn::Linear m(2, 2);
  torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(1e-3));
  LRSchedulers sched({&opt}, WarmupStableDecay(LRSchedulerConfig{}, 10));
  EXPECT_ERROR_CONTAINS(sched.LoadLastEpoch(-2), "last_epoch = -2 is negative");
  for (LRDecayType t : {LRDecayType::kLinear, LRDecayType::kSqrt, LRDecayType::kCosine}) {
    EXPECT_EQ(ParseLRDecayType(LRDecayTypeName(t)), t);
  }
}

}  // namespace
}  // namespace fsdp::train
