// train/torchtitan_checkpoint.h: torchtitan's names (Llama3StateDictAdapter.from_hf_map) and rows,
// the rows against torchtitan's own tensor formulas written in ATen: the adapter's _permute
// (torchtitan/models/llama3/state_dict_adapter.py) and FusedQKVLinear's split
// (torchtitan/models/common/attention.py). train/torchtitan_parity_test.cc loads a checkpoint
// torchtitan saved.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include "testing/expect_error.h"
#include "train/torchtitan_checkpoint.h"

namespace fsdp::train {
namespace {

TEST(TorchtitanCheckpointLayout, NamesAreTheAdaptersMap) {
  EXPECT_EQ(TorchtitanFqn("model.embed_tokens.weight"), "tok_embeddings.weight");
  EXPECT_EQ(TorchtitanFqn("model.layers.12.self_attn.q_proj.weight"), "layers.12.attention.qkv_linear.wq.weight");
  EXPECT_EQ(TorchtitanFqn("model.layers.0.self_attn.o_proj.weight"), "layers.0.attention.wo.weight");
  EXPECT_EQ(TorchtitanFqn("model.layers.3.mlp.up_proj.weight"), "layers.3.feed_forward.w3.weight");
  EXPECT_EQ(TorchtitanFqn("model.layers.3.post_attention_layernorm.weight"), "layers.3.ffn_norm.weight");
  EXPECT_EQ(TorchtitanFqn("model.norm.weight"), "norm.weight");
  EXPECT_EQ(TorchtitanFqn("lm_head.weight"), "lm_head.weight");
  EXPECT_ERROR_CONTAINS(TorchtitanFqn("model.layers.x.mlp.up_proj.weight"),
                        "torchtitan's Llama3Model has no counterpart of 'model.layers.x.mlp.up_proj.weight'");
}

// Our rows of each q/k/v weight in the stored tensor, against torchtitan's formulas: a stored
// tensor whose row r holds r, mapped to Hugging Face's rows by torchtitan's own steps.
TEST(TorchtitanCheckpointLayout, RowsAreTheAdaptersPermutationAndTheFusedSplit) {
  models::llama::LlamaConfig config;
  config.hidden_size = 48;
  config.num_attention_heads = 6;  // head_dim 8
  config.num_key_value_heads = 2;  // 3 q heads per kv head
  const int64_t hd = 8, heads = 6, kv = 2, per_kv = 3, dim = 48;
  checkpoint::DcpMetadata fused_md, plain_md;
  fused_md.entries.push_back({.fqn = "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg"});
  const dcp::StoredLayout fused = TorchtitanLayout(config, fused_md);
  const dcp::StoredLayout plain = TorchtitanLayout(config, plain_md);
  // _permute(w, n_heads): view(n_heads, dim1 / n_heads / 2, 2, dim2).transpose(1, 2).
  const auto permute = [&](const at::Tensor& w, int64_t n) {
    return w.view({n, hd / 2, 2, -1}).transpose(1, 2).reshape({n * hd, -1});
  };
  const auto rows_of = [](const std::vector<int64_t>& rows) { return at::tensor(rows, at::kLong); };
  const at::Tensor q_tt = at::arange(heads * hd, at::kLong).unsqueeze(1);
  const at::Tensor k_tt = at::arange(kv * hd, at::kLong).unsqueeze(1);
  for (const auto* layout : {&plain, &fused}) {
    EXPECT_EQ(layout->model("model.layers.1.self_attn.q_proj.weight").fqn, "layers.1.attention.qkv_linear.wq.weight");
    EXPECT_TRUE(at::equal(rows_of(layout->model("model.layers.1.self_attn.q_proj.weight").rows).unsqueeze(1),
                          permute(q_tt, heads)));
    EXPECT_TRUE(at::equal(rows_of(layout->model("model.layers.1.self_attn.k_proj.weight").rows).unsqueeze(1),
                          permute(k_tt, kv)));
    EXPECT_TRUE(layout->model("model.layers.1.self_attn.v_proj.weight").rows.empty());
    EXPECT_TRUE(layout->model("model.layers.1.self_attn.o_proj.weight").rows.empty());
  }
  EXPECT_EQ(plain.optimizer("model.layers.1.self_attn.k_proj.weight").fqn, "layers.1.attention.qkv_linear.wk.weight");
  // FusedQKVLinear._split_qkv_on_save: wqkv.reshape(n_kv, r, hd, dim); q = [:, :per_kv], k = [:, per_kv],
  // v = [:, per_kv + 1]; then the adapter permutes q and k.
  const at::Tensor wqkv = at::arange(kv * (per_kv + 2) * hd, at::kLong).unsqueeze(1).expand({-1, dim});
  const at::Tensor w = wqkv.reshape({kv, per_kv + 2, hd, dim});
  const at::Tensor q = permute(w.slice(1, 0, per_kv).reshape({-1, dim}), heads);
  const at::Tensor k = permute(w.select(1, per_kv).reshape({-1, dim}), kv);
  const at::Tensor v = w.select(1, per_kv + 1).reshape({-1, dim});
  for (const auto& [name, want] : {std::pair{"q", q}, {"k", k}, {"v", v}}) {
    const dcp::StoredTensor s = fused.optimizer(std::string("model.layers.1.self_attn.") + name + "_proj.weight");
    EXPECT_EQ(s.fqn, "layers.1.attention.qkv_linear.wqkv.weight");
    EXPECT_TRUE(at::equal(wqkv.index_select(0, rows_of(s.rows)), want)) << name;
  }
  EXPECT_EQ(fused.model_prefix, "");
  EXPECT_EQ(fused.optimizer_prefix, "optimizer.");
}

}  // namespace
}  // namespace fsdp::train
