// The gradient divide helpers: PyTorch's predivide factors, and DivideInPlace giving
// Tensor::div_'s result bit for bit.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "fsdp/common/grad_divide.h"

namespace fsdp {
namespace {

TEST(GradientPredivideFactor, MatchesPyTorchsDoubling) {
  // PyTorch 2.15's DefaultState._get_gradient_predivide_factor
  // (torch/distributed/algorithms/_comm_hooks/default_hooks.py), printed by the peer venv.
  const std::pair<double, double> cases[] = {{1, 1}, {2, 2}, {3, 2}, {4, 2}, {6, 4}, {8, 4}, {16, 4}, {32, 8}};
  for (auto [size, pre] : cases) EXPECT_EQ(GradientPredivideFactor(size), pre) << size;
}

TEST(DivideInPlace, IsDivBitForBit) {
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    for (double divisor : {2.0, 3.0, 7.0, 0.1, 1e-30}) {
      // Whole 16-byte vectors, a tail of 1-3 elements, fewer elements than one vector; the
      // extremes of the dtype's range (infinities, subnormals, zeros of both signs).
      for (int64_t n : {1000, 1003, 3}) {
        at::Tensor data = (at::randn({n}, at::kDouble) * 1e3).to(dtype);
        if (dtype == at::kFloat || dtype == at::kDouble) {
          const double tiny = dtype == at::kFloat ? 1e-40 : 1e-310;
          const double values[] = {INFINITY, -INFINITY, tiny, -tiny, 0.0, -0.0};
          for (int64_t i = 0; i < std::min<int64_t>(n, 6); ++i) data[i] = values[i];
        }
        at::Tensor ours = data.clone();
        const at::Tensor reference = data.clone().div_(divisor);
        const int64_t version = ours._version();
        DivideInPlace(ours, divisor);
        // Bitwise (at::equal would call -0.0 and 0.0 equal).
        const at::Tensor ours_bits = ours.view(dtype == at::kDouble  ? at::kLong
                                               : dtype == at::kFloat ? at::kInt
                                                                     : at::kShort);
        const at::Tensor reference_bits = reference.view(dtype == at::kDouble  ? at::kLong
                                                         : dtype == at::kFloat ? at::kInt
                                                                               : at::kShort);
        EXPECT_TRUE(at::equal(ours_bits, reference_bits)) << dtype << " / " << divisor << ", " << n << " elements";
        EXPECT_GT(ours._version(), version);
      }
    }
  }
  // Non-contiguous tensors go through div_.
  const at::Tensor base = at::randn({8, 8});
  at::Tensor column = base.clone().select(1, 3);
  const at::Tensor reference = column.clone().div_(3.0);
  DivideInPlace(column, 3.0);
  EXPECT_TRUE(at::equal(column, reference));
}

}  // namespace
}  // namespace fsdp
