// Float8 training configuration: how each operand of a linear layer's three matmuls is cast to
// float8, and the recipes that fill it (torchao's torchao/float8/config.py: CastConfig,
// Float8LinearConfig, Float8LinearRecipeName).
//
// A linear layer y = x W^T runs three matmuls: output = input @ weight^T, grad_input =
// grad_output @ weight, grad_weight = grad_output^T @ input. Each operand has a cast config per
// matmul it takes part in; the *_for_grad_* ones default to the operand's main config.
//
//   Float8LinearConfig c = Float8LinearConfig::FromRecipeName("rowwise");
//   ResolvedFloat8Config r = Resolve(c);   // defaults filled, checked (torchao's __post_init__)
//
// Errors: Resolve and FromRecipeName throw c10::Error naming the field or recipe and the value.
#ifndef FSDP_FLOAT8_CONFIG_H_
#define FSDP_FLOAT8_CONFIG_H_

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>
#include <string_view>

namespace fsdp::float8 {

// DYNAMIC: a scale computed from the tensor's values at each cast; DISABLED: the operand stays
// in high precision (both operands of a matmul must agree).
enum class ScalingType { kDynamic, kDisabled };
// One scale per tensor, or one per row / column (torchao's AXISWISE, "rowwise").
enum class ScalingGranularity { kTensorwise, kAxiswise };

struct CastConfig {
  ScalingType scaling_type = ScalingType::kDynamic;
  ScalingGranularity scaling_granularity = ScalingGranularity::kTensorwise;
  // A float8 dtype; unset: e4m3 for input and weight, e5m2 for grad_output.
  std::optional<c10::ScalarType> target_dtype;
};

struct GemmConfig {
  // _scaled_mm's use_fast_accum (a GPU accumulation mode; also selects how rowwise scales are
  // applied, see scaled_mm.h).
  bool use_fast_accum = false;
};

struct Float8LinearConfig {
  CastConfig cast_config_input;
  std::optional<CastConfig> cast_config_input_for_grad_weight;
  CastConfig cast_config_weight;
  std::optional<CastConfig> cast_config_weight_for_grad_input;
  CastConfig cast_config_grad_output;
  std::optional<CastConfig> cast_config_grad_output_for_grad_weight;
  GemmConfig gemm_config_output{/*use_fast_accum=*/true};
  GemmConfig gemm_config_grad_input;
  GemmConfig gemm_config_grad_weight;
  // FSDP2 all-gathers the weight in float8, cast with its tensorwise scale before the
  // all-gather (fsdp_float8.h). Tensorwise weight scaling only.
  bool enable_fsdp_float8_all_gather = false;
  // Zero-pads the inner dimension of each float8 matmul to a multiple of 16.
  bool pad_inner_dim = false;
  // Matmuls in float32 on the dequantized operands instead of _scaled_mm.
  bool emulate = false;
  // Scales rounded down to a power of two (the rowwise recipes).
  bool round_scales_to_power_of_2 = false;

  // torchao's recipes: "tensorwise" (the defaults), "rowwise", "rowwise_with_gw_hp".
  static Float8LinearConfig FromRecipeName(std::string_view recipe_name);
};

// A Float8LinearConfig with every cast config present and its target dtype set.
struct ResolvedFloat8Config {
  CastConfig input, input_for_grad_weight;
  CastConfig weight, weight_for_grad_input;
  CastConfig grad_output, grad_output_for_grad_weight;
  GemmConfig gemm_output, gemm_grad_input, gemm_grad_weight;
  bool enable_fsdp_float8_all_gather = false;
  bool pad_inner_dim = false;
  bool emulate = false;
  bool round_scales_to_power_of_2 = false;
};

// Fills the defaults and checks the config as torchao's Float8LinearConfig.__post_init__:
// float8 target dtypes, both operands of each matmul scaled or both disabled, an operand cast
// to one dtype in both of its matmuls, axiswise only with dynamic scaling, the float8
// all-gather only with dynamic tensorwise weight scaling.
ResolvedFloat8Config Resolve(const Float8LinearConfig& config);

// torchao's short form of a cast config ("dyn_ten_e4m3"), for messages and reprs.
std::string ShortString(const CastConfig& config);

// The largest finite value of a float8 dtype (torch.finfo(dtype).max); errors for other dtypes.
double Float8Max(c10::ScalarType float8_dtype);

}  // namespace fsdp::float8

#endif  // FSDP_FLOAT8_CONFIG_H_
