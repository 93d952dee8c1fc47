// FSDP2 training on W threaded ranks equals single-rank training (W = 2, 3 with uneven shards,
// 4), and each rank holds only its chunk of every parameter between steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "train.h"

namespace {

class TrainTest : public ::testing::TestWithParam<int> {};

TEST_P(TrainTest, Fsdp2EqualsSingleRank) {
  consumer::TrainConfig config;
  config.world = GetParam();
  config.steps = 10;
  const consumer::TrainResult fsdp = consumer::TrainFsdp2(config);
  const consumer::TrainResult ref = consumer::TrainSingleRank(config);

  const consumer::Comparison c = consumer::Compare(fsdp, ref);
  EXPECT_TRUE(c.problems.empty()) << c.problems.front();
  EXPECT_EQ(fsdp.params.size(), ref.params.size());
  EXPECT_LE(c.max_loss_diff, consumer::ParityTolerance(config));
  EXPECT_LE(c.max_param_diff, consumer::ParityTolerance(config));
  // It trained: the loss went down.
  ASSERT_EQ(ref.losses.size(), 10u);
  EXPECT_LT(ref.losses.back(), 0.8 * ref.losses.front());

  // Sharded: between steps a rank holds at most ceil(dim0 / W) rows of every parameter,
  // and the ranks together hold the whole model.
  ASSERT_EQ(fsdp.local_numel.size(), size_t(config.world));
  for (int64_t n : fsdp.local_numel) {
    EXPECT_LE(n, fsdp.max_chunk_numel);
    EXPECT_LT(n, fsdp.full_numel);
  }
  EXPECT_GE(std::accumulate(fsdp.local_numel.begin(), fsdp.local_numel.end(), int64_t{0}), fsdp.full_numel);
}

INSTANTIATE_TEST_SUITE_P(Worlds, TrainTest, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return "W" + std::to_string(info.param); });

}  // namespace
