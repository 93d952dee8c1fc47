// See llama.h. Every step follows transformers 5.24.0's
// transformers/models/llama/modeling_llama.py op for op (same ops, same order, same dtypes),
// which is what lets examples/llama/llama_parity_test.cc compare with HF at float32 rounding level.
#include "models/llama/model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <string>

#include "fsdp/meta/meta.h"

namespace fsdp::models::llama {
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

// LlamaRotaryEmbedding's inverse frequencies: rope_type "default" is 1 / theta^(arange(0, d, 2)
// / d) in float32; "llama3" (_compute_llama3_parameters) then divides the low frequencies by
// `factor` and interpolates the band between, op for op as HF (and torchtitan's "llama" scaling,
// the same formula).
at::Tensor InverseFrequencies(const LlamaConfig& config, const at::TensorOptions& f32) {
  const int64_t d = config.head_dim();
  // Python's `1.0 / t` is t.reciprocal() * 1.0 (torch/_tensor.py, __rdiv__).
  at::Tensor inv_freq = at::reciprocal(at::pow(config.rope_theta, at::arange(0, d, 2, f32) / d));
  if (!config.rope_scaling) return inv_freq;
  const Llama3RopeScaling& r = *config.rope_scaling;
  const double old_context = static_cast<double>(r.original_max_position_embeddings);
  const double low_freq_wavelen = old_context / r.low_freq_factor;
  const double high_freq_wavelen = old_context / r.high_freq_factor;
  const at::Tensor wavelen = at::reciprocal(inv_freq) * (2 * M_PI);  // 2 * math.pi / inv_freq
  const at::Tensor scaled = at::where(wavelen > low_freq_wavelen, inv_freq / r.factor, inv_freq);
  const at::Tensor smooth =
      (at::reciprocal(wavelen) * old_context - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  const at::Tensor smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
  const at::Tensor medium = at::logical_not(wavelen < high_freq_wavelen) * at::logical_not(wavelen > low_freq_wavelen);
  return at::where(medium, smoothed, scaled);
}

// LlamaRotaryEmbedding.forward (attention_scaling 1, so not applied): angles = position *
// inv_freq in float32, emb = cat(angles, angles); returns cos, sin of shape [rows, seq, head_dim]
// where positions is [rows, seq].
std::pair<at::Tensor, at::Tensor> RotaryCosSin(const LlamaConfig& config, const at::Tensor& positions,
                                               const at::Tensor& like) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(like.device());
  const at::Tensor inv_freq = InverseFrequencies(config, f32);
  const at::Tensor freqs = positions.unsqueeze(-1).to(at::kFloat) * inv_freq;  // [rows, seq, d/2]
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

  if (context_parallel) {
    // torchtitan's context_parallel(): SDPA over the cp group's ring (its kernels' scale and
    // causal mask; kv heads shared as enable_gqa shares them).
    TORCH_CHECK(config.attention == AttentionKernel::kSdpa,
                "context parallelism needs the kSdpa attention kernel (ring attention is SDPA's)");
    const at::Tensor out = context_parallel::RingAttention(q, k, v, /*is_causal=*/true, context_parallel->group,
                                                           context_parallel->options);
    return o_proj(out.transpose(1, 2).contiguous().reshape({b, s, -1}));
  }
  if (config.attention == AttentionKernel::kSdpa) {
    // torchtitan's ScaledDotProductAttention (models/common/attention.py): default scale
    // head_dim^-0.5, is_causal, kv heads shared through enable_gqa.
    const at::Tensor out = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                                            /*is_causal=*/true, /*scale=*/std::nullopt,
                                                            /*enable_gqa=*/k.size(1) != q.size(1));
    return o_proj(out.transpose(1, 2).contiguous().reshape({b, s, -1}));
  }
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

namespace {

void PlaceOn(torch::nn::Module& module, c10::Device device) {
  TORCH_CHECK(device.is_cpu() || device.is_meta(), "LlamaForCausalLM: device must be cpu or meta, got ", device);
  if (device.is_meta()) ToMeta(module);
}

}  // namespace

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& c, c10::Device device, LlamaParts p) : config(c), parts(p) {
  if (parts.end_layer == -1) parts.end_layer = c.num_hidden_layers;
  TORCH_CHECK(parts.first_layer >= 0 && parts.first_layer <= parts.end_layer && parts.end_layer <= c.num_hidden_layers,
              "LlamaModel: the layers [", parts.first_layer, ", ", parts.end_layer, ") are not within the model's ",
              c.num_hidden_layers);
  if (parts.embedding) {
    embed_tokens = register_module("embed_tokens", Embedding(c.vocab_size, c.hidden_size));
    PlaceOn(*embed_tokens, device);
  }
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> named;
  for (int64_t i = parts.first_layer; i < parts.end_layer; ++i) {
    decoder_layers.emplace_back(c);
    PlaceOn(*decoder_layers.back(), device);
    decoder_layers.back()->set_checkpointing_enabled(false);  // opt-in: apply_activation_checkpointing
    named.emplace_back(std::to_string(i), decoder_layers.back().ptr());
  }
  layers = register_module("layers", torch::nn::ModuleDict(named));
  if (parts.head) {
    norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
    PlaceOn(*norm, device);
  }
}

