// Mixed precision policy and the rules that drop redundant casts.
#ifndef FSDP_FSDP_COMMON_MIXED_PRECISION_H_
#define FSDP_FSDP_COMMON_MIXED_PRECISION_H_

#include <c10/core/ScalarType.h>

#include <optional>

namespace fsdp {

// As PyTorch's MixedPrecisionPolicy (FSDP2): unset dtypes mean "no cast".
struct MixedPrecisionPolicy {
  std::optional<c10::ScalarType> param_dtype;   // unsharded parameters / forward compute
  std::optional<c10::ScalarType> reduce_dtype;  // gradient reduction
  std::optional<c10::ScalarType> output_dtype;  // cast of forward outputs
  bool cast_forward_inputs = true;              // cast floating inputs to param_dtype
};

// The casts one parameter actually needs (FSDPParam.init_dtype_attrs): reduce_dtype is
// dropped when it equals param_dtype (gradients are already in it); param_dtype is dropped
// when it equals the parameter's dtype or the parameter is not floating point.
struct ResolvedDtypes {
  std::optional<c10::ScalarType> param_dtype;
  std::optional<c10::ScalarType> reduce_dtype;
};

inline ResolvedDtypes ResolveDtypes(const MixedPrecisionPolicy& policy, c10::ScalarType orig_dtype) {
  ResolvedDtypes r{policy.param_dtype, policy.reduce_dtype};
  if (r.reduce_dtype == r.param_dtype) r.reduce_dtype.reset();
  if (r.param_dtype == orig_dtype || !c10::isFloatingType(orig_dtype)) r.param_dtype.reset();
  return r;
}

}  // namespace fsdp

#endif  // FSDP_FSDP_COMMON_MIXED_PRECISION_H_
