// See llama.h. Every step follows transformers 5.24.0's
// transformers/models/llama/modeling_llama.py op for op (same ops, same order, same dtypes),
// which is what lets llama_parity_test.cc compare with HF at float32 rounding level.
#include "examples/llama/llama.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <string>

namespace fsdp::examples::llama {
namespace {

Linear NoBiasLinear(int64_t in, int64_t out) { return Linear(torch::nn::LinearOptions(in, out).bias(false)); }

// HF's rotate_half: [x1, x2] -> [-x2, x1] over the two halves of the last dim (the "half
// split" RoPE convention, not the interleaved pairs of Meta's original code; HF's conversion
// script permutes q/k weights between the two).
at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, x.size(-1) - half), x.narrow(-1, 0, half)}, -1);
}

// HF's repeat_kv: [b, kv_heads, s, d] -> [b, kv_heads * n_rep, s, d], each kv head repeated
// n_rep times consecutively (query head h uses kv head h / n_rep).
at::Tensor RepeatKv(const at::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const int64_t b = x.size(0), kv = x.size(1), s = x.size(2), d = x.size(3);
  return x.unsqueeze(2).expand({b, kv, n_rep, s, d}).reshape({b, kv * n_rep, s, d});
}

// LlamaRotaryEmbedding with rope_type "default" (attention_scaling 1, so not applied):
// inv_freq = 1 / theta^(arange(0, d, 2) / d) in float32, angles = position * inv_freq,
// emb = cat(angles, angles); returns cos, sin of shape [1, seq, head_dim].
std::pair<at::Tensor, at::Tensor> RotaryCosSin(const LlamaConfig& config, int64_t seq, const at::Tensor& like) {
  const int64_t d = config.head_dim();
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(like.device());
  // Python's `1.0 / t` is t.reciprocal() * 1.0 (torch/_tensor.py, __rdiv__).
  const at::Tensor inv_freq = at::reciprocal(at::pow(config.rope_theta, at::arange(0, d, 2, f32) / d));
  const at::Tensor positions = at::arange(seq, f32.dtype(at::kLong)).unsqueeze(0);  // position_ids [1, seq]
  const at::Tensor freqs = positions.unsqueeze(-1).to(at::kFloat) * inv_freq;       // [1, seq, d/2]
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(like.scalar_type()), emb.sin().to(like.scalar_type())};
}

}  // namespace

RMSNormImpl::RMSNormImpl(int64_t hidden_size, double eps)
    : weight(register_parameter("weight", at::ones({hidden_size}))), eps(eps) {}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (h * at::rsqrt(variance + eps)).to(x.scalar_type());
}

AttentionImpl::AttentionImpl(const LlamaConfig& c) : config(c) {
  TORCH_CHECK(c.hidden_size % c.num_attention_heads == 0, "hidden_size must be a multiple of num_attention_heads");
  TORCH_CHECK(c.num_attention_heads % c.num_key_value_heads == 0,
              "num_attention_heads must be a multiple of num_key_value_heads");
  const int64_t d = c.head_dim();
  q_proj = register_module("q_proj", NoBiasLinear(c.hidden_size, c.num_attention_heads * d));
  k_proj = register_module("k_proj", NoBiasLinear(c.hidden_size, c.num_key_value_heads * d));
  v_proj = register_module("v_proj", NoBiasLinear(c.hidden_size, c.num_key_value_heads * d));
  o_proj = register_module("o_proj", NoBiasLinear(c.num_attention_heads * d, c.hidden_size));
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t b = x.size(0), s = x.size(1), d = config.head_dim();
  // [b, s, heads * d] -> [b, heads, s, d]
  at::Tensor q = q_proj(x).view({b, s, -1, d}).transpose(1, 2);
  at::Tensor k = k_proj(x).view({b, s, -1, d}).transpose(1, 2);
  at::Tensor v = v_proj(x).view({b, s, -1, d}).transpose(1, 2);
  // apply_rotary_pos_emb with unsqueeze_dim = 1: cos, sin broadcast over the heads.
  const at::Tensor c = cos.unsqueeze(1), sn = sin.unsqueeze(1);
  q = q * c + RotateHalf(q) * sn;
  k = k * c + RotateHalf(k) * sn;

  const int64_t n_rep = config.num_attention_heads / config.num_key_value_heads;
  const at::Tensor keys = RepeatKv(k, n_rep), values = RepeatKv(v, n_rep);
  // eager_attention_forward: scores * head_dim^-0.5 (multiplied, as HF does, not divided by
  // sqrt(d): the rounding differs), plus the causal mask HF's eager_mask builds (0 where
  // allowed, the dtype's lowest finite value above the diagonal).
  at::Tensor scores = at::matmul(q, keys.transpose(2, 3)) * std::pow(static_cast<double>(d), -0.5);
  const at::Tensor future = at::ones({s, s}, x.options().dtype(at::kBool)).triu(1);
  const double lowest =
      x.scalar_type() == at::kDouble ? std::numeric_limits<double>::lowest() : std::numeric_limits<float>::lowest();
  scores = scores + at::zeros({s, s}, scores.options()).masked_fill(future, lowest);
  const at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  const at::Tensor out = at::matmul(probs, values).transpose(1, 2).contiguous();
  return o_proj(out.reshape({b, s, -1}).contiguous());
}

