// Gradient divide factors shared by both FSDPs.
#ifndef FSDP_FSDP_COMMON_GRAD_DIVIDE_H_
#define FSDP_FSDP_COMMON_GRAD_DIVIDE_H_

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cmath>
#include <cstdint>
#include <cstring>

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

// Divides data[0, n) by d in 16-byte vectors (GCC / Clang vector extensions: one `divps` /
// `divpd` per 4 floats / 2 doubles, each lane an IEEE division, so the same bits as the
// scalar loop, which GCC does not vectorize at -O2), the tail one by one.
template <typename T>
inline void DivideContiguous(T* data, int64_t n, T d) {
  typedef T Vec __attribute__((vector_size(16)));
  constexpr int64_t kLanes = 16 / sizeof(T);
  const Vec divisor = Vec{} + d;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Vec v;
    std::memcpy(&v, data + i, sizeof(v));
    v /= divisor;
    std::memcpy(data + i, &v, sizeof(v));
  }
  for (; i < n; ++i) data[i] /= d;
}

// t.div_(divisor), with the same result bit for bit (each element divided by the divisor
// cast to t's dtype, IEEE division: what ATen's div_true_kernel computes for float and
// double), by a plain loop for contiguous CPU float / double tensors: ATen's div_ costs more
// in dispatch and TensorIterator set-up per call than dividing a layer's gradient
// (docs/design/measured-choices.md). Other tensors go to div_. Bumps the version as div_ does.
inline void DivideInPlace(const at::Tensor& t, double divisor) {
  if (t.is_cpu() && t.is_contiguous() && !t.requires_grad() && !t.is_conj() && !t.is_neg()) {
    if (t.scalar_type() == c10::kFloat) {
      DivideContiguous(t.data_ptr<float>(), t.numel(), static_cast<float>(divisor));
    } else if (t.scalar_type() == c10::kDouble) {
      DivideContiguous(t.data_ptr<double>(), t.numel(), divisor);
    } else {
      t.div_(divisor);
      return;
    }
    t.unsafeGetTensorImpl()->bump_version();
    return;
  }
  t.div_(divisor);
}

}  // namespace fsdp

#endif  // FSDP_FSDP_COMMON_GRAD_DIVIDE_H_
