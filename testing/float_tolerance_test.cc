// The float tolerance helpers against values computed by hand.
#include "testing/float_tolerance.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "testing/expect_error.h"

namespace fsdp::testing {
namespace {

TEST(FloatToleranceTest, UnitRoundoffOfEachDtype) {
  EXPECT_EQ(UnitRoundoff(at::kFloat), std::ldexp(1.0, -24));
  EXPECT_EQ(UnitRoundoff(at::kDouble), std::ldexp(1.0, -53));
  EXPECT_EQ(UnitRoundoff(at::kBFloat16), std::ldexp(1.0, -8));
  EXPECT_EQ(UnitRoundoff(at::kHalf), std::ldexp(1.0, -11));
  // Half of the machine epsilon ATen reports.
  EXPECT_EQ(UnitRoundoff(at::kFloat), std::numeric_limits<float>::epsilon() / 2);
  EXPECT_EQ(UnitRoundoff(at::kDouble), std::numeric_limits<double>::epsilon() / 2);
  EXPECT_ERROR_CONTAINS(UnitRoundoff(at::kLong), "Long");
}

TEST(FloatToleranceTest, SummationOrderToleranceIsTwiceGamma) {
  EXPECT_EQ(SummationOrderTolerance(at::kFloat, 0), 0.0);
  // n = 4, u = 2^-24: 2 * 4u / (1 - 4u) = 2^-21 / (1 - 2^-22).
  EXPECT_DOUBLE_EQ(SummationOrderTolerance(at::kFloat, 4), std::ldexp(1.0, -21) / (1 - std::ldexp(1.0, -22)));
  // n = 8, u = 2^-8: 2 * 2^-5 / (1 - 2^-5) = 2 / 31.
  EXPECT_DOUBLE_EQ(SummationOrderTolerance(at::kBFloat16, 8), 2.0 / 31);
  EXPECT_ERROR_CONTAINS(SummationOrderTolerance(at::kBFloat16, 256), "terms * u >= 1");
  EXPECT_ERROR_CONTAINS(SummationOrderTolerance(at::kFloat, -1), "terms must be >= 0");
}

TEST(FloatToleranceTest, AdamWParityToleranceIsStepsTimesLrTimes2ToMinus10) {
  EXPECT_DOUBLE_EQ(AdamWParityTolerance(1, 1.0), 1.0 / 1024);
  EXPECT_DOUBLE_EQ(AdamWParityTolerance(30, 1e-2), 30 * 1e-2 / 1024);
  // Well below one AdamW step at lr: the bug it guards against.
  EXPECT_LT(AdamWParityTolerance(10, 1e-2), 1e-2 / 100);
}

}  // namespace
}  // namespace fsdp::testing
