// The Llama-3 model's registry and initialization against torchtitan's own configs
// (testdata/golden_llama3_flavors.txt, written by testing/golden/gen_models.py from
// torchtitan/models/llama3/__init__.py), and properties of the forward that need no reference:
// SDPA equals the eager path, rotary attention depends on relative positions only, a tied
// head is the embedding. Whole-model numerics against transformers:
// examples/llama/llama_parity_test.cc.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "models/llama/flavors.h"
#include "models/llama/model.h"
#include "testing/expect_error.h"
#include "testing/golden_file.h"

namespace fsdp::models::llama {
namespace {

using ::fsdp::testing::GoldenInt;
using ::fsdp::testing::GoldenNum;
using ::fsdp::testing::ReadGoldenFile;

constexpr char kGolden[] = "models/llama/testdata/golden_llama3_flavors.txt";

TEST(Llama3Flavor, EveryFlavorIsTorchtitans) {
  std::vector<std::string> seen;
  for (const auto& f : ReadGoldenFile(kGolden)) {
    if (f[0] != "flavor") continue;
    ASSERT_EQ(f.size(), 16u);
    SCOPED_TRACE(f[1]);
    seen.push_back(f[1]);
    const LlamaConfig c = Llama3Flavor(f[1]);
    EXPECT_EQ(c.hidden_size, GoldenInt(f[2]));
    EXPECT_EQ(c.num_hidden_layers, GoldenInt(f[3]));
    EXPECT_EQ(c.num_attention_heads, GoldenInt(f[4]));
    EXPECT_EQ(c.num_key_value_heads, GoldenInt(f[5]));
    EXPECT_EQ(c.vocab_size, GoldenInt(f[6]));
    EXPECT_EQ(c.intermediate_size, GoldenInt(f[7]));
    EXPECT_EQ(c.rope_theta, GoldenNum(f[8]));
    ASSERT_EQ(f[9], "llama");
    ASSERT_TRUE(c.rope_scaling.has_value());
    EXPECT_EQ(c.rope_scaling->factor, GoldenNum(f[10]));
    EXPECT_EQ(c.rope_scaling->low_freq_factor, GoldenNum(f[11]));
    EXPECT_EQ(c.rope_scaling->high_freq_factor, GoldenNum(f[12]));
    EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, GoldenInt(f[13]));
    EXPECT_EQ(c.rms_norm_eps, GoldenNum(f[14]));
    EXPECT_EQ(c.tie_word_embeddings, f[15] == "true");
    EXPECT_EQ(c.attention, AttentionKernel::kSdpa);
  }
  EXPECT_EQ(seen, Llama3FlavorNames());
  EXPECT_ERROR_CONTAINS(Llama3Flavor("7B"), "model.flavor = \"7B\" is not a Llama 3 flavor");
}

// torchtitan's parameter count of each flavor's model (get_nparams_and_flops), from the shapes;
// and a built model's own count agrees where building is cheap.
TEST(ParameterCount, IsTorchtitansForEveryFlavor) {
  int checked = 0;
  for (const auto& f : ReadGoldenFile(kGolden)) {
    if (f[0] != "flops") continue;
    SCOPED_TRACE(f[1]);
    EXPECT_EQ(ParameterCount(Llama3Flavor(f[1])), GoldenInt(f[3]));
    ++checked;
  }
  EXPECT_EQ(checked, 18);
  for (const bool tied : {false, true}) {
    LlamaConfig c = Llama3Flavor("debugmodel");
    c.tie_word_embeddings = tied;
    LlamaForCausalLM model(c);
    int64_t n = 0;
    for (const auto& p : model->parameters()) n += p.numel();
    EXPECT_EQ(ParameterCount(c), n) << "tied " << tied;
  }
}

// The standard deviation of a normal(0, std) truncated at +-c*std: std * sqrt(1 - 2 c phi(c) /
// (2 Phi(c) - 1)).
double TruncatedStd(double std, double cut) {
  if (!std::isfinite(cut)) return std;
  const double phi = std::exp(-cut * cut / 2) / std::sqrt(2 * M_PI);
  const double mass = std::erf(cut / std::sqrt(2.0));
  return std * std::sqrt(1 - 2 * cut * phi / mass);
}

// Each parameter's draw has torchtitan's distribution: checked on 2^18 samples, where the
// sample std of a normal is within 6 / sqrt(2 n) (relative) of the true one but for one
// chance in 10^8, and an untruncated normal exceeds 3 std about 700 times.
TEST(InitTorchtitanParameter, DrawsTorchtitansDistributions) {
  constexpr int64_t kN = 1 << 18;
  const double tolerance = 6.0 / std::sqrt(2.0 * kN);
  int checked = 0;
  for (const auto& f : ReadGoldenFile(kGolden)) {
    if (f[0] != "init") continue;
    ASSERT_EQ(f.size(), 7u);
    SCOPED_TRACE(f[1] + " " + f[2]);
    const LlamaConfig config = Llama3Flavor(f[1]);
    at::Tensor t = at::empty({kN});
    InitTorchtitanParameter(config, f[2], t, /*seed=*/1234);
    std::string fn = f[3];
    std::vector<std::string> spec(f.begin() + 4, f.end());
    if (fn == "skip") {  // tied: the shared tensor is drawn by lm_head's init
      ASSERT_TRUE(config.tie_word_embeddings);
      for (const auto& g : ReadGoldenFile(kGolden)) {
        if (g[0] == "init" && g[1] == f[1] && g[2] == "lm_head.weight") {
          fn = g[3];
          spec.assign(g.begin() + 4, g.end());
        }
      }
    }
    if (fn == "ones") {
      EXPECT_TRUE(at::equal(t, at::ones_like(t)));
    } else {
      ASSERT_TRUE(fn == "normal" || fn == "trunc_normal") << fn;
      const double std = GoldenNum(spec[0]);
      const double lo = fn == "normal" ? -std::numeric_limits<double>::infinity() : GoldenNum(spec[1]);
      const double hi = fn == "normal" ? std::numeric_limits<double>::infinity() : GoldenNum(spec[2]);
      ASSERT_EQ(lo, -hi);
      // trunc_normal_ maps a uniform draw of exactly -1 or 1 (2^-24 each for float32) through
      // erfinv to -inf / inf, clamped to the cut: PyTorch's (and torchtitan's) init does that
      // too. Expected 0.03 such values in 2^18; more than 4 has odds below 1e-9. The moments are
      // the rest's.
      const at::Tensor inside = t.masked_select(t.gt(lo).logical_and(t.lt(hi)));
      EXPECT_LE(kN - inside.numel(), 4);
      EXPECT_NEAR(inside.std().item<double>(), TruncatedStd(std, hi / std), tolerance * std);
      EXPECT_NEAR(inside.mean().item<double>(), 0.0, 6 * std / std::sqrt(static_cast<double>(kN)));
      EXPECT_GE(t.min().item<double>(), lo);
      EXPECT_LE(t.max().item<double>(), hi);
      if (hi / std > 3) {
        EXPECT_GT(t.abs().max().item<double>(), 3 * std);  // not cut at 3 std
      }
    }
    ++checked;
  }
  EXPECT_GT(checked, 60);
}

TEST(InitTorchtitanParameter, IsTheSameDrawForTheSameSeedAndNamesUnknownParameters) {
  LlamaConfig config = Llama3Flavor("debugmodel");
  config.num_hidden_layers = 2;
  LlamaForCausalLM a(config), b(config);
  InitWeightsTorchtitan(*a, 5);
  InitWeightsTorchtitan(*b, 5);
  for (const auto& item : a->named_parameters())
    EXPECT_TRUE(at::equal(item.value(), b->named_parameters()[item.key()]));
  // Seeded by (seed, name): another seed or another parameter's name draws other values.
  at::Tensor x = at::empty({64}), y = at::empty({64}), z = at::empty({64});
  InitTorchtitanParameter(config, "model.layers.0.mlp.gate_proj.weight", x, 5);
  InitTorchtitanParameter(config, "model.layers.0.mlp.gate_proj.weight", y, 6);
  InitTorchtitanParameter(config, "model.layers.1.mlp.gate_proj.weight", z, 5);
  EXPECT_FALSE(at::equal(x, y));
  EXPECT_FALSE(at::equal(x, z));
  at::Tensor t = at::empty({4});
  EXPECT_ERROR_CONTAINS(InitTorchtitanParameter(config, "model.layers.0.mlp.w9.weight", t, 1),
                        "unknown parameter model.layers.0.mlp.w9.weight");
  EXPECT_ERROR_CONTAINS(InitTorchtitanParameter(config, "bias", t, 1), "unknown parameter bias");
}

// A small float64 model with Llama 3.1's rope scaling and grouped-query attention. Two parts
// stay float32 as in HF: the eager path's softmax and the rotary angles.
LlamaConfig SmallConfig(AttentionKernel kernel) {
  LlamaConfig c;
  c.vocab_size = 48;
  c.hidden_size = 32;
  c.intermediate_size = 40;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.rope_theta = 500000.0;
  c.rope_scaling = Llama3RopeScaling{};
  c.rope_scaling->original_max_position_embeddings = 16;  // so that all three frequency bands occur
  c.attention = kernel;
  return c;
}

// Fixed tokens (a seeded generator), so that every run checks the same inputs.
at::Tensor Tokens(int64_t vocab, int64_t batch, int64_t seq) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(11);
  return at::randint(vocab, {batch, seq}, generator, at::kLong);
}

