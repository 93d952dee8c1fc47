// Float tolerances for tests, each derived from an argument rather than from what one machine
// happened to produce. CI machines differ (AVX2 vs AVX-512 kernels change ATen's summation order;
// cuBLAS picks its reduction order by shape), so a test comparing two computations that may round
// differently allows what the argument says two legitimate orders can differ by:
//   - UnitRoundoff: the dtype's unit roundoff u (half its machine epsilon).
//   - SummationOrderTolerance: two summation orders of n terms, from Higham's bound.
//   - AdamWParityTolerance: AdamW training runs summing their gradients in different orders.
// Each stays well below the bug it guards against (a wrong shard, a lost gradient, a stale parameter).
#ifndef FSDP_TESTING_FLOAT_TOLERANCE_H_
#define FSDP_TESTING_FLOAT_TOLERANCE_H_

#include <ATen/ATen.h>

#include <cstdint>

namespace fsdp::testing {

// The unit roundoff u of `dtype`: 2^-24 for float32, 2^-53 for float64, 2^-8 for bfloat16, 2^-11 for
// float16 (half the distance from 1 to the next number). TORCH_CHECK error naming the dtype otherwise.
double UnitRoundoff(at::ScalarType dtype);

// The largest relative difference, relative to sum |x_i|, between two summation orders of `terms`
// terms in `dtype`: each differs from the exact sum by at most gamma(terms) * sum |x_i|, where
// gamma(n) = n u / (1 - n u) (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.4),
// so the two by at most 2 gamma(terms). TORCH_CHECK error when terms < 0 or terms * u >= 1.
double SummationOrderTolerance(at::ScalarType dtype, int64_t terms);

// The parity tolerance, relative to max(1, |reference|), of float32 AdamW training after `steps`
// steps at learning rate `lr`: steps * lr * 2^-10. AdamW moves a parameter by about lr per step
// whatever the gradient's scale (lr * m / sqrt(v)), so by at most about steps * lr in all. Two
// legitimate summation orders (FSDP's per-rank means reduce-scattered vs one rank's whole-batch mean;
// AVX2 vs AVX-512 kernels) round differently by some float32 ulps of a step per step, and AdamW makes
// that visible where a gradient element is near zero. Allowed: 2^-10 of the total movement (2^13 ulps
// of it, float32's epsilon being 2^-23) for that rounding to compound through the network. A wrong
// shard, a lost gradient or a stale parameter is off by a whole step (lr) from the first step.
double AdamWParityTolerance(int steps, double lr);

}  // namespace fsdp::testing

#endif  // FSDP_TESTING_FLOAT_TOLERANCE_H_
