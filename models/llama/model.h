// The Llama-3 architecture in LibTorch, shared by the trainer (//train) and the examples: the
// model Hugging Face transformers' LlamaForCausalLM computes (transformers 5.24.0,
// transformers/models/llama/modeling_llama.py; the loss: transformers/loss/loss_utils.py,
// ForCausalLMLoss), which is torchtitan's Llama3Model (torchtitan/models/llama3/model.py) up
// to the q/k row order that torchtitan's state-dict adapter permutes. Checked against
// transformers by examples/llama/llama_parity_test.cc and against torchtitan by
// models/llama/torchtitan_parity_test.cc.
//
// Parameter names are HF's state_dict keys, one to one and spelled identically, so an HF
// state_dict (torch.save'd, read with checkpoint::LoadTensorDict) loads by name:
//   model.embed_tokens.weight                          [vocab, hidden]
//   model.layers.<i>.self_attn.{q,k,v,o}_proj.weight   q: [heads*head_dim, hidden],
//                                                      k, v: [kv_heads*head_dim, hidden],
//                                                      o: [hidden, heads*head_dim]
//   model.layers.<i>.mlp.{gate,up,down}_proj.weight    gate, up: [intermediate, hidden],
//                                                      down: [hidden, intermediate]
//   model.layers.<i>.{input,post_attention}_layernorm.weight   [hidden]
//   model.norm.weight                                  [hidden]
//   lm_head.weight                                     [vocab, hidden] (absent when tied: the
//                                                      embedding's tensor is the head's weight)
// registered in HF's order (named_parameters() order is the same), no biases
// (attention_bias = mlp_bias = False). HF's rotary inv_freq is a non-persistent buffer, not in
// its state_dict; here it is recomputed in each forward and registered nowhere.
//
// Each decoder layer and the whole model are fsdp::Hooked, so fsdp::fsdp2::fully_shard
// can wrap each layer and then the root (the usual FSDP2 plan). The inner `model` (HF's
// LlamaModel) is a plain module: the root's FSDP group holds its embedding and norm.
#ifndef FSDP_MODELS_LLAMA_MODEL_H_
#define FSDP_MODELS_LLAMA_MODEL_H_

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/process_group.h"
#include "context_parallel/ring_attention.h"
#include "fsdp/activation_checkpointing/checkpoint_wrapper.h"
#include "fsdp/hooked_module/hooked_module.h"

namespace fsdp::models::llama {

// Llama 3.1's rotary frequency scaling: HF's rope_type "llama3"
// (transformers/modeling_rope_utils.py, _compute_llama3_parameters), torchtitan's RoPE scaling
// "llama" (torchtitan/models/common/rope.py); the defaults are both's.
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// How attention is computed: HF's eager path (matmul, additive mask, float32 softmax) or
// at::scaled_dot_product_attention with is_causal (torchtitan's ScaledDotProductAttention and
// HF's "sdpa"; the fused kernels where the device has them).
enum class AttentionKernel { kEager, kSdpa };

// LlamaConfig's fields that shape the model (head_dim = hidden / heads, as HF's default).
struct LlamaConfig {
  int64_t vocab_size = 64;
  int64_t hidden_size = 32;
  int64_t intermediate_size = 64;
  int64_t num_hidden_layers = 2;
  int64_t num_attention_heads = 4;
  int64_t num_key_value_heads = 2;  // grouped-query attention: heads share kv heads in groups
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;
  std::optional<Llama3RopeScaling> rope_scaling;  // unset: HF's rope_type "default"
  bool tie_word_embeddings = false;
  AttentionKernel attention = AttentionKernel::kEager;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
};

// The layers are fsdp::Hooked modules so that parallel styles (tensor_parallel/parallel_style.h) and
// FSDP can attach to them; with no hooks each is exactly its torch::nn module.
using Linear = Hooked<torch::nn::LinearImpl>;
using Embedding = Hooked<torch::nn::EmbeddingImpl>;

// Ring attention's group and options (ApplyContextParallel).
struct ContextParallelAttention {
  comm::ProcessGroupPtr group;
  context_parallel::RingAttentionOptions options;
};

// LlamaRMSNorm: y = weight * (x * rsqrt(mean(x^2) + eps)), normalized in float32, with eps
// inside the square root.
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t hidden_size, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  double eps;
};
using RMSNorm = Hooked<RMSNormImpl>;

// LlamaAttention: rotary embeddings on q and k, then causal attention over kv heads shared by
// groups of query heads, scaled by head_dim^-0.5. kEager is eager_attention_forward (kv heads
// repeated, additive mask, softmax in float32); kSdpa is at::scaled_dot_product_attention
// (is_causal, enable_gqa).
struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(const LlamaConfig& config);
  // x [batch, seq, hidden]; cos, sin [1 or batch, seq, head_dim] -> [batch, seq, hidden]. Under
  // tensor parallelism q/k/v hold this rank's heads and the output is o_proj's partial sum.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  LlamaConfig config;
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  // Set by ApplyContextParallel (parallelize.h): the sequence is sharded over this group and
  // attention is ring attention (context_parallel/ring_attention.h).
  std::shared_ptr<const ContextParallelAttention> context_parallel;
};
using Attention = Hooked<AttentionImpl>;

// LlamaMLP (SwiGLU): down(silu(gate(x)) * up(x)).
struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(const LlamaConfig& config);
  at::Tensor forward(const at::Tensor& x);
  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
using MLP = Hooked<MLPImpl>;