// Weights of std 0.3 rather than torchtitan's 0.02, so that attention is far from uniform and
// positions change the logits by much more than the tolerances below.
LlamaForCausalLM SmallModel(const LlamaConfig& config) {
  LlamaForCausalLM model(config);
  model->to(at::kDouble);
  InitWeights(*model, 7, /*initializer_range=*/0.3);
  return model;
}

// What float64 methods that differ by reduction order only agree to: a few ulps of the
// logits' scale per layer; 1e-10 relative leaves a margin of ~10^4.
constexpr double kFloat64Agreement = 1e-10;
// A float32 rounding (relative 2^-24) in one input of the forward, carried to the logits through
// the two layers' eight matmuls with gains ~ 0.3 sqrt(32) ~ 1.7 each (1.7^8 ~ 64). A wrong
// convention (mask, scale, rotation) moves the logits by 1e-2 relative or more.
constexpr double kFloat32Carried = 64.0 / (1 << 24);

TEST(LlamaForCausalLM, SdpaEqualsTheEagerPath) {
  LlamaForCausalLM eager = SmallModel(SmallConfig(AttentionKernel::kEager));
  LlamaForCausalLM sdpa(SmallConfig(AttentionKernel::kSdpa));
  sdpa->to(at::kDouble);
  {
    at::NoGradGuard no_grad;
    for (const auto& item : eager->named_parameters()) sdpa->named_parameters()[item.key()].copy_(item.value());
  }
  const at::Tensor tokens = Tokens(48, 3, 11);
  const at::Tensor a = eager(tokens, at::Tensor()), b = sdpa(tokens, at::Tensor());
  // The eager path's softmax is float32 (HF's); SDPA's is float64 here.
  EXPECT_LE((a - b).abs().max().item<double>(), kFloat32Carried * a.abs().max().item<double>());
}

