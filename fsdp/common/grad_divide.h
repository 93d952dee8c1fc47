// Gradient divide factors shared by both FSDPs.
#ifndef FSDP_FSDP_COMMON_GRAD_DIVIDE_H_
#define FSDP_FSDP_COMMON_GRAD_DIVIDE_H_

#include <cmath>

namespace fsdp {

// DefaultState._get_gradient_predivide_factor: the largest power of two `pre` reached by
// doubling from 1 while data_parallel_size is divisible by it and size / pre > pre, so
// gradients are divided by ~sqrt(size) before the sum and by size / pre after it (neither
// the summands nor the sum leave a low-precision dtype's range). 1 -> 1, 2 -> 2, 4 -> 2,
// 8 -> 4, 16 -> 4, 3 -> 2.
inline double GradientPredivideFactor(double data_parallel_size) {
  double pre = 1;
  while (std::fmod(data_parallel_size, pre) == 0 && data_parallel_size / pre > pre) pre *= 2;
  return pre;
}

}  // namespace fsdp

#endif  // FSDP_FSDP_COMMON_GRAD_DIVIDE_H_
