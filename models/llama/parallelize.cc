// See parallelize.h.
#include "models/llama/parallelize.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <vector>

#include "tensor_parallel/local_annotation.h"
#include "tensor_parallel/loss_parallel.h"
#include "tensor_parallel/parallel_style.h"
#include "tensor_parallel/parallelize_module.h"

namespace fsdp::models::llama {
namespace {

void CheckDivisible(const char* what, int64_t count, int64_t tp) {
  TORCH_CHECK(count % tp == 0, "ApplyTensorParallel: ", what, "=", count,
              " is not divisible by the tensor-parallel size ", tp,
              " (each rank computes whole heads and whole slices)");
}

}  // namespace

void ApplyTensorParallel(LlamaForCausalLMImpl& model, const mesh::DeviceMeshPtr& tp_mesh,
                         const TensorParallelOptions& options) {
  TORCH_CHECK(tp_mesh != nullptr, "ApplyTensorParallel: tp_mesh is null");
  const int64_t tp = tp_mesh->size();
  const LlamaConfig& c = model.config;
  CheckDivisible("num_attention_heads", c.num_attention_heads, tp);
  CheckDivisible("num_key_value_heads", c.num_key_value_heads, tp);
  CheckDivisible("intermediate_size", c.intermediate_size, tp);
  CheckDivisible("vocab_size", c.vocab_size, tp);
  TORCH_CHECK(!c.tie_word_embeddings,
              "ApplyTensorParallel: tie_word_embeddings is not supported (embed_tokens is sharded rowwise, lm_head "
              "colwise)");
  using dtensor::Placement;
  namespace tpar = tensor_parallel;
  const Placement seq = Placement::Shard(1), rep = Placement::Replicate();
  const Placement between = options.sequence_parallel ? seq : rep;  // the blocks' activations
  const auto colwise = [&] { return options.colwise({}); };
  const auto rowwise_out = [&] { return options.rowwise({.output_layouts = between}); };
  // A pipeline stage's part (LlamaParts) may lack the layers, the embedding or the norm + head:
  // the plan names what the part has.
  const bool layers = !model.model->decoder_layers.empty();
  tpar::ParallelizePlan plan;
  if (layers) {
    plan = {{"model.layers.*.self_attn.q_proj", colwise()}, {"model.layers.*.self_attn.k_proj", colwise()},
            {"model.layers.*.self_attn.v_proj", colwise()}, {"model.layers.*.self_attn.o_proj", rowwise_out()},
            {"model.layers.*.mlp.gate_proj", colwise()},    {"model.layers.*.mlp.up_proj", colwise()},
            {"model.layers.*.mlp.down_proj", rowwise_out()}};
  }
  if (model.model->embed_tokens) {
    plan.push_back({"model.embed_tokens", tpar::RowwiseParallel({.input_layouts = rep, .output_layouts = between})});
  }
  const bool head = model.model->parts.head;
  if (head) {
    plan.push_back({"lm_head", tpar::ColwiseParallel({.input_layouts = between,
                                                      .output_layouts = Placement::Shard(-1),
                                                      .use_local_output = false})});
  }
  if (options.sequence_parallel && head) plan.push_back({"model.norm", tpar::SequenceParallel()});
  if (options.sequence_parallel && layers) {
    plan.insert(plan.end(),
                {{"model.layers.*.input_layernorm", tpar::SequenceParallel()},
                 {"model.layers.*.post_attention_layernorm", tpar::SequenceParallel()},
                 // forward(hidden, cos, sin): only the hidden states are sharded.
                 {"model.layers.*.self_attn",
                  options.prepare_module_input({{seq, std::nullopt, std::nullopt}, {rep, std::nullopt, std::nullopt}})},
                 {"model.layers.*.mlp", options.prepare_module_input({{seq}, {rep}})}});
  }
  tpar::parallelize_module(model, tp_mesh, plan, options.src_data_rank);
}

void ApplyContextParallel(LlamaForCausalLMImpl& model, const comm::ProcessGroupPtr& cp_group,
                          const context_parallel::RingAttentionOptions& options) {
  TORCH_CHECK(cp_group != nullptr, "ApplyContextParallel: cp_group is null");
  TORCH_CHECK(model.config.attention == AttentionKernel::kSdpa,
              "ApplyContextParallel: context parallelism needs the kSdpa attention kernel");
  auto setting = std::make_shared<const ContextParallelAttention>(ContextParallelAttention{cp_group, options});
  for (auto& layer : model.model->decoder_layers) layer->self_attn->context_parallel = setting;
}

at::Tensor CausalLMLossParallel(const at::Tensor& logits, const at::Tensor& labels) {
  const std::optional<dtensor::DTensor> d = tensor_parallel::AsDTensor(logits);
  TORCH_CHECK(d.has_value(),
              "CausalLMLossParallel: the logits carry no DTensor layout (lm_head must be "
              "ColwiseParallel with use_local_output = false, as ApplyTensorParallel makes it)");
  const int64_t vocab = d->sizes().back();
  constexpr int64_t kIgnore = -100;
  const at::Tensor padded = at::constant_pad_nd(labels, {0, 1}, kIgnore);
  const at::Tensor shifted = padded.narrow(-1, 1, labels.size(-1)).contiguous();
  // HF's ForCausalLMLoss: float32 logits viewed [batch * seq, vocab], the vocab dim sharded.
  const at::Tensor local = logits.to(at::kFloat).reshape({-1, logits.size(-1)});
  const dtensor::DTensor flat = dtensor::DTensor::from_local(local, d->device_mesh(), {dtensor::Placement::Shard(1)},
                                                             std::vector<int64_t>{local.size(0), vocab});
  return tensor_parallel::loss_parallel_cross_entropy(flat, shifted.view({-1}),
                                                      {tensor_parallel::LossReduction::kMean, kIgnore});
}

}  // namespace fsdp::models::llama