// LlamaDecoderLayer: pre-norm attention and MLP, each added to its residual.
struct DecoderLayerImpl : torch::nn::Module {
  explicit DecoderLayerImpl(const LlamaConfig& config);
  // All arguments are tensors so FSDP's forward hooks see them (hooked_module.h).
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin);
  Attention self_attn{nullptr};
  MLP mlp{nullptr};
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
// Checkpointable (fsdp/activation_checkpointing/checkpoint_wrapper.h), off until enabled with
// apply_activation_checkpointing: then each layer keeps only its inputs in forward and
// recomputes itself in backward (inside FSDP2's hooks, so no extra all-gather).
using DecoderLayer = activation_checkpointing::Checkpointed<DecoderLayerImpl>;

// The part of the model a pipeline stage holds (torchtitan's split of a Llama model,
// torchtitan/distributed/pipeline_parallel.py): the embedding or not, the decoder layers
// [first_layer, end_layer), the final norm and lm_head or not. Names stay the whole model's
// (the stage holding layer 5 has "model.layers.5.*"), so checkpoints of the stages together
// are the whole model's. Default: the whole model.
struct LlamaParts {
  bool embedding = true;
  int64_t first_layer = 0;
  int64_t end_layer = -1;  // -1: num_hidden_layers
  bool head = true;        // model.norm and lm_head
  bool whole(int64_t num_layers) const {
    return embedding && head && first_layer == 0 && (end_layer == -1 || end_layer == num_layers);
  }
};

// LlamaModel: embedding, the layers, final norm. Not hooked: fully_shard wraps the layers and
// the root (LlamaForCausalLM), as PyTorch's FSDP2 recipes for HF models do.
struct LlamaModelImpl : torch::nn::Module {
  // `device` kMeta: each submodule moves to the meta device as soon as it is built (peak: one
  // decoder layer, or the embedding), for fully_shard + fsdp2::InitMetaParameters.
  explicit LlamaModelImpl(const LlamaConfig& config, c10::Device device = c10::kCPU, LlamaParts parts = {});
  // tokens [batch, seq] (int64), positions [batch or 1, seq] (int64: each token's rotary
  // position, as torchtitan's per-document positions; undefined: 0 .. seq-1) -> the last
  // hidden state [batch, seq, hidden]. Without the embedding part the input is the previous
  // stage's hidden state [batch, seq, hidden]; without the head part the output is not normed.
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& positions);
  LlamaConfig config;
  LlamaParts parts;
  Embedding embed_tokens{nullptr};           // null without the embedding part
  torch::nn::ModuleDict layers{nullptr};     // DecoderLayer each; children named "<layer index>"
  std::vector<DecoderLayer> decoder_layers;  // the same modules, typed (for forward and fully_shard)
  RMSNorm norm{nullptr};                     // null without the head part
};
TORCH_MODULE(LlamaModel);

// LlamaForCausalLM: LlamaModel and the lm_head (tied: its weight is the embedding's tensor,
// registered once, as HF's and torchtitan's weight tying).
struct LlamaForCausalLMImpl : torch::nn::Module {
  // `device`: kCPU, or kMeta (as LlamaModelImpl). `parts`: a pipeline stage's part (tied
  // embeddings need the whole model).
  explicit LlamaForCausalLMImpl(const LlamaConfig& config, c10::Device device = c10::kCPU, LlamaParts parts = {});
  // tokens [batch, seq], positions as LlamaModelImpl::forward -> logits [batch, seq, vocab]
  // (a stage without the head part: its hidden state).
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& positions);
  LlamaConfig config;
  LlamaModel model{nullptr};
  Linear lm_head{nullptr};
};
using LlamaForCausalLM = Hooked<LlamaForCausalLMImpl>;

// HF's loss with labels = tokens (ForCausalLMLoss): labels padded with -100 on the right and
// shifted left by one, so position t predicts token t+1 and each row's last position is
// ignored; then the mean cross-entropy over the remaining batch * (seq - 1) positions, on
// float32 logits.
at::Tensor CausalLMLoss(const at::Tensor& logits, const at::Tensor& labels);

// Initializes like HF's _init_weights (LlamaPreTrainedModel): normal(0, initializer_range)
// for linear and embedding weights, ones for RMSNorm weights; one CPU generator seeded `seed`.
void InitWeights(LlamaForCausalLMImpl& model, uint64_t seed, double initializer_range = 0.02);

// torchtitan's initialization of the parameter named `name` (an HF name of this model), drawn
// into `full`, the whole parameter on the CPU (torchtitan/models/llama3/__init__.py's
// param_init tables): RMSNorm weights ones; the embedding normal(0, 1); q/k/v and gate_proj
// truncated normal(0, 0.02) cut at +-2; o_proj, up_proj and down_proj truncated normal with
// torchtitan's depth-scaled std 0.02 / sqrt(2 * (layer + 1)); lm_head truncated normal(0,
// hidden^-0.5) cut at +-3 std. Tied, the embedding takes lm_head's init (torchtitan skips the
// embedding's own). The draw is torch.nn.init.trunc_normal_'s (uniform, erfinv, scale, clamp)
// from a CPU generator seeded by `seed` and the name alone, so a parameter's values depend on
// (seed, name, shape) only: not on the order parameters are initialized in, nor on the world
// size or mesh when each rank initializes the full parameter and keeps its shard (meta-device
// init, fsdp/fsdp2/meta_init.h). An unknown name is a c10::Error.
void InitTorchtitanParameter(const LlamaConfig& config, const std::string& name, at::Tensor& full, uint64_t seed);
// InitTorchtitanParameter over every parameter of an unsharded model.
void InitWeightsTorchtitan(LlamaForCausalLMImpl& model, uint64_t seed);

}  // namespace fsdp::models::llama

#endif  // FSDP_MODELS_LLAMA_MODEL_H_
