// Float8 tensors as torchao's training code builds them (torchao/float8/float8_utils.py,
// float8_scaling_utils.py, float8_training_tensor.py, float8_ops.py): float8 bits with the
// scale they were multiplied by, the casts that make them, and the matmul over two of them.
//
// A Float8Tensor's value is data / scale: data = saturate(hp.float() * scale) in a float8
// dtype, scale = float8_max / max(amax, 1e-12) computed in float64 and stored as float32.
// Tensorwise: scale is 0-D; axiswise (rowwise) along dim d: amax over d, keepdim, so a [M, K]
// tensor scaled along -1 has a [M, 1] scale.
//
// Thread-safety: functions of their arguments only. Errors: c10::Error naming the argument.
#ifndef FSDP_FLOAT8_FLOAT8_TENSOR_H_
#define FSDP_FLOAT8_FLOAT8_TENSOR_H_

#include <ATen/core/Tensor.h>

#include <optional>

#include "comm/process_group.h"
#include "float8/config.h"

namespace fsdp::float8 {

// The smallest amax a scale is computed from (torchao's float8_utils.EPS).
inline constexpr double kAmaxEps = 1e-12;

struct Float8Tensor {
  at::Tensor data;                      // a float8 dtype
  at::Tensor scale;                     // float32: 0-D, or keepdim amax shape along axiswise_dim
  c10::ScalarType orig_dtype;           // the high-precision dtype it stands for (matmul outputs)
  std::optional<int64_t> axiswise_dim;  // 0 or -1; unset: tensorwise

  // The transpose of a 2-D float8 tensor: data and scale transposed, the axis swapped
  // (torchao's float8_transpose).
  Float8Tensor t() const;
  // data / scale in orig_dtype (torchao's to_original_precision).
  at::Tensor ToOriginalPrecision() const;
};

// amax -> scale: float8_max(dtype) / clamp(amax, 1e-12) in float64, as float32; rounded down
// to a power of two when asked (torchao's amax_to_scale).
at::Tensor AmaxToScale(const at::Tensor& amax, c10::ScalarType float8_dtype, bool round_scales_to_power_of_2);

// max |x| over the whole tensor (0-D; 0 for an empty one, e.g. an uneven FSDP shard), or over
// `axiswise_dim` keeping it (torchao's tensor_to_amax without the cross-rank reduction;
// AllReduceAmax is that reduction).
at::Tensor TensorToAmax(const at::Tensor& x, ScalingGranularity granularity, std::optional<int64_t> axiswise_dim);

// The amax over the ranks of `group` (an all-reduce of MAX; collective), for the scale of a
// tensor whose shards the ranks hold.
at::Tensor AllReduceAmax(at::Tensor amax, const comm::ProcessGroupPtr& group);

// hp.float() * scale, saturated to +-float8_max, cast to `float8_dtype`
// (hp_tensor_and_scale_to_float8).
Float8Tensor ToFloat8(const at::Tensor& hp, const at::Tensor& scale, c10::ScalarType float8_dtype,
                      std::optional<int64_t> axiswise_dim);

// The dynamic cast of `hp` by `cast` (hp_tensor_to_float8_dynamic): scale from its amax,
// along `axis` when the granularity is axiswise. `amax_reduce`, when given, turns the local
// amax into the global one (an all-reduce of MAX over the ranks that share the tensor).
template <class AmaxReduce = std::nullptr_t>
Float8Tensor ToFloat8Dynamic(const at::Tensor& hp, const CastConfig& cast, int64_t axis,
                             bool round_scales_to_power_of_2, AmaxReduce&& amax_reduce = nullptr) {
  const std::optional<int64_t> axiswise_dim =
      cast.scaling_granularity == ScalingGranularity::kAxiswise ? std::optional<int64_t>(axis) : std::nullopt;
  at::Tensor amax = TensorToAmax(hp, cast.scaling_granularity, axiswise_dim);
  if constexpr (!std::is_same_v<std::decay_t<AmaxReduce>, std::nullptr_t>) amax = amax_reduce(amax);
  return ToFloat8(hp, AmaxToScale(amax, *cast.target_dtype, round_scales_to_power_of_2), *cast.target_dtype,
                  axiswise_dim);
}

// A high-precision tensor that stands for a float8 one: torchao's float8 tensor-parallel styles
// hand a Float8TrainingTensor inside a DTensor to the float8 linears, which LibTorch cannot
// carry, so the styles (float8_parallel_style.h) pass its dequantized values (data / scale) with
// the float8 tensor recorded beside them, and a float8 linear given such an input or gradient
// uses those bits instead of casting again (torchao's tensor_already_casted_to_fp8). Keyed by
// exactly that tensor (not a view or a result computed from it), weakly held, per thread (as
// tensor_parallel/local_annotation.h).
void AnnotateFloat8(const at::Tensor& hp, Float8Tensor fp8);
std::optional<Float8Tensor> FindFloat8(const at::Tensor& hp);

// a @ b for a [M, K] and b [K, N] float8 tensors, in a.orig_dtype (torchao's float8_mm:
// preprocess_addmm + addmm_float8_unwrapped): a made row-major and b column-major, a tensorwise
// scale repeated to match an axiswise one, at::_scaled_mm with the inverse scales; rowwise
// without fast accumulation runs _scaled_mm unscaled and multiplies the outer product of the
// inverse scales afterwards; float16 / float32 rowwise outputs go through bfloat16 (as
// torchao, _scaled_mm having no float32 rowwise output). `emulate`: mm of the dequantized
// float32 operands instead. `pad_inner_dim`: K zero-padded to a multiple of 16.
at::Tensor Float8Mm(const Float8Tensor& a, const Float8Tensor& b, const GemmConfig& gemm, bool emulate,
                    bool pad_inner_dim);

}  // namespace fsdp::float8

#endif  // FSDP_FLOAT8_FLOAT8_TENSOR_H_
