// Tensor parallelism for the Llama model (models/llama/model.h): torchtitan's Llama-3 plan
// (torchtitan/models/llama3/sharding.py, models/common/decoder_sharding.py) in Hugging Face's
// module names, over tensor_parallel's parallel styles.
//
// Contract: ApplyTensorParallel runs once on an unsharded model, before fully_shard, on every
// rank of the 1-D `tp_mesh` (collective over it: the styles' parameter distribution). It
// throws a c10::Error naming the count when num_attention_heads, num_key_value_heads,
// intermediate_size or vocab_size is not divisible by the tp degree (each rank computes whole
// heads and whole slices), or when the model ties its embeddings (the plan shards the
// embedding and lm_head differently). After it, the forward's logits are a vocab-sharded
// DTensor (loss parallel: CausalLMLossParallel / VocabParallelCrossEntropy read them without a
// gather).
#ifndef FSDP_MODELS_LLAMA_PARALLELIZE_H_
#define FSDP_MODELS_LLAMA_PARALLELIZE_H_

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>

#include "mesh/device_mesh.h"
#include "models/llama/model.h"
#include "tensor_parallel/parallel_style.h"

namespace fsdp::models::llama {

struct TensorParallelOptions {
  // torchtitan's parallelism.enable_sequence_parallel. On: the activations between blocks are
  // sequence-sharded (Shard(1)): embed_tokens rowwise to Shard(1); the norms SequenceParallel;
  // self_attn and mlp gather Shard(1) -> Replicate on entry; o_proj and down_proj rowwise
  // reduce-scatter to Shard(1); lm_head colwise from Shard(1). Off: the activations stay
  // replicated (embed_tokens, o_proj, down_proj all-reduce to Replicate; the norms unsharded).
  bool sequence_parallel = true;
  // parallelize_module's: the rank whose parameter values every rank takes (a broadcast per
  // parameter); nullopt: each rank keeps its own part (a meta-device model, initialized after
  // sharding, or one every rank initialized alike).
  std::optional<int> src_data_rank = 0;
  // The styles of the blocks' linears (q/k/v, gate/up colwise; o_proj, down_proj rowwise) and of
  // self_attn's and mlp's inputs under sequence parallelism: torchtitan's apply_tp takes
  // torchao's float8 ones (float8/float8_parallel_style.h) for tensorwise float8 linears.
  std::function<tensor_parallel::ParallelStylePtr(tensor_parallel::LinearStyleOptions)> colwise =
      tensor_parallel::ColwiseParallel;
  std::function<tensor_parallel::ParallelStylePtr(tensor_parallel::LinearStyleOptions)> rowwise =
      tensor_parallel::RowwiseParallel;
  std::function<tensor_parallel::ParallelStylePtr(tensor_parallel::PrepareModuleInputOptions)> prepare_module_input =
      tensor_parallel::PrepareModuleInput;
};

// q/k/v and gate/up colwise, o_proj and down_proj rowwise, embed_tokens rowwise, lm_head colwise
// to a vocab-sharded DTensor output; the layouts between them as `options` says.
void ApplyTensorParallel(LlamaForCausalLMImpl& model, const mesh::DeviceMeshPtr& tp_mesh,
                         const TensorParallelOptions& options = {});

// Context parallelism: every decoder layer's attention becomes ring attention over
// `cp_group` (context_parallel/ring_attention.h, PyTorch's context_parallel() for SDPA); the
// caller shards the tokens, labels and positions along the sequence (context_parallel/
// load_balancer.h: head-tail when options.load_balanced). Errors: a null group, a model whose
// attention kernel is not kSdpa.
void ApplyContextParallel(LlamaForCausalLMImpl& model, const comm::ProcessGroupPtr& cp_group,
                          const context_parallel::RingAttentionOptions& options);

// CausalLMLoss (model.h) of ApplyTensorParallel's vocab-sharded logits (loss parallel: no
// gather). A c10::Error when the logits carry no DTensor layout.
at::Tensor CausalLMLossParallel(const at::Tensor& logits, const at::Tensor& labels);

}  // namespace fsdp::models::llama

#endif  // FSDP_MODELS_LLAMA_PARALLELIZE_H_
