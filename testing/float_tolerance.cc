#include "testing/float_tolerance.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace fsdp::testing {

double UnitRoundoff(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return std::ldexp(1.0, -24);
    case at::kDouble: return std::ldexp(1.0, -53);
    case at::kBFloat16: return std::ldexp(1.0, -8);
    case at::kHalf: return std::ldexp(1.0, -11);
    default:
      TORCH_CHECK(false, "UnitRoundoff: no unit roundoff for dtype ", dtype,
                  " (float32, float64, bfloat16 and float16 only)");
  }
}

double SummationOrderTolerance(at::ScalarType dtype, int64_t terms) {
  TORCH_CHECK(terms >= 0, "SummationOrderTolerance: terms must be >= 0, got ", terms);
  const double nu = static_cast<double>(terms) * UnitRoundoff(dtype);
  TORCH_CHECK(nu < 1, "SummationOrderTolerance: ", terms, " terms of ", dtype,
              " have no rounding bound (terms * u >= 1)");
  return 2 * nu / (1 - nu);
}

double AdamWParityTolerance(int steps, double lr) { return steps * lr * std::ldexp(1.0, -10); }

}  // namespace fsdp::testing