at::Tensor LlamaModelImpl::forward(const at::Tensor& tokens, const at::Tensor& positions) {
  at::Tensor h;
  if (parts.embedding) {
    TORCH_CHECK(tokens.dim() == 2, "LlamaModel: tokens must be [batch, seq], got ", tokens.sizes());
    h = embed_tokens(tokens);
  } else {
    TORCH_CHECK(tokens.dim() == 3 && tokens.size(2) == config.hidden_size,
                "LlamaModel (a stage without the embedding): the input must be the hidden state [batch, seq, ",
                config.hidden_size, "], got ", tokens.sizes());
    h = tokens;
  }
  at::Tensor pos = positions;
  if (pos.defined()) {
    // A later stage's hidden state may be sharded on the sequence (sequence parallel): its
    // positions are the whole sequence's.
    TORCH_CHECK(pos.dim() == 2 && (pos.size(1) == tokens.size(1) || !parts.embedding) &&
                    (pos.size(0) == 1 || pos.size(0) == tokens.size(0)),
                "LlamaModel: positions must be [1 or batch, seq] for input ", tokens.sizes(), ", got ", pos.sizes());
  } else {
    pos = at::arange(tokens.size(1), tokens.options().dtype(at::kLong)).unsqueeze(0);  // HF's position_ids
  }
  const auto [cos, sin] = RotaryCosSin(config, pos, h);
  for (auto& layer : decoder_layers) h = layer(h, cos, sin);
  return parts.head ? norm(h) : h;
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& c, c10::Device device, LlamaParts parts)
    : config(c), model(register_module("model", LlamaModel(c, device, parts))) {
  TORCH_CHECK(!c.tie_word_embeddings || parts.whole(c.num_hidden_layers),
              "LlamaForCausalLM: tied embeddings need the whole model in one part (the embedding and lm_head share "
              "one tensor), got a pipeline stage's part");
  if (!c.tie_word_embeddings && parts.head) {
    lm_head = register_module("lm_head", NoBiasLinear(c.hidden_size, c.vocab_size));
    PlaceOn(*lm_head, device);
  }
}

at::Tensor LlamaForCausalLMImpl::forward(const at::Tensor& tokens, const at::Tensor& positions) {
  const at::Tensor h = model(tokens, positions);
  if (!model->parts.head) return h;
  // Tied: the embedding's tensor as the head's weight, registered once (named_parameters()
  // lists it once, as PyTorch's dedups the shared Parameter).
  return lm_head ? lm_head(h) : at::linear(h, model->embed_tokens->weight);
}

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

namespace {

// torch.nn.init.trunc_normal_ (torch/nn/init.py, _no_grad_trunc_normal_), op for op.
void TruncNormal(at::Tensor& t, double std, double a, double b, at::Generator& generator) {
  const auto norm_cdf = [](double x) { return (1.0 + std::erf(x / std::sqrt(2.0))) / 2.0; };
  const double l = norm_cdf(a / std), u = norm_cdf(b / std);
  t.uniform_(2 * l - 1, 2 * u - 1, generator);
  t.erfinv_();
  t.mul_(std * std::sqrt(2.0));
  t.add_(0.0);
  t.clamp_(a, b);
}

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

void InitTorchtitanParameter(const LlamaConfig& config, const std::string& name, at::Tensor& full, uint64_t seed) {
  at::NoGradGuard no_grad;
  // One generator per parameter, seeded by (seed, name): FNV-1a of the name, mixed into the
  // seed by splitmix64's finalizer.
  uint64_t h = 1469598103934665603ULL;
  for (const char ch : name) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ULL;
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (h | 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(z ^ (z >> 31));
  constexpr double kStd = 0.02;
  if (EndsWith(name, "norm.weight")) {
    full.fill_(1.0);
    return;
  }
  const bool tied_embedding = name == "model.embed_tokens.weight" && config.tie_word_embeddings;
  if (name == "lm_head.weight" || tied_embedding) {
    const double s = std::pow(static_cast<double>(config.hidden_size), -0.5);
    TruncNormal(full, s, -3 * s, 3 * s, generator);
    return;
  }
  if (name == "model.embed_tokens.weight") {
    full.normal_(0.0, 1.0, generator);
    return;
  }
  // model.layers.<i>.<module>.weight
  constexpr std::string_view kPrefix = "model.layers.";
  TORCH_CHECK(name.compare(0, kPrefix.size(), kPrefix) == 0, "InitTorchtitanParameter: unknown parameter ", name);
  const size_t dot = name.find('.', kPrefix.size());
  TORCH_CHECK(dot != std::string::npos, "InitTorchtitanParameter: unknown parameter ", name);
  const int64_t layer = std::stoll(name.substr(kPrefix.size(), dot - kPrefix.size()));
  const std::string rest = name.substr(dot + 1);
  const double depth_std = kStd / std::sqrt(2.0 * static_cast<double>(layer + 1));  // depth_scaled_std
  if (rest == "self_attn.q_proj.weight" || rest == "self_attn.k_proj.weight" || rest == "self_attn.v_proj.weight" ||
      rest == "mlp.gate_proj.weight") {
    TruncNormal(full, kStd, -2.0, 2.0, generator);  // trunc_normal_'s default cut a=-2, b=2
  } else if (rest == "self_attn.o_proj.weight" || rest == "mlp.up_proj.weight" || rest == "mlp.down_proj.weight") {
    TruncNormal(full, depth_std, -2.0, 2.0, generator);
  } else {
    TORCH_CHECK(false, "InitTorchtitanParameter: unknown parameter ", name);
  }
}

void InitWeightsTorchtitan(LlamaForCausalLMImpl& model, uint64_t seed) {
  for (const auto& item : model.named_parameters()) {
    at::Tensor full = at::empty(item.value().sizes(), item.value().options().device(at::kCPU));
    InitTorchtitanParameter(model.config, item.key(), full, seed);
    at::NoGradGuard no_grad;
    item.value().copy_(full);
  }
}

}  // namespace fsdp::models::llama
