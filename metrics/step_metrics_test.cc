// StepMetrics against direct counts: the bytes of the collectives a step issued, an
// allocation the step made, tokens/s and MFU from the step's own time, and torchtitan's
// FLOPs-per-token formula.
#include "metrics/step_metrics.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "absl/strings/match.h"
#include "comm/fake_process_group.h"
#include "comm/process_group.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::metrics {
namespace {

TEST(StepMetrics, CountsTheStepsCollectiveBytesPeakAndRates) {
  testing::RunOnRanks(testing::Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    StepMetrics m({.rank = pg->rank(),
                   .tokens_per_step = 1000,
                   .flops_per_token = 6e6,
                   .peak_flops = 1e12,
                   .predicted_peak_bytes = 3 << 20});
    at::Tensor shard = at::ones({2, 3}), full = at::empty({4, 3});
    at::Tensor d = at::ones({5}, at::kDouble);
    pg->all_reduce(d)->wait();  // before the step: not counted
    m.BeginStep();
    pg->all_gather_into_tensor(full, shard)->wait();  // output: 12 floats
    pg->reduce_scatter_tensor(shard, full)->wait();   // input: 12 floats
    pg->all_reduce(d)->wait();                        // 5 doubles
    pg->broadcast(d, 0)->wait();                      // 5 doubles
    const int64_t kAllocated = 1 << 20;
    at::Tensor big = at::empty({kAllocated}, at::kByte);
    big.fill_(1);
    const StepReport& r = m.EndStep();
    EXPECT_EQ(r.step, 0);
    EXPECT_EQ(r.traffic.all_gather, 12 * 4);
    EXPECT_EQ(r.traffic.reduce_scatter, 12 * 4);
    EXPECT_EQ(r.traffic.all_reduce, 5 * 8);
    EXPECT_EQ(r.traffic.broadcast, 5 * 8);
    EXPECT_EQ(r.traffic.all_to_all, 0);
    EXPECT_GE(r.peak_bytes, kAllocated) << "the step held a 1 MiB tensor";
    ASSERT_GT(r.seconds, 0);
    EXPECT_DOUBLE_EQ(r.tokens_per_second, 1000 / r.seconds);
    EXPECT_DOUBLE_EQ(r.mfu, 1000 * 6e6 / r.seconds / 1e12);
    const std::string line = m.Format(r);
    for (const char* part : {"step 0: ", " tokens/s", "MFU ", "of 1.0 TFLOP/s", "peak CPU ", "(model 3.0 MiB)",
                             "all-gather 48 B", "reduce-scatter 48 B", "all-reduce 40 B"}) {
      EXPECT_TRUE(absl::StrContains(line, part)) << part << " not in: " << line;
    }
    m.BeginStep();
    EXPECT_EQ(m.EndStep().traffic.all_gather, 0) << "a step without collectives";
  });
}

TEST(StepMetrics, WithoutTokensOrPeakNoRates) {
  StepMetrics m({});
  m.BeginStep();
  const StepReport& r = m.EndStep();
  EXPECT_EQ(r.tokens_per_second, -1);
  EXPECT_EQ(r.mfu, -1);
  EXPECT_FALSE(absl::StrContains(m.Format(r), "tokens/s"));
  EXPECT_FALSE(absl::StrContains(m.Format(r), "MFU"));
}

TEST(StepMetrics, BadUseIsAnError) {
  EXPECT_ERROR_CONTAINS(StepMetrics({.rank = -1}), "rank must be >= 0, got -1");
  EXPECT_ERROR_CONTAINS(StepMetrics({.tokens_per_step = -5}), "tokens_per_step must be >= 0, got -5");
  EXPECT_ERROR_CONTAINS(StepMetrics({.peak_flops = -1}), "peak_flops must be >= 0, got -1");
  EXPECT_ERROR_CONTAINS(StepMetrics({.print_every = -2}), "print_every must be >= 0, got -2");
  EXPECT_ERROR_CONTAINS(StepMetrics({.device = c10::Device(c10::kMeta)}), "device must be cpu or cuda, got meta");
  StepMetrics m({});
  EXPECT_ERROR_CONTAINS(m.EndStep(), "no step began");
  m.BeginStep();
  EXPECT_ERROR_CONTAINS(m.BeginStep(), "step 0 has not ended");
  EXPECT_ERROR_CONTAINS(MeasureMatmulPeakFlops(3), "n must be in [16, 8192], got 3");
  EXPECT_ERROR_CONTAINS(DecoderFlopsPerToken(-1, 1, 1, 1, 1), "arguments must be >= 0");
}

TEST(StepMetrics, DecoderFlopsPerTokenIsTorchtitansFormula) {
  // 6 per non-embedding parameter + 12 * layers * heads * head_dim * seq_len.
  EXPECT_EQ(DecoderFlopsPerToken(1000, 2, 4, 8, 16), 6 * 1000 + 12 * 2 * 4 * 8 * 16);
  EXPECT_GT(MeasureMatmulPeakFlops(64), 0);
}

}  // namespace
}  // namespace fsdp::metrics
