// See flavors.h. The numbers are torchtitan's _debugmodel, _1b, ... functions'.
#include "models/llama/flavors.h"

#include <c10/util/Exception.h>

namespace fsdp::models::llama {
namespace {

struct Flavor {
  const char* name;
  int64_t dim, n_layers, n_heads, n_kv_heads, vocab_size, multiple_of;
  std::optional<double> ffn_dim_multiplier;
  bool tie_word_embeddings;
};

// n_kv_heads 0: torchtitan's None (as many as the query heads).
constexpr Flavor kFlavors[] = {
    {"debugmodel", 256, 6, 16, 0, 2048, 256, std::nullopt, false},
    {"1B", 2048, 16, 32, 8, 128256, 1024, 1.5, true},
    {"3B", 3072, 28, 24, 8, 128256, 1024, 1.0, true},
    {"8B", 4096, 32, 32, 8, 128256, 1024, 1.3, false},
    {"70B", 8192, 80, 64, 8, 128256, 4096, 1.3, false},
    {"405B", 16384, 126, 128, 8, 128256, 4096, 1.2, false},
};

}  // namespace

int64_t ComputeFfnHiddenDim(int64_t dim, int64_t multiple_of, std::optional<double> ffn_dim_multiplier) {
  TORCH_CHECK(dim > 0 && multiple_of > 0, "ComputeFfnHiddenDim: dim (", dim, ") and multiple_of (", multiple_of,
              ") must be positive");
  // Python's int(2 * 4 * dim / 3): a float division, then truncation.
  auto hidden = static_cast<int64_t>(2.0 * 4.0 * static_cast<double>(dim) / 3.0);
  if (ffn_dim_multiplier) {
    TORCH_CHECK(*ffn_dim_multiplier > 0, "ComputeFfnHiddenDim: ffn_dim_multiplier = ", *ffn_dim_multiplier,
                " must be positive");
    hidden = static_cast<int64_t>(*ffn_dim_multiplier * static_cast<double>(hidden));
  }
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

LlamaConfig Llama3Flavor(std::string_view name) {
  for (const Flavor& f : kFlavors) {
    if (name != f.name) continue;
    LlamaConfig c;
    c.vocab_size = f.vocab_size;
    c.hidden_size = f.dim;
    c.intermediate_size = ComputeFfnHiddenDim(f.dim, f.multiple_of, f.ffn_dim_multiplier);
    c.num_hidden_layers = f.n_layers;
    c.num_attention_heads = f.n_heads;
    c.num_key_value_heads = f.n_kv_heads == 0 ? f.n_heads : f.n_kv_heads;
    c.rope_theta = 500000.0;
    c.rms_norm_eps = 1e-5;
    c.rope_scaling = Llama3RopeScaling{};
    c.tie_word_embeddings = f.tie_word_embeddings;
    c.attention = AttentionKernel::kSdpa;
    return c;
  }
  std::string names;
  for (const Flavor& f : kFlavors) names += std::string(names.empty() ? "" : ", ") + f.name;
  TORCH_CHECK(false, "model.flavor = \"", name, "\" is not a Llama 3 flavor of torchtitan's registry (", names, ")");
}

int64_t ParameterCount(const LlamaConfig& c) {
  const int64_t d = c.hidden_size, hd = c.head_dim();
  const int64_t attention = d * c.num_attention_heads * hd * 2 + d * c.num_key_value_heads * hd * 2;  // q, o; k, v
  const int64_t mlp = 3 * d * c.intermediate_size;
  const int64_t layer = attention + mlp + 2 * d;  // and the two norms
  return EmbeddingParameterCount(c) + c.num_hidden_layers * layer + d +
         (c.tie_word_embeddings ? 0 : c.vocab_size * d);  // final norm, head
}

int64_t EmbeddingParameterCount(const LlamaConfig& c) { return c.vocab_size * c.hidden_size; }

std::vector<std::string> Llama3FlavorNames() {
  std::vector<std::string> names;
  for (const Flavor& f : kFlavors) names.emplace_back(f.name);
  return names;
}

}  // namespace fsdp::models::llama
