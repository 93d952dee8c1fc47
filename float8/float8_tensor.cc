#include "float8/float8_tensor.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <utility>

#include "absl/container/flat_hash_map.h"

namespace fsdp::float8 {
namespace {

using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// The float8 tensors high-precision ones stand for, by TensorImpl address; the weak pointer
// tells a live tensor from a new one at a reused address. Pruned as it grows.
absl::flat_hash_map<const c10::TensorImpl*, std::pair<WeakTensor, Float8Tensor>>& Float8Annotations() {
  thread_local absl::flat_hash_map<const c10::TensorImpl*, std::pair<WeakTensor, Float8Tensor>> map;
  return map;
}
constexpr size_t kPruneAnnotationsAbove = 256;

bool IsRowMajor(at::IntArrayRef stride) { return stride[0] > stride[1] && stride[1] == 1; }

int64_t RoundUp16(int64_t n) { return (n + 15) / 16 * 16; }

}  // namespace

Float8Tensor Float8Tensor::t() const {
  TORCH_CHECK(data.dim() == 2, "Float8Tensor::t needs a 2-D tensor, got ", data.dim(), " dims");
  std::optional<int64_t> axis = axiswise_dim;
  if (axis) axis = *axis == 0 ? -1 : 0;
  return Float8Tensor{data.t(), scale.dim() == 2 ? scale.t() : scale, orig_dtype, axis};
}

at::Tensor Float8Tensor::ToOriginalPrecision() const { return data.to(orig_dtype) / scale; }

void AnnotateFloat8(const at::Tensor& hp, Float8Tensor fp8) {
  TORCH_CHECK(hp.defined() && fp8.data.defined(), "AnnotateFloat8: undefined tensor");
  TORCH_CHECK(hp.sizes() == fp8.data.sizes(), "AnnotateFloat8: the high-precision tensor's shape ", hp.sizes(),
              " differs from the float8 tensor's ", fp8.data.sizes());
  auto& map = Float8Annotations();
  if (map.size() >= kPruneAnnotationsAbove) {
    absl::erase_if(map, [](const auto& item) { return item.second.first.expired(); });
  }
  map.insert_or_assign(hp.unsafeGetTensorImpl(), std::pair(WeakTensor(hp.getIntrusivePtr()), std::move(fp8)));
}

std::optional<Float8Tensor> FindFloat8(const at::Tensor& hp) {
  if (!hp.defined()) return std::nullopt;
  auto& map = Float8Annotations();
  const auto it = map.find(hp.unsafeGetTensorImpl());
  if (it == map.end()) return std::nullopt;
  if (it->second.first.expired()) {
    map.erase(it);
    return std::nullopt;
  }
  return it->second.second;
}

at::Tensor AmaxToScale(const at::Tensor& amax, c10::ScalarType float8_dtype, bool round_scales_to_power_of_2) {
  at::Tensor scale = (Float8Max(float8_dtype) / at::clamp(amax.to(at::kDouble), kAmaxEps)).to(at::kFloat);
  if (round_scales_to_power_of_2) scale = at::exp2(at::floor(at::log2(scale)));
  return scale;
}

at::Tensor TensorToAmax(const at::Tensor& x, ScalingGranularity granularity, std::optional<int64_t> axiswise_dim) {
  at::NoGradGuard no_grad;
  if (granularity == ScalingGranularity::kTensorwise) {
    return x.numel() > 0 ? at::max(at::abs(x)) : at::zeros({}, x.options());
  }
  TORCH_CHECK(axiswise_dim.has_value(), "TensorToAmax: axiswise scaling needs an axiswise_dim");
  return at::amax(at::abs(x), {*axiswise_dim}, /*keepdim=*/true);
}

at::Tensor AllReduceAmax(at::Tensor amax, const comm::ProcessGroupPtr& group) {
  // A copy: the local amax may be a kept output of selective checkpointing (torchtitan keeps
  // aten::max), which must not change after the forward (torchao's all_reduce is functional).
  amax = amax.clone(at::MemoryFormat::Contiguous);
  if (group->size() > 1) group->all_reduce(amax, comm::ReduceOp::Max())->wait();
  return amax;
}

Float8Tensor ToFloat8(const at::Tensor& hp, const at::Tensor& scale, c10::ScalarType float8_dtype,
                      std::optional<int64_t> axiswise_dim) {
  at::NoGradGuard no_grad;
  const double max = Float8Max(float8_dtype);
  at::Tensor bits = (hp.to(at::kFloat) * scale).clamp(-max, max).to(float8_dtype);
  return Float8Tensor{std::move(bits), scale, hp.scalar_type(), axiswise_dim};
}

at::Tensor Float8Mm(const Float8Tensor& a, const Float8Tensor& b, const GemmConfig& gemm, bool emulate,
                    bool pad_inner_dim) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(a.data.dim() == 2 && b.data.dim() == 2 && a.data.size(1) == b.data.size(0),
              "Float8Mm: needs [M, K] @ [K, N], got ", a.data.sizes(), " @ ", b.data.sizes());
  const c10::ScalarType out_dtype = a.orig_dtype;
  if (emulate) {
    return at::mm(a.data.to(at::kFloat) / a.scale, b.data.to(at::kFloat) / b.scale).to(out_dtype);
  }
  at::Tensor a_data = a.data, b_data = b.data, a_scale = a.scale, b_scale = b.scale;
  if (pad_inner_dim) {
    const int64_t k = a_data.size(1), padded = RoundUp16(k);
    a_data = at::constant_pad_nd(a_data, {0, padded - k, 0, 0});
    b_data = at::constant_pad_nd(b_data, {0, 0, 0, padded - k});
  }
  if (!IsRowMajor(a_data.strides())) a_data = a_data.contiguous();
  if (IsRowMajor(b_data.strides())) b_data = b_data.t().contiguous().t();
  // _scaled_mm takes both operands at one granularity: a tensorwise scale is repeated.
  if (!a.axiswise_dim && b.axiswise_dim) {
    a_scale = a_scale.repeat({a_data.size(0)}).reshape({-1, 1});
  } else if (a.axiswise_dim && !b.axiswise_dim) {
    b_scale = b_scale.repeat({b_data.size(1)}).reshape({1, -1});
  }
  at::Tensor a_inverse = a_scale.reciprocal(), b_inverse = b_scale.reciprocal();
  const bool rowwise =
      a_scale.sizes() == at::IntArrayRef{a_data.size(0), 1} && b_scale.sizes() == at::IntArrayRef{1, b_data.size(1)};
  at::Tensor post_inverse_scale;
  if (rowwise && !gemm.use_fast_accum) {
    post_inverse_scale = a_inverse * b_inverse;
    a_inverse = a_inverse.new_ones({});
    b_inverse = a_inverse.new_ones({});
  }
  c10::ScalarType mm_dtype = out_dtype;
  if ((out_dtype == at::kHalf || out_dtype == at::kFloat) && rowwise) mm_dtype = at::kBFloat16;
  at::Tensor out = at::_scaled_mm(a_data, b_data, a_inverse, b_inverse, /*bias=*/std::nullopt,
                                  /*scale_result=*/std::nullopt, mm_dtype, gemm.use_fast_accum);
  if (post_inverse_scale.defined()) out.mul_(post_inverse_scale);
  if (mm_dtype != out_dtype) out = out.to(out_dtype);
  return out;
}

}  // namespace fsdp::float8
