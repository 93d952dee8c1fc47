#include "train/torchtitan_checkpoint.h"

#include <c10/util/Exception.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace fsdp::train {
namespace {

constexpr char kLayerPrefix[] = "model.layers.";
constexpr char kFusedQkv[] = "attention.qkv_linear.wqkv.weight";

// Llama3StateDictAdapter.from_hf_map (torchtitan/models/llama3/state_dict_adapter.py), per layer.
const std::map<std::string, std::string>& LayerNames() {
  static const auto* names = new std::map<std::string, std::string>{
      {"self_attn.q_proj.weight", "attention.qkv_linear.wq.weight"},
      {"self_attn.k_proj.weight", "attention.qkv_linear.wk.weight"},
      {"self_attn.v_proj.weight", "attention.qkv_linear.wv.weight"},
      {"self_attn.o_proj.weight", "attention.wo.weight"},
      {"mlp.gate_proj.weight", "feed_forward.w1.weight"},
      {"mlp.up_proj.weight", "feed_forward.w3.weight"},
      {"mlp.down_proj.weight", "feed_forward.w2.weight"},
      {"input_layernorm.weight", "attention_norm.weight"},
      {"post_attention_layernorm.weight", "ffn_norm.weight"},
  };
  return *names;
}

// A layer parameter's (layer, name within the layer); false for the others.
bool SplitLayer(const std::string& fqn, int64_t* layer, std::string* name) {
  if (!absl::StartsWith(fqn, kLayerPrefix)) return false;
  const std::string rest = fqn.substr(sizeof(kLayerPrefix) - 1);
  const size_t dot = rest.find('.');
  if (dot == std::string::npos || !absl::SimpleAtoi(rest.substr(0, dot), layer)) return false;
  *name = rest.substr(dot + 1);
  return true;
}

// torchtitan's row (within its head) of our row r of a q/k head of `head_dim` rows.
int64_t ComplexRopeRow(int64_t r, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  return 2 * (r % half) + r / half;
}

// Our q or k weight's rows in torchtitan's, head by head.
std::vector<int64_t> RopeRows(int64_t heads, int64_t head_dim) {
  std::vector<int64_t> rows(heads * head_dim);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t r = 0; r < head_dim; ++r) rows[h * head_dim + r] = h * head_dim + ComplexRopeRow(r, head_dim);
  }
  return rows;
}

// Our q, k or v weight's rows in torchtitan's fused wqkv ([n_kv, heads_per_kv + 2, head_dim]).
std::vector<int64_t> FusedRows(char which, const models::llama::LlamaConfig& c) {
  const int64_t hd = c.head_dim(), kv = c.num_key_value_heads, per_kv = c.num_attention_heads / kv;
  const int64_t heads = which == 'q' ? c.num_attention_heads : kv;
  std::vector<int64_t> rows(heads * hd);
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t group = which == 'q' ? h / per_kv : h;
    const int64_t slot = which == 'q' ? h % per_kv : which == 'k' ? per_kv : per_kv + 1;
    for (int64_t r = 0; r < hd; ++r) {
      rows[h * hd + r] = (group * (per_kv + 2) + slot) * hd + (which == 'v' ? r : ComplexRopeRow(r, hd));
    }
  }
  return rows;
}

}  // namespace

std::string TorchtitanFqn(const std::string& fqn) {
  if (fqn == "model.embed_tokens.weight") return "tok_embeddings.weight";
  if (fqn == "model.norm.weight") return "norm.weight";
  if (fqn == "lm_head.weight") return fqn;
  int64_t layer;
  std::string name;
  if (SplitLayer(fqn, &layer, &name)) {
    auto it = LayerNames().find(name);
    if (it != LayerNames().end()) return absl::StrCat("layers.", layer, ".", it->second);
  }
  TORCH_CHECK(false, "torchtitan's Llama3Model has no counterpart of '", fqn, "'");
  return {};  // unreachable: TORCH_CHECK(false) throws
}

bool IsTorchtitanCheckpoint(const checkpoint::DcpMetadata& metadata) {
  return metadata.Find("tok_embeddings.weight") != nullptr;
}

dcp::StoredLayout TorchtitanLayout(const models::llama::LlamaConfig& config, const checkpoint::DcpMetadata& metadata) {
  TORCH_CHECK(config.head_dim() % 2 == 0 && config.num_attention_heads % config.num_key_value_heads == 0,
              "TorchtitanLayout: head_dim ", config.head_dim(), " and ", config.num_attention_heads, " heads over ",
              config.num_key_value_heads, " kv heads are not a Llama-3 attention torchtitan builds");
  // The fused layout shows in the optimizer state of layer 0.
  bool fused = false;
  for (const checkpoint::DcpEntry& e : metadata.entries) {
    fused = fused || absl::StartsWith(e.fqn, absl::StrCat("optimizer.state.layers.0.", kFusedQkv, "."));
  }
  const auto stored = [config](const std::string& fqn, bool fused_qkv) -> dcp::StoredTensor {
    int64_t layer;
    std::string name;
    if (SplitLayer(fqn, &layer, &name) && absl::StartsWith(name, "self_attn.") && name.size() > 10 &&
        absl::EndsWith(name, "_proj.weight") && name[10] != 'o') {
      const char which = name[10];  // q, k or v
      if (fused_qkv) return {absl::StrCat("layers.", layer, ".", kFusedQkv), FusedRows(which, config)};
      if (which == 'v') return {TorchtitanFqn(fqn), {}};
      return {TorchtitanFqn(fqn),
              RopeRows(which == 'q' ? config.num_attention_heads : config.num_key_value_heads, config.head_dim())};
    }
    return {TorchtitanFqn(fqn), {}};
  };
  return {.model_prefix = "",
          .optimizer_prefix = "optimizer.",
          .model = [stored](const std::string& fqn) { return stored(fqn, false); },
          .optimizer = [stored, fused](const std::string& fqn) { return stored(fqn, fused); }};
}

}  // namespace fsdp::train
