#include "examples/llama/llama_training.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

#include "dcp/hf.h"
#include "fsdp/activation_checkpointing/checkpoint_wrapper.h"
#include "fsdp/fsdp2/clip_grad_norm.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "tensor_parallel/local_annotation.h"
#include "tensor_parallel/loss_parallel.h"
#include "tensor_parallel/parallel_style.h"
#include "tensor_parallel/parallelize_module.h"

namespace fsdp::examples::llama {

LlamaConfig HfReferenceConfig() {
  LlamaConfig c;
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.rope_theta = 500000.0;
  c.rms_norm_eps = 1e-5;
  return c;
}

LlamaConfig TwoDReferenceConfig() {
  LlamaConfig c = HfReferenceConfig();
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  return c;
}

void ParallelizeLlama(LlamaForCausalLMImpl& model, const mesh::DeviceMeshPtr& tp_mesh) {
  TORCH_CHECK(tp_mesh != nullptr, "ParallelizeLlama: tp_mesh is null");
  const int64_t tp = tp_mesh->size();
  const LlamaConfig& c = model.config;
  TORCH_CHECK(c.num_attention_heads % tp == 0, "ParallelizeLlama: num_attention_heads=", c.num_attention_heads,
              " is not divisible by the tensor-parallel size ", tp, " (each rank computes whole heads)");
  TORCH_CHECK(c.num_key_value_heads % tp == 0, "ParallelizeLlama: num_key_value_heads=", c.num_key_value_heads,
              " is not divisible by the tensor-parallel size ", tp, " (each rank computes whole heads)");
  using dtensor::Placement;
  const Placement seq = Placement::Shard(1), rep = Placement::Replicate();
  const auto colwise = [] { return tensor_parallel::ColwiseParallel(); };
  const auto rowwise_to_seq = [&] { return tensor_parallel::RowwiseParallel({.output_layouts = seq}); };
  tensor_parallel::parallelize_module(
      model, tp_mesh,
      {{"model.embed_tokens", tensor_parallel::RowwiseParallel({.input_layouts = rep, .output_layouts = seq})},
       {"model.norm", tensor_parallel::SequenceParallel()},
       {"lm_head", tensor_parallel::ColwiseParallel(
                       {.input_layouts = seq, .output_layouts = Placement::Shard(-1), .use_local_output = false})},
       {"model.layers.*.input_layernorm", tensor_parallel::SequenceParallel()},
       // forward(hidden, cos, sin): only the hidden states are sharded.
       {"model.layers.*.self_attn",
        tensor_parallel::PrepareModuleInput({{seq, std::nullopt, std::nullopt}, {rep, std::nullopt, std::nullopt}})},
       {"model.layers.*.self_attn.q_proj", colwise()},
       {"model.layers.*.self_attn.k_proj", colwise()},
       {"model.layers.*.self_attn.v_proj", colwise()},
       {"model.layers.*.self_attn.o_proj", rowwise_to_seq()},
       {"model.layers.*.post_attention_layernorm", tensor_parallel::SequenceParallel()},
       {"model.layers.*.mlp", tensor_parallel::PrepareModuleInput({{seq}, {rep}})},
       {"model.layers.*.mlp.gate_proj", colwise()},
       {"model.layers.*.mlp.up_proj", colwise()},
       {"model.layers.*.mlp.down_proj", rowwise_to_seq()}});
}

at::Tensor CausalLMLossParallel(const at::Tensor& logits, const at::Tensor& labels) {
  const std::optional<dtensor::DTensor> d = tensor_parallel::AsDTensor(logits);
  TORCH_CHECK(d.has_value(),
              "CausalLMLossParallel: the logits carry no DTensor layout (lm_head must be "
              "ColwiseParallel with use_local_output = false, as ParallelizeLlama makes it)");
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

void LoadHfWeights(LlamaForCausalLMImpl& model, const checkpoint::TensorDict& init) {
  at::NoGradGuard no_grad;
  const auto params = model.named_parameters();
  TORCH_CHECK(params.size() == init.size(), "LoadHfWeights: the model has ", params.size(),
              " parameters, the HF state_dict ", init.size(), " entries");
  for (const auto& item : params) {
    const at::Tensor* hf = init.find(item.key());
    TORCH_CHECK(hf != nullptr, "LoadHfWeights: the HF state_dict has no '", item.key(), "'");
    TORCH_CHECK(hf->sizes() == item.value().sizes(), "LoadHfWeights: '", item.key(), "' is ", hf->sizes(),
                " in the HF state_dict, ", item.value().sizes(), " in the model");
    item.value().copy_(*hf);
  }
}

ShardedLlama BuildShardedLlama(const std::string& hf_dir, const mesh::DeviceMeshPtr& mesh,
                               bool activation_checkpointing, const LlamaConfig& config, c10::ScalarType dtype) {
  TORCH_CHECK(mesh != nullptr && (mesh->ndim() == 1 || mesh->ndim() == 2),
              "BuildShardedLlama: the mesh must be 1-D (FSDP) or 2-D (\"dp\", \"tp\")");
  ShardedLlama s;
  s.model = LlamaForCausalLM(config);
  s.model->to(dtype);
  activation_checkpointing::apply_activation_checkpointing(*s.model, nullptr, activation_checkpointing);
  s.dp_mesh = mesh;
  if (mesh->ndim() == 2) {
    s.dp_mesh = (*mesh)["dp"];
    s.tp_mesh = (*mesh)["tp"];
    ParallelizeLlama(*s.model, s.tp_mesh);
  }
  for (auto& layer : s.model->model->decoder_layers) fsdp2::fully_shard(layer.ptr(), {.mesh = s.dp_mesh});
  fsdp2::fully_shard(s.model.ptr(), {.mesh = s.dp_mesh});
  dcp::LoadHuggingFace(*s.model, hf_dir);
  s.opt = std::make_unique<torch::optim::AdamW>(s.model->parameters(),
                                                torch::optim::AdamWOptions(kLr).weight_decay(kWeightDecay));
  s.world = mesh->world();
  return s;
}

at::Tensor ForwardBackward(ShardedLlama& s, const at::Tensor& global_tokens) {
  const int64_t dp = s.dp_mesh->size();
  TORCH_CHECK(global_tokens.dim() == 2 && global_tokens.size(0) % dp == 0, "TrainStep: a batch of ",
              global_tokens.sizes(), " does not split into ", dp, " equal slices");
  const int64_t rows = global_tokens.size(0) / dp;
  // Equal slices hold equally many (unignored) label positions, so the mean of the dp ranks'
  // mean losses, and FSDP's averaged gradients, are the global batch's.
  const at::Tensor ids = global_tokens.narrow(0, s.dp_mesh->coordinate()[0] * rows, rows);
  const at::Tensor logits = s.model(ids);
  const at::Tensor loss = s.tp_mesh ? CausalLMLossParallel(logits, ids) : CausalLMLoss(logits, ids);
  loss.backward();
  return loss;
}

StepResult FinishStep(ShardedLlama& s, const at::Tensor& loss) {
  StepResult result;
  result.grad_norm = fsdp2::clip_grad_norm_(*s.model, kMaxNorm).item<double>();
  s.opt->step();
  s.opt->zero_grad();
  at::Tensor total = loss.detach().clone().reshape({1});
  s.dp_mesh->group(0)->all_reduce(total)->wait();
  result.loss = total.item<double>() / static_cast<double>(s.dp_mesh->size());
  return result;
}

StepResult TrainStep(ShardedLlama& s, const at::Tensor& global_tokens) {
  return FinishStep(s, ForwardBackward(s, global_tokens));
}

double RelDiff(const at::Tensor& got, const at::Tensor& want) {
  TORCH_CHECK(got.sizes() == want.sizes(), "RelDiff: shapes differ, ", got.sizes(), " vs ", want.sizes());
  const double scale = std::max(1.0, want.abs().max().item<double>());
  return (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>() / scale;
}

double ReferenceSpread(const checkpoint::TensorDict& ref, const std::string& prefix, bool step0) {
  double spread = 0;
  int compared = 0;
  for (const auto& item : ref) {
    const std::string& key = item.key();
    const bool is_step0 = key == "logits0" || key == "loss0" || key.rfind("grad.", 0) == 0;
    const bool is_trained = key == "losses" || key == "grad_norms" || key.rfind("final.", 0) == 0;
    if (!(step0 ? is_step0 : is_trained)) continue;
    const at::Tensor* other = ref.find(prefix + key);
    if (other == nullptr) continue;
    spread = std::max(spread, RelDiff(*other, item.value()));
    ++compared;
  }
  TORCH_CHECK(compared > 0, "ReferenceSpread: the reference holds no ", step0 ? "step-0" : "trained",
              " keys under prefix '", prefix, "' (written by an older hf_llama_*.py?)");
  return spread;
}

double TrainingTolerance(const checkpoint::TensorDict& ref, int world) {
  return 2 * ReferenceSpread(ref, "f64.") + ReferenceSpread(ref, "rows" + std::to_string(world) + ".");
}

}  // namespace fsdp::examples::llama
