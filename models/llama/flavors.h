// torchtitan's Llama-3 registry (torchtitan/models/llama3/__init__.py, llama3_configs) as
// LlamaConfigs: the flavors debugmodel, 1B, 3B, 8B, 70B, 405B with torchtitan's dimensions,
// SwiGLU hidden sizes (ComputeFfnHiddenDim), RMSNorm eps 1e-5, rope theta 500000 with Llama 3.1
// scaling, weight tying where torchtitan ties (1B, 3B), and SDPA attention.
//
// Contract: Llama3Flavor(name) for a registry name; any other name is a c10::Error listing the
// names. Stateless, thread-safe. models/llama/model_test.cc checks each flavor against
// torchtitan's own configs (testdata/golden_llama3_flavors.txt, testing/golden/gen_models.py).
#ifndef FSDP_MODELS_LLAMA_FLAVORS_H_
#define FSDP_MODELS_LLAMA_FLAVORS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "models/llama/model.h"

namespace fsdp::models::llama {

// torchtitan's compute_ffn_hidden_dim (models/common/feed_forward.py): int(8 * dim / 3), times
// ffn_dim_multiplier (truncated) when set, rounded up to a multiple of multiple_of.
int64_t ComputeFfnHiddenDim(int64_t dim, int64_t multiple_of, std::optional<double> ffn_dim_multiplier);

LlamaConfig Llama3Flavor(std::string_view name);
std::vector<std::string> Llama3FlavorNames();

// The parameters of a LlamaForCausalLM of `config`, counted from its shapes (a tied head's
// weight once, as torch's parameters() counts the shared tensor): torchtitan's nparams.
int64_t ParameterCount(const LlamaConfig& config);
// The embedding table's parameters: what torchtitan's FLOPs count leaves out when untied.
int64_t EmbeddingParameterCount(const LlamaConfig& config);

}  // namespace fsdp::models::llama

#endif  // FSDP_MODELS_LLAMA_FLAVORS_H_