// Rotary attention sees relative positions only: shifting every position of a row by the same
// amount leaves the logits unchanged; positions 0..seq-1 are the default; per-row positions
// (torchtitan's per-document positions) apply row by row.
TEST(LlamaForCausalLM, RotaryPositionsAreRelativeAndPerRow) {
  LlamaForCausalLM model = SmallModel(SmallConfig(AttentionKernel::kSdpa));
  const at::Tensor tokens = Tokens(48, 2, 9);
  const at::Tensor arange = at::arange(9, at::kLong).unsqueeze(0);
  const at::Tensor base = model(tokens, at::Tensor());
  EXPECT_TRUE(at::equal(base, model(tokens, arange)));
  const at::Tensor shifted = model(tokens, arange + 5);
  // The angles position * inv_freq are float32 (HF's), rounded relative to the largest, 13.
  EXPECT_LE((shifted - base).abs().max().item<double>(), 13 * kFloat32Carried * base.abs().max().item<double>());
  // Row 1 restarts at position 0 at its 4th token: not a shift, so that row changes; row 0 does not.
  const at::Tensor restart = at::stack({at::arange(9, at::kLong), at::cat({at::arange(3), at::arange(6)})});
  const at::Tensor per_row = model(tokens, restart);
  EXPECT_TRUE(at::equal(per_row[0], base[0]));
  EXPECT_GT((per_row[1] - base[1]).abs().max().item<double>(), 1e-6);
  EXPECT_ERROR_CONTAINS(model(tokens, at::arange(8, at::kLong).unsqueeze(0)), "positions must be [1 or batch, seq]");
}

TEST(LlamaForCausalLM, BuildsOnTheMetaDevice) {
  LlamaConfig config = SmallConfig(AttentionKernel::kSdpa);
  LlamaForCausalLM meta(config, c10::Device(c10::kMeta)), cpu(config);
  ASSERT_EQ(meta->named_parameters().size(), cpu->named_parameters().size());
  for (const auto& item : meta->named_parameters()) {
    EXPECT_TRUE(item.value().is_meta()) << item.key();
    EXPECT_EQ(item.value().sizes(), cpu->named_parameters()[item.key()].sizes()) << item.key();
  }
  EXPECT_ERROR_CONTAINS(LlamaForCausalLM(config, c10::Device(c10::kCUDA, 0)), "device must be cpu or meta");
}

TEST(LlamaForCausalLM, TiedHeadIsTheEmbedding) {
  LlamaConfig config = SmallConfig(AttentionKernel::kSdpa);
  config.tie_word_embeddings = true;
  LlamaForCausalLM model = SmallModel(config);
  EXPECT_FALSE(model->named_parameters().contains("lm_head.weight"));
  const at::Tensor tokens = Tokens(48, 1, 5);
  const at::Tensor hidden = model->model(tokens, at::Tensor());
  const at::Tensor expected = at::matmul(hidden, model->model->embed_tokens->weight.t());
  const at::Tensor logits = model(tokens, at::Tensor());
  EXPECT_LE((logits - expected).abs().max().item<double>(), kFloat64Agreement * expected.abs().max().item<double>());
  logits.sum().backward();
  EXPECT_TRUE(model->model->embed_tokens->weight.grad().defined());
}

}  // namespace
}  // namespace fsdp::models::llama