MLPImpl::MLPImpl(const LlamaConfig& c)
    : gate_proj(register_module("gate_proj", NoBiasLinear(c.hidden_size, c.intermediate_size))),
      up_proj(register_module("up_proj", NoBiasLinear(c.hidden_size, c.intermediate_size))),
      down_proj(register_module("down_proj", NoBiasLinear(c.intermediate_size, c.hidden_size))) {}

at::Tensor MLPImpl::forward(const at::Tensor& x) { return down_proj(at::silu(gate_proj(x)) * up_proj(x)); }

// Registration order is HF's __init__ order (self_attn, mlp, then the two norms), so
// parameters() lists tensors in HF's named_parameters() order.
DecoderLayerImpl::DecoderLayerImpl(const LlamaConfig& c)
    : self_attn(register_module("self_attn", Attention(c))),
      mlp(register_module("mlp", MLP(c))),
      input_layernorm(register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps))),
      post_attention_layernorm(register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps))) {}

at::Tensor DecoderLayerImpl::forward(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor h = hidden + self_attn(input_layernorm(hidden), cos, sin);
  return h + mlp(post_attention_layernorm(h));
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& c) : config(c) {
  embed_tokens = register_module("embed_tokens", Embedding(c.vocab_size, c.hidden_size));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    decoder_layers.emplace_back(c);
    decoder_layers.back()->set_checkpointing_enabled(false);  // opt-in: apply_activation_checkpointing
    layers->push_back(decoder_layers.back());
  }
  norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
}

at::Tensor LlamaModelImpl::forward(const at::Tensor& tokens) {
  at::Tensor h = embed_tokens(tokens);
  const auto [cos, sin] = RotaryCosSin(config, tokens.size(1), h);
  for (auto& layer : decoder_layers) h = layer(h, cos, sin);
  return norm(h);
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& c)
    : config(c),
      model(register_module("model", LlamaModel(c))),
      lm_head(register_module("lm_head", NoBiasLinear(c.hidden_size, c.vocab_size))) {}

at::Tensor LlamaForCausalLMImpl::forward(const at::Tensor& tokens) { return lm_head(model(tokens)); }

at::Tensor CausalLMLoss(const at::Tensor& logits, const at::Tensor& labels) {
  constexpr int64_t kIgnore = -100;
  const int64_t vocab = logits.size(-1);
  const at::Tensor padded = at::constant_pad_nd(labels, {0, 1}, kIgnore);
  const at::Tensor shifted = padded.narrow(-1, 1, labels.size(-1)).contiguous();
  return at::cross_entropy_loss(logits.to(at::kFloat).view({-1, vocab}), shifted.view({-1}), /*weight=*/{},
                                at::Reduction::Mean, kIgnore);
}

void InitWeights(LlamaForCausalLMImpl& model, uint64_t seed, double initializer_range) {
  at::NoGradGuard no_grad;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (const auto& item : model.named_parameters()) {
    at::Tensor p = item.value();
    if (item.key().size() >= 6 && item.key().compare(item.key().size() - 6, 6, "weight") == 0 && p.dim() == 1) {
      p.fill_(1.0);  // RMSNorm
    } else {
      p.copy_(at::normal(0.0, initializer_range, p.sizes(), generator, p.options().device(at::kCPU)));
    }
  }
}

}  // namespace fsdp::examples::llama
