#include "examples/llama/llama_training.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

#include "dcp/hf.h"
#include "fsdp/activation_checkpointing/checkpoint_wrapper.h"
#include "fsdp/fsdp2/clip_grad_norm.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "models/llama/parallelize.h"

namespace fsdp::examples::llama {

using models::llama::CausalLMLoss;
using models::llama::LlamaConfig;
using models::llama::LlamaForCausalLM;
using models::llama::LlamaForCausalLMImpl;

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
    models::llama::ApplyTensorParallel(*s.model, s.tp_mesh);
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
  const at::Tensor logits = s.model(ids, at::Tensor());
  const at::Tensor loss = s.tp_mesh ? models::llama::CausalLMLossParallel(logits, ids) : CausalLMLoss(logits, ids);
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
