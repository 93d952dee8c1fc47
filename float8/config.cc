#include "float8/config.h"

#include <c10/util/Exception.h>

namespace fsdp::float8 {
namespace {

bool IsFloat8(c10::ScalarType t) {
  return t == c10::kFloat8_e4m3fn || t == c10::kFloat8_e5m2 || t == c10::kFloat8_e4m3fnuz || t == c10::kFloat8_e5m2fnuz;
}

void CheckCast(const CastConfig& c, const char* field) {
  TORCH_CHECK(c.scaling_granularity != ScalingGranularity::kAxiswise || c.scaling_type == ScalingType::kDynamic,
              "Float8LinearConfig.", field, ": axiswise scaling needs dynamic scaling, got disabled");
  TORCH_CHECK(!c.target_dtype || IsFloat8(*c.target_dtype), "Float8LinearConfig.", field,
              ".target_dtype must be a float8 dtype, got ", c10::toString(*c.target_dtype));
}

// Sets the default dtype of an operand in both matmuls and checks that they agree.
void ResolveOperand(CastConfig& main, CastConfig& other, c10::ScalarType default_dtype, const char* operand) {
  if (!main.target_dtype) main.target_dtype = default_dtype;
  if (!other.target_dtype) other.target_dtype = default_dtype;
  TORCH_CHECK(*main.target_dtype == *other.target_dtype, "Float8LinearConfig: ", operand,
              " must be cast to the same dtype in both matmuls it's used in, got ", c10::toString(*main.target_dtype),
              " and ", c10::toString(*other.target_dtype));
}

void CheckSamePrecision(const CastConfig& a, const CastConfig& b, const char* gemm) {
  TORCH_CHECK((a.scaling_type == ScalingType::kDisabled) == (b.scaling_type == ScalingType::kDisabled),
              "Float8LinearConfig: incompatible operand precision for ", gemm,
              " (one operand's scaling is disabled, the other's not)");
}

}  // namespace

double Float8Max(c10::ScalarType float8_dtype) {
  switch (float8_dtype) {
    case c10::kFloat8_e4m3fn: return 448.0;
    case c10::kFloat8_e5m2: return 57344.0;
    case c10::kFloat8_e4m3fnuz: return 240.0;
    case c10::kFloat8_e5m2fnuz: return 57344.0;
    default: TORCH_CHECK(false, "Unsupported float8_dtype: ", c10::toString(float8_dtype));
  }
}

Float8LinearConfig Float8LinearConfig::FromRecipeName(std::string_view recipe_name) {
  if (recipe_name == "tensorwise") return Float8LinearConfig{};
  const CastConfig axiswise_e4m3{ScalingType::kDynamic, ScalingGranularity::kAxiswise, c10::kFloat8_e4m3fn};
  Float8LinearConfig c;
  c.round_scales_to_power_of_2 = true;
  if (recipe_name == "rowwise") {
    c.cast_config_input = c.cast_config_weight = c.cast_config_grad_output = axiswise_e4m3;
    return c;
  }
  if (recipe_name == "rowwise_with_gw_hp") {
    c.cast_config_input = c.cast_config_weight = CastConfig{ScalingType::kDynamic, ScalingGranularity::kAxiswise};
    c.cast_config_grad_output = axiswise_e4m3;
    c.cast_config_weight_for_grad_input = CastConfig{};
    c.cast_config_input_for_grad_weight = CastConfig{ScalingType::kDisabled};
    c.cast_config_grad_output_for_grad_weight =
        CastConfig{ScalingType::kDisabled, ScalingGranularity::kTensorwise, c10::kFloat8_e4m3fn};
    return c;
  }
  TORCH_CHECK(false, "recipe_name ", recipe_name,
              " not in valid names ['tensorwise', 'rowwise', 'rowwise_with_gw_hp']");
}

ResolvedFloat8Config Resolve(const Float8LinearConfig& config) {
  ResolvedFloat8Config r;
  r.input = config.cast_config_input;
  r.input_for_grad_weight = config.cast_config_input_for_grad_weight.value_or(config.cast_config_input);
  r.weight = config.cast_config_weight;
  r.weight_for_grad_input = config.cast_config_weight_for_grad_input.value_or(config.cast_config_weight);
  r.grad_output = config.cast_config_grad_output;
  r.grad_output_for_grad_weight =
      config.cast_config_grad_output_for_grad_weight.value_or(config.cast_config_grad_output);
  CheckCast(r.input, "cast_config_input");
  CheckCast(r.input_for_grad_weight, "cast_config_input_for_grad_weight");
  CheckCast(r.weight, "cast_config_weight");
  CheckCast(r.weight_for_grad_input, "cast_config_weight_for_grad_input");
  CheckCast(r.grad_output, "cast_config_grad_output");
  CheckCast(r.grad_output_for_grad_weight, "cast_config_grad_output_for_grad_weight");
  TORCH_CHECK(!config.enable_fsdp_float8_all_gather || r.weight.scaling_granularity == ScalingGranularity::kTensorwise,
              "enable_fsdp_float8_all_gather only supports tensorwise scaling granularity, got axiswise");
  TORCH_CHECK(!config.enable_fsdp_float8_all_gather || r.weight.scaling_type == ScalingType::kDynamic,
              "enable_fsdp_float8_all_gather needs dynamic weight scaling, got disabled");
  CheckSamePrecision(r.input, r.weight, "output");
  CheckSamePrecision(r.grad_output, r.weight_for_grad_input, "grad_input");
  CheckSamePrecision(r.input_for_grad_weight, r.grad_output_for_grad_weight, "grad_weight");
  ResolveOperand(r.input, r.input_for_grad_weight, c10::kFloat8_e4m3fn, "input");
  ResolveOperand(r.weight, r.weight_for_grad_input, c10::kFloat8_e4m3fn, "weight");
  ResolveOperand(r.grad_output, r.grad_output_for_grad_weight, c10::kFloat8_e5m2, "grad_output");
  r.gemm_output = config.gemm_config_output;
  r.gemm_grad_input = config.gemm_config_grad_input;
  r.gemm_grad_weight = config.gemm_config_grad_weight;
  r.enable_fsdp_float8_all_gather = config.enable_fsdp_float8_all_gather;
  r.pad_inner_dim = config.pad_inner_dim;
  r.emulate = config.emulate;
  r.round_scales_to_power_of_2 = config.round_scales_to_power_of_2;
  return r;
}

std::string ShortString(const CastConfig& c) {
  std::string s = c.scaling_type == ScalingType::kDynamic ? "dyn" : "dis";
  s += c.scaling_granularity == ScalingGranularity::kTensorwise ? "_ten_" : "_axs_";
  if (!c.target_dtype) return s + "unset";
  switch (*c.target_dtype) {
    case c10::kFloat8_e4m3fn: return s + "e4m3";
    case c10::kFloat8_e5m2: return s + "e5m2";
    default: return s + c10::toString(*c.target_dtype);
  }
}

}  // namespace fsdp::float8
