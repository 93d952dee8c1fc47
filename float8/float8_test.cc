// Float8 linears against torchao 0.18 (float8/testdata/golden_float8.txt, written by
// testing/golden/gen_float8.py): each recipe's forward and backward on one layer, the resolved
// configs, the FQN and size filters; and the conversion's contract and errors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "float8/config.h"
#include "float8/float8_linear.h"
#include "float8/float8_tensor.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "testing/expect_error.h"
#include "testing/float_tolerance.h"
#include "testing/golden_file.h"

namespace fsdp::float8 {
namespace {

using testing::GoldenFields;
using Linear = Hooked<torch::nn::LinearImpl>;

constexpr const char* kGolden = "float8/testdata/golden_float8.txt";

const std::vector<GoldenFields>& Records(const std::string& kind) {
  static const auto* all = new std::vector<GoldenFields>(testing::ReadGoldenFile(kGolden));
  static auto* by_kind = new std::map<std::string, std::vector<GoldenFields>>();
  auto& out = (*by_kind)[kind];
  if (out.empty()) {
    for (const auto& r : *all) {
      if (r[0] == kind) out.push_back(r);
    }
  }
  return out;
}

at::Tensor Values(const std::string& field, std::vector<int64_t> shape, c10::ScalarType dtype) {
  const std::vector<double> v = testing::GoldenNums(field);
  return at::tensor(v, at::kDouble).reshape(shape).to(dtype);
}

// The largest difference between our value and torchao's the argument allows. Both cast the
// same high-precision operands with the same scales (amax is exact, the scale a float64
// division, the cast an exactly rounded multiply and a deterministic float8 rounding), so the
// float8 operands are the same bits; what may differ is the float32 accumulation order of each
// matmul's `terms` products (AVX2 vs AVX-512 kernels): SummationOrderTolerance times the sum
// of the products' magnitudes, bounded by |A| @ |B| of the high-precision operands times
// (1 + 2^-3)^2 (float8 rounds by at most 2^-3 relative, e5m2's). Then the result is rounded
// to its output dtype (bfloat16 for bfloat16 layers and rowwise float32 layers, which torchao
// runs through bfloat16 and scales there: two roundings), where a changed last float32 bit
// can move it by one unit in the last place: 2 ulps, at most 2 * 2^-7 |value| for bfloat16.
at::Tensor Allowed(const at::Tensor& magnitude, int64_t terms, const at::Tensor& reference, bool bf16_output) {
  const double order = testing::SummationOrderTolerance(at::kFloat, terms) * std::pow(1.0 + 0.125, 2);
  const double output_ulps = bf16_output ? 2 * std::pow(2.0, -7) : 2 * std::pow(2.0, -23);
  return magnitude * order + reference.abs() * output_ulps + 1e-30;
}

void ExpectClose(const at::Tensor& ours, const at::Tensor& reference, const at::Tensor& allowed,
                 const std::string& what) {
  ASSERT_EQ(ours.sizes(), reference.sizes()) << what;
  const at::Tensor diff = (ours.to(at::kDouble) - reference.to(at::kDouble)).abs();
  const at::Tensor excess = diff - allowed;
  const int64_t worst = excess.reshape(-1).argmax().item<int64_t>();
  EXPECT_LE(excess.reshape(-1)[worst].item<double>(), 0.0)
      << what << ": element " << worst << " is " << ours.reshape(-1)[worst].item<double>() << ", torchao "
      << reference.reshape(-1)[worst].item<double>() << ", allowed difference "
      << allowed.reshape(-1)[worst].item<double>();
}

c10::ScalarType DtypeNamed(const std::string& name) { return name == "bfloat16" ? at::kBFloat16 : at::kFloat; }

Float8LinearConfig ConfigFor(const std::string& recipe, bool emulate, bool pad) {
  Float8LinearConfig c = Float8LinearConfig::FromRecipeName(recipe);
  c.emulate = emulate;
  c.pad_inner_dim = pad;
  return c;
}

struct LinearCase {
  GoldenFields f;
  std::string name() const { return f[1]; }
  friend void PrintTo(const LinearCase& c, std::ostream* os) { *os << c.name(); }
};

std::vector<LinearCase> LinearCases() {
  std::vector<LinearCase> out;
  for (const auto& r : Records("linear")) out.push_back({r});
  return out;
}

class Float8LinearGolden : public ::testing::TestWithParam<LinearCase> {};

TEST_P(Float8LinearGolden, ForwardAndBackwardEqualTorchao) {
  const GoldenFields& f = GetParam().f;
  const std::string recipe = f[2];
  const bool emulate = f[3] == "1", pad = f[4] == "1";
  const c10::ScalarType dtype = DtypeNamed(f[5]);
  const std::vector<int64_t> in_shape = testing::GoldenInts(f[6]);
  const int64_t out_features = testing::GoldenInt(f[7]);
  const int64_t k = in_shape.back();
  const bool bias = f[10] != "-";
  std::vector<int64_t> out_shape = in_shape;
  out_shape.back() = out_features;

  Linear linear(torch::nn::LinearOptions(k, out_features).bias(bias));
  linear->to(dtype);
  {
    torch::NoGradGuard no_grad;
    linear->weight.copy_(Values(f[9], {out_features, k}, dtype));
    if (bias) linear->bias.copy_(Values(f[10], {out_features}, dtype));
  }
  ASSERT_EQ(convert_to_float8_training(*linear, ConfigFor(recipe, emulate, pad)), 1);
  const at::Tensor x = Values(f[8], in_shape, dtype).requires_grad_();
  const at::Tensor go = Values(f[11], out_shape, dtype);
  const at::Tensor y = linear(x);
  y.backward(go);

  const bool bf16_out = dtype == at::kBFloat16 || (!emulate && recipe != "tensorwise");
  const at::Tensor x2 = x.detach().reshape({-1, k}).to(at::kDouble).abs();
  const at::Tensor go2 = go.reshape({-1, out_features}).to(at::kDouble).abs();
  const at::Tensor w = linear->weight.detach().to(at::kDouble).abs();
  const int64_t m = x2.size(0);
  const at::Tensor ref_y = Values(f[12], out_shape, at::kDouble);
  const at::Tensor y_mag = at::mm(x2, w.t()).reshape(out_shape);
  ExpectClose(y, ref_y, Allowed(y_mag, k, ref_y, bf16_out || (bias && dtype == at::kBFloat16)), "output");
  const at::Tensor ref_gi = Values(f[13], in_shape, at::kDouble);
  ExpectClose(x.grad(), ref_gi, Allowed(at::mm(go2, w).reshape(in_shape), out_features, ref_gi, bf16_out),
              "grad_input");
  // rowwise_with_gw_hp's grad_weight is a high-precision matmul (float32 or bfloat16 output).
  const bool gw_bf16 = dtype == at::kBFloat16 || (!emulate && recipe == "rowwise");
  const at::Tensor ref_gw = Values(f[14], {out_features, k}, at::kDouble);
  ExpectClose(linear->weight.grad(), ref_gw, Allowed(at::mm(go2.t(), x2), m, ref_gw, gw_bf16), "grad_weight");
  if (bias) {
    const at::Tensor ref_gb = Values(f[15], {out_features}, at::kDouble);
    ExpectClose(linear->bias.grad(), ref_gb, Allowed(go2.sum(0), m, ref_gb, dtype == at::kBFloat16), "grad_bias");
  }
}

INSTANTIATE_TEST_SUITE_P(Torchao, Float8LinearGolden, ::testing::ValuesIn(LinearCases()),
                         [](const auto& info) { return info.param.name(); });

TEST(Float8Config, ResolvedRecipesPrintAsTorchao) {
  const auto& records = Records("repr");
  ASSERT_EQ(records.size(), 3u);
  for (const auto& r : records) {
    Linear linear(32, 16);
    convert_to_float8_training(*linear, Float8LinearConfig::FromRecipeName(r[1]));
    EXPECT_EQ(AsFloat8Linear(*linear)->ToString(), r[2]) << r[1];
  }
}

TEST(Float8Filter, SelectsAsTorchtitanAndTorchao) {
  const auto& records = Records("filter");
  ASSERT_FALSE(records.empty());
  const ModuleFilterFn titan = FilterFqns({"output"});
  const ModuleFilterFn tensorwise = AutoFilterForRecipe("tensorwise", {"output"});
  const ModuleFilterFn rowwise = AutoFilterForRecipe("rowwise", {"output"});
  for (const auto& r : records) {
    const int64_t n = testing::GoldenInt(r[2]), k = testing::GoldenInt(r[3]);
    torch::nn::LinearImpl linear(torch::nn::LinearOptions(k, n).bias(false));
    const ModuleFilterFn& filter = r[1] == "titan" ? titan : r[1] == "tensorwise" ? tensorwise : rowwise;
    EXPECT_EQ(filter(linear, r[4]), r[5] == "1") << r[1] << " " << n << "x" << k << " " << r[4];
  }
}

struct TwoLayerImpl : torch::nn::Module {
  TwoLayerImpl() {
    first = register_module("first", Linear(32, 48));
    second = register_module("second", Linear(48, 16));
    head = register_module("head", torch::nn::Linear(16, 8));
  }
  at::Tensor forward(const at::Tensor& x) { return head(second(first(x))); }
  Linear first{nullptr}, second{nullptr};
  torch::nn::Linear head{nullptr};
};

TEST(ConvertToFloat8Training, KeepsParametersAndFqnsAndChangesOnlyTheForward) {
  auto model = std::make_shared<TwoLayerImpl>();
  std::vector<std::string> names_before;
  std::vector<const c10::TensorImpl*> params_before;
  for (const auto& p : model->named_parameters()) {
    names_before.push_back(p.key());
    params_before.push_back(p.value().unsafeGetTensorImpl());
  }
  const at::Tensor x = at::randn({4, 32});
  const at::Tensor before = model->forward(x).detach();
  // The head (a plain torch::nn::Linear) is filtered out, as torchtitan filters "output".
  EXPECT_EQ(convert_to_float8_training(*model, {}, FilterFqns({"head"})), 2);
  std::vector<std::string> names_after;
  std::vector<const c10::TensorImpl*> params_after;
  for (const auto& p : model->named_parameters()) {
    names_after.push_back(p.key());
    params_after.push_back(p.value().unsafeGetTensorImpl());
  }
  EXPECT_EQ(names_after, names_before);
  EXPECT_EQ(params_after, params_before);
  EXPECT_NE(AsFloat8Linear(*model->first), nullptr);
  EXPECT_EQ(AsFloat8Linear(*model->head), nullptr);
  // Float8 rounding moves the output by about e4m3's 2^-4 relative, never by nothing.
  const at::Tensor after = model->forward(x).detach();
  EXPECT_FALSE(at::equal(after, before));
  EXPECT_LT((after - before).abs().max().item<double>(), 0.25 * before.abs().max().item<double>());
}

TEST(ConvertToFloat8Training, RejectsWhatCannotTakeAFloat8Forward) {
  auto model = std::make_shared<TwoLayerImpl>();
  EXPECT_ERROR_CONTAINS(convert_to_float8_training(*model), "Linear 'head' is a torch::nn::Linear");
  EXPECT_EQ(AsFloat8Linear(*model->first), nullptr);  // nothing converted
  convert_to_float8_training(*model, {}, FilterFqns({"head"}));
  EXPECT_ERROR_CONTAINS(convert_to_float8_training(*model, {}, FilterFqns({"head"})), "converted twice");
  Float8LinearConfig bad;
  bad.enable_fsdp_float8_all_gather = true;
  bad.cast_config_weight.scaling_granularity = ScalingGranularity::kAxiswise;
  EXPECT_ERROR_CONTAINS(convert_to_float8_training(*model, bad), "only supports tensorwise scaling granularity");
  EXPECT_ERROR_CONTAINS(Float8LinearConfig::FromRecipeName("columnwise"), "recipe_name columnwise not in valid names");
  Float8LinearConfig mixed;
  mixed.cast_config_input.scaling_type = ScalingType::kDisabled;
  EXPECT_ERROR_CONTAINS(Resolve(mixed), "incompatible operand precision for output");
  Float8LinearConfig dtype;
  dtype.cast_config_input.target_dtype = at::kBFloat16;
  EXPECT_ERROR_CONTAINS(Resolve(dtype), "cast_config_input.target_dtype must be a float8 dtype, got BFloat16");
  Float8LinearConfig two_dtypes;
  two_dtypes.cast_config_grad_output_for_grad_weight = CastConfig{};
  two_dtypes.cast_config_grad_output_for_grad_weight->target_dtype = at::kFloat8_e4m3fn;
  EXPECT_ERROR_CONTAINS(Resolve(two_dtypes), "grad_output must be cast to the same dtype in both matmuls");
  EXPECT_ERROR_CONTAINS(AutoFilterForRecipe("rowwise_with_gw_hp", {}), "unsupported recipe rowwise_with_gw_hp");
  Linear wide(32, 16);
  convert_to_float8_training(*wide);
  EXPECT_ERROR_CONTAINS(wide(at::randn({2, 31})), "input's last dim (31) must equal in_features (32)");
}

TEST(Float8Tensor, ScalesSaturateAndRoundAsTorchao) {
  // A zero tensor's amax clamps to 1e-12: scale = 448 / 1e-12 (float64, then float32).
  const at::Tensor zero_scale = AmaxToScale(at::zeros({}), at::kFloat8_e4m3fn, false);
  EXPECT_EQ(zero_scale.item<float>(), static_cast<float>(448.0 / 1e-12));
  // Rounded down to a power of two: 448 / 3 = 149.33 -> 128.
  EXPECT_EQ(AmaxToScale(at::full({}, 3.0), at::kFloat8_e4m3fn, true).item<float>(), 128.0f);
  // A value scaled past the float8 range saturates instead of becoming NaN.
  const Float8Tensor f = ToFloat8(at::tensor({1.0f, -1000.0f}), at::full({}, 1.0f), at::kFloat8_e4m3fn, std::nullopt);
  EXPECT_EQ(f.data.to(at::kFloat)[1].item<float>(), -448.0f);
  EXPECT_EQ(f.ToOriginalPrecision()[0].item<float>(), 1.0f);
  EXPECT_ERROR_CONTAINS(Float8Max(at::kFloat), "Unsupported float8_dtype: Float");
}

}  // namespace
}  // namespace fsdp::float8
