// The model of a Hugging Face directory: LlamaConfig from its config.json, as transformers
// reads it (transformers 5.24.0, transformers/models/llama/configuration_llama.py and the rope
// standardization of transformers/modeling_rope_utils.py): what torchtitan's hf_assets_path
// gives instead of a flavor.
//
// Read, as transformers reads them (an absent key takes transformers' LlamaConfig default):
//   vocab_size (32000), hidden_size (4096), intermediate_size (11008), num_hidden_layers (32),
//   num_attention_heads (32), num_key_value_heads (absent or null: num_attention_heads),
//   rms_norm_eps (1e-6), tie_word_embeddings (false);
//   the rotary parameters in either form: transformers 5's `rope_parameters` {rope_type,
//   rope_theta, and for "llama3" factor, low_freq_factor, high_freq_factor,
//   original_max_position_embeddings}, or the older top-level `rope_theta` with `rope_scaling`
//   (the Meta-Llama-3.1 checkpoints on the Hub; "type" for "rope_type" as well). As in
//   transformers, a non-empty `rope_scaling` wins over `rope_parameters`, and a rope_theta
//   inside the rope object over the top-level one (default 10000). rope_type "default" (or
//   none) is plain RoPE, "llama3" sets LlamaConfig::rope_scaling.
// Refused, as this model cannot compute them: model_type other than "llama", hidden_act other
// than "silu", attention_bias or mlp_bias true, a head_dim other than hidden_size /
// num_attention_heads (the model has no separate head_dim), any other rope_type, a
// partial_rotary_factor other than 1. Also refused: hidden_size not divisible by
// num_attention_heads (transformers refuses it too), num_attention_heads not divisible by
// num_key_value_heads, a size below 1, a non-positive eps, theta or rope factor.
// Ignored: every other key (HF configs carry many: architectures, bos_token_id, torch_dtype,
// max_position_embeddings, ...). The attention kernel is left at LlamaConfig's default.
//
// Errors: a c10::Error that names `what` (the file), the key (a rope key as
// "rope_parameters" > "factor") and its value: JSON that is not strict JSON
// (checkpoint/json.h), a value of the wrong JSON type (a string for a number, 4096.0 for an
// integer), the refusals above.
//
// Thread-safety: none needed (pure functions; LoadHfLlamaConfig only reads the file).
#ifndef FSDP_MODELS_LLAMA_HF_CONFIG_H_
#define FSDP_MODELS_LLAMA_HF_CONFIG_H_

#include <string>
#include <string_view>

#include "models/llama/model.h"

namespace fsdp::models::llama {

// The LlamaConfig of `json`, the text of a config.json; `what` names it in errors.
LlamaConfig LlamaConfigFromHfJson(std::string_view json, const std::string& what);

// LlamaConfigFromHfJson of `directory`/config.json (an error when it cannot be read).
LlamaConfig LoadHfLlamaConfig(const std::string& directory);

}  // namespace fsdp::models::llama

#endif  // FSDP_MODELS_LLAMA_HF_CONFIG_H_
