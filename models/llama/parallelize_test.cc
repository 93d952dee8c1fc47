// ApplyTensorParallel (models/llama/parallelize.h) against the unsharded model on threaded
// ranks: the loss, each rank's vocab slice of the logits and each rank's slice of the linear
// layers' gradients, with and without sequence parallelism, at tp 2 and 4; and the counts it
// refuses. The whole 2-D training against PyTorch's own: examples/llama/llama_parity_test.cc.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "absl/strings/match.h"
#include "comm/process_group.h"
#include "mesh/device_mesh.h"
#include "models/llama/model.h"
#include "models/llama/parallelize.h"
#include "tensor_parallel/local_annotation.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::models::llama {
namespace {

// 8 query and 4 kv heads (tp 4 keeps whole heads and grouped queries), divisible sizes.
LlamaConfig TpConfig() {
  LlamaConfig c;
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.rope_theta = 500000.0;
  c.rope_scaling = Llama3RopeScaling{};
  c.attention = AttentionKernel::kSdpa;
  return c;
}

LlamaForCausalLM InitializedModel() {
  LlamaForCausalLM model(TpConfig());
  model->to(at::kDouble);
  InitWeights(*model, 3, /*initializer_range=*/0.3);
  return model;
}

// The forward is float64, so the sharded and unsharded logits differ by summation order only
// (the rank partial sums of rowwise layers): a few ulps; 1e-10 relative leaves a margin of
// ~10^4. The loss is HF's, on float32 logits: its vocab reduction (sharded or not) rounds at
// 2^-24 relative, and the gradients carry that through the backward's matmuls (gains ~1.7
// each, 1.7^8 ~ 64). A wrong slice or layout is off by the values' own size.
constexpr double kForwardAgreement = 1e-10;
constexpr double kFloat32LossAgreement = 64.0 / (1 << 24);

void ExpectClose(const at::Tensor& got, const at::Tensor& want, double tolerance, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = want.abs().max().item<double>();
  ASSERT_GT(scale, 0) << what;
  EXPECT_LE((got - want).abs().max().item<double>(), tolerance * scale) << what;
}

class ApplyTensorParallelTest : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(ApplyTensorParallelTest, EqualsTheUnshardedModel) {
  const auto [tp, sequence_parallel] = GetParam();
  // seq 8: divisible by tp; 16 distinct ids spread over the vocabulary, so every rank's
  // embedding rows receive gradient.
  const at::Tensor tokens = (at::arange(16, at::kLong) * 17).remainder(64).view({2, 8});
  LlamaForCausalLM reference = InitializedModel();
  const at::Tensor ref_logits = reference(tokens, at::Tensor());
  const at::Tensor ref_loss = CausalLMLoss(ref_logits, tokens);
  ref_loss.backward();
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, tp, [&](const comm::ProcessGroupPtr& pg) {
    const int64_t r = pg->rank();
    LlamaForCausalLM model = InitializedModel();
    ApplyTensorParallel(*model, mesh::DeviceMesh::Create(pg, {tp}), {.sequence_parallel = sequence_parallel});
    const at::Tensor logits = model(tokens, at::Tensor());
    const int64_t v = TpConfig().vocab_size / tp;
    ExpectClose(logits, ref_logits.narrow(-1, r * v, v), kForwardAgreement, "logits");
    const at::Tensor loss = CausalLMLossParallel(logits, tokens);
    ExpectClose(loss, ref_loss, kFloat32LossAgreement, "loss");
    loss.backward();
    const auto ref_params = reference->named_parameters();
    for (const auto& item : model->named_parameters()) {
      const std::string& name = item.key();
      const at::Tensor& ref_grad = ref_params[name].grad();
      // Colwise layers hold a slice of the output rows, rowwise ones a slice of the input
      // columns, the embedding (rowwise over the vocab) a slice of its rows.
      int dim = -1;
      if (absl::StrContains(name, "q_proj") || absl::StrContains(name, "k_proj") || absl::StrContains(name, "v_proj") ||
          absl::StrContains(name, "gate_proj") || absl::StrContains(name, "up_proj") || name == "lm_head.weight" ||
          name == "model.embed_tokens.weight") {
        dim = 0;
      } else if (absl::StrContains(name, "o_proj") || absl::StrContains(name, "down_proj")) {
        dim = 1;
      }
      if (dim < 0) continue;  // the norms: replicated weights whose grads TP leaves partial
      const at::Tensor grad = tensor_parallel::AsDTensor(item.value().grad()).has_value()
                                  ? tensor_parallel::AsDTensor(item.value().grad())->to_local()
                                  : item.value().grad();
      const int64_t n = ref_grad.size(dim) / tp;
      ExpectClose(grad, ref_grad.narrow(dim, r * n, n), kFloat32LossAgreement, name + ".grad");
    }
  });
}

INSTANTIATE_TEST_SUITE_P(TpAndSequenceParallel, ApplyTensorParallelTest,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Bool()), [](const auto& info) {
                           return "tp" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_sp" : "_no_sp");
                         });

TEST(ApplyTensorParallel, NamesTheCountTpDoesNotDivide) {
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 4, [](const comm::ProcessGroupPtr& pg) {
    const auto mesh = mesh::DeviceMesh::Create(pg, {4});
    LlamaConfig c = TpConfig();
    c.num_key_value_heads = 2;
    LlamaForCausalLM kv(c);
    EXPECT_ERROR_CONTAINS(ApplyTensorParallel(*kv, mesh), "num_key_value_heads=2 is not divisible");
    c = TpConfig();
    c.vocab_size = 66;
    LlamaForCausalLM vocab(c);
    EXPECT_ERROR_CONTAINS(ApplyTensorParallel(*vocab, mesh), "vocab_size=66 is not divisible");
    c = TpConfig();
    c.tie_word_embeddings = true;
    LlamaForCausalLM tied(c);
    EXPECT_ERROR_CONTAINS(ApplyTensorParallel(*tied, mesh), "tie_word_embeddings is not supported");
    EXPECT_ERROR_CONTAINS(CausalLMLossParallel(at::zeros({1, 2, 4}), at::zeros({1, 2}, at::kLong)),
                          "the logits carry no DTensor layout");
  });
}

}  // namespace
}  // namespace fsdp::models::llama
