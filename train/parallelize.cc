// See parallelize.h.
#include "train/parallelize.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "float8/float8_linear.h"
#include "float8/float8_parallel_style.h"
#include "fsdp/activation_checkpointing/checkpoint_wrapper.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/meta_init.h"
#include "models/llama/flavors.h"
#include "models/llama/hf_config.h"
#include "models/llama/parallelize.h"
#include "train/selective_ac.h"
#include "train/torchtitan_checkpoint.h"

namespace fsdp::train {
namespace {

void CheckDivisible(const char* key, int64_t value, int64_t tp, const char* why) {
  TORCH_CHECK(value % tp == 0, key, " = ", value, " is not divisible by parallelism.tensor_parallel_degree = ", tp,
              " (", why, ")");
}

}  // namespace

c10::ScalarType ScalarTypeOf(DType dtype) { return dtype == DType::kBFloat16 ? at::kBFloat16 : at::kFloat; }

models::llama::LlamaConfig ResolveModelConfig(const JobConfig& config, int64_t tp_degree) {
  const ModelConfig& m = config.model;
  TORCH_CHECK(m.name == "llama3", "model.name = \"", m.name, "\" is not a model this trainer has (llama3)");
  // A torchtitan flavor, or, with no flavor, the model of the Hugging Face directory.
  TORCH_CHECK(!m.flavor.empty() || !config.hf_assets_path.empty(),
              "model.flavor is empty and hf_assets_path is not set: name a flavor, or a Hugging Face directory whose "
              "config.json gives the model");
  models::llama::LlamaConfig c = m.flavor.empty() ? models::llama::LoadHfLlamaConfig(config.hf_assets_path)
                                                  : models::llama::Llama3Flavor(m.flavor);
  // The registry's ffn inputs, for a changed dim / multiple_of / multiplier.
  int64_t multiple_of = 256;
  std::optional<double> multiplier;
  for (const auto& [name, mult, mul] :
       std::vector<std::tuple<std::string, int64_t, std::optional<double>>>{{"debugmodel", 256, std::nullopt},
                                                                            {"1B", 1024, 1.5},
                                                                            {"3B", 1024, 1.0},
                                                                            {"8B", 1024, 1.3},
                                                                            {"70B", 4096, 1.3},
                                                                            {"405B", 4096, 1.2}}) {
    if (name == m.flavor) multiple_of = mult, multiplier = mul;
  }
  const auto positive = [](const char* key, int64_t v) {
    TORCH_CHECK(v >= 1, key, " = ", v, " must be at least 1");
    return v;
  };
  if (m.dim) c.hidden_size = positive("model.dim", *m.dim);
  if (m.n_layers) c.num_hidden_layers = positive("model.n_layers", *m.n_layers);
  if (m.n_heads) c.num_attention_heads = c.num_key_value_heads = positive("model.n_heads", *m.n_heads);
  if (m.n_kv_heads) c.num_key_value_heads = positive("model.n_kv_heads", *m.n_kv_heads);
  if (m.vocab_size) c.vocab_size = positive("model.vocab_size", *m.vocab_size);
  if (m.multiple_of) multiple_of = positive("model.multiple_of", *m.multiple_of);
  if (m.ffn_dim_multiplier) multiplier = *m.ffn_dim_multiplier;
  if (m.dim || m.multiple_of || m.ffn_dim_multiplier) {
    c.intermediate_size = models::llama::ComputeFfnHiddenDim(c.hidden_size, multiple_of, multiplier);
  }
  if (m.norm_eps) c.rms_norm_eps = *m.norm_eps;
  if (m.rope_theta) c.rope_theta = *m.rope_theta;
  if (m.enable_weight_tying) c.tie_word_embeddings = *m.enable_weight_tying;
  TORCH_CHECK(c.hidden_size % c.num_attention_heads == 0, "model.dim = ", c.hidden_size,
              " is not divisible by model.n_heads = ", c.num_attention_heads);
  TORCH_CHECK(c.num_attention_heads % c.num_key_value_heads == 0, "model.n_heads = ", c.num_attention_heads,
              " is not divisible by model.n_kv_heads = ", c.num_key_value_heads);
  TORCH_CHECK((c.hidden_size / c.num_attention_heads) % 2 == 0,
              "model.dim / model.n_heads = ", c.hidden_size / c.num_attention_heads,
              " must be even (rotary embeddings rotate pairs)");
  if (tp_degree > 1) {
    CheckDivisible("model.n_heads", c.num_attention_heads, tp_degree, "each rank computes whole heads");
    CheckDivisible("model.n_kv_heads", c.num_key_value_heads, tp_degree, "each rank computes whole heads");
    CheckDivisible("model.vocab_size", c.vocab_size, tp_degree, "the head and the loss shard the vocabulary");
    CheckDivisible("the feed-forward hidden size (model.dim, model.multiple_of, model.ffn_dim_multiplier)",
                   c.intermediate_size, tp_degree, "colwise and rowwise linears shard it");
    TORCH_CHECK(!c.tie_word_embeddings, "model.enable_weight_tying = true is not supported with tensor parallelism");
  }
  c.attention = models::llama::AttentionKernel::kSdpa;
  return c;
}

ParallelMeshes BuildMeshes(const comm::ProcessGroupPtr& world, const ResolvedDegrees& degrees) {
  ParallelMeshes m;
  // torchtitan's ParallelDims order; pp and cp only when used (each dim creates groups).
  std::vector<int64_t> shape;
  std::vector<std::string> names;
  if (degrees.pp > 1) {
    shape.push_back(degrees.pp);
    names.push_back("pp");
  }
  shape.insert(shape.end(), {degrees.dp_replicate, degrees.dp_shard});
  names.insert(names.end(), {"dp_replicate", "dp_shard"});
  if (degrees.cp > 1) {
    shape.push_back(degrees.cp);
    names.push_back("cp");
  }
  shape.push_back(degrees.tp);
  names.push_back("tp");
  m.world = mesh::DeviceMesh::Create(world, shape, names);
  m.pp = degrees.pp > 1 ? (*m.world)["pp"] : nullptr;
  m.tp = degrees.tp > 1 ? (*m.world)["tp"] : nullptr;
  const bool hsdp = degrees.dp_replicate > 1;
  m.batch = hsdp ? m.world->flatten({"dp_replicate", "dp_shard"}, "dp") : (*m.world)["dp_shard"];
  if (degrees.cp > 1) {
    // torchtitan's dp_shard_cp: FSDP shards over the data-parallel and context-parallel ranks
    // together; the loss and token counts sum over every rank holding tokens of the batch.
    m.cp = (*m.world)["cp"];
    const mesh::DeviceMeshPtr shard_cp = m.world->flatten({"dp_shard", "cp"}, "dp_shard_cp");
    m.fsdp = hsdp ? mesh::Concatenate({(*m.world)["dp_replicate"], shard_cp}) : shard_cp;
    m.loss = hsdp ? m.world->flatten({"dp_replicate", "dp_shard", "cp"}, "dp_cp") : shard_cp;
  } else {
    m.fsdp = hsdp ? m.world->slice({"dp_replicate", "dp_shard"}) : (*m.world)["dp_shard"];
    m.loss = m.batch;
  }
  m.dp_rank = m.batch->coordinate()[0];
  m.dp_size = m.batch->size();
  return m;
}

int ConvertFloat8(models::llama::LlamaForCausalLM& model, const JobConfig& config) {
  const auto& converters = config.model.converters;
  if (std::find(converters.begin(), converters.end(), "float8") == converters.end()) return 0;
  const Float8Config& f8 = config.float8;
  const char* recipe = f8.recipe_name == Float8Recipe::kTensorwise ? "tensorwise"
                       : f8.recipe_name == Float8Recipe::kRowwise  ? "rowwise"
                                                                   : "rowwise_with_gw_hp";
  // torchtitan 0.3.0's Float8LinearConverter: with emulate, torchao's default config
  // (tensorwise) emulated, whatever recipe_name says.
  float8::Float8LinearConfig c =
      f8.emulate ? float8::Float8LinearConfig{} : float8::Float8LinearConfig::FromRecipeName(recipe);
  c.emulate = f8.emulate;
  c.enable_fsdp_float8_all_gather = f8.enable_fsdp_float8_all_gather;
  // torchtitan's filter_fqns name torchtitan's modules ("layers.0.attention.qkv_linear.wq");
  // ours are Hugging Face's: a Linear is filtered when either name contains an entry.
  std::vector<std::string> fqns;
  bool auto_filter = false;
  for (const std::string& f : f8.filter_fqns) {
    if (f == "auto_filter_small_kn") {
      auto_filter = true;
    } else {
      fqns.push_back(f);
    }
  }
  TORCH_CHECK(!auto_filter || f8.recipe_name != Float8Recipe::kRowwiseWithGwHp,
              "float8.filter_fqns = [\"auto_filter_small_kn\"] has no size thresholds for recipe_name = "
              "\"rowwise_with_gw_hp\" (torchao's _auto_filter_for_recipe: tensorwise and rowwise)");
  const float8::ModuleFilterFn base = auto_filter ? float8::AutoFilterForRecipe(recipe, {}) : float8::FilterFqns({});
  const float8::ModuleFilterFn filter = [base, fqns](const torch::nn::LinearImpl& linear, const std::string& fqn) {
    if (!base(linear, fqn)) return false;
    const std::string titan = TorchtitanFqn(fqn + ".weight");
    const std::string titan_module = titan.substr(0, titan.size() - std::string(".weight").size());
    return std::none_of(fqns.begin(), fqns.end(), [&](const std::string& f) {
      return fqn.find(f) != std::string::npos || titan_module.find(f) != std::string::npos;
    });
  };
  return float8::convert_to_float8_training(*model, c, filter);
}

namespace {

// Whether every decoder layer's linears are float8 with tensorwise scaling (what torchao's
// float8 tensor-parallel styles take); false without layers.
bool BlockLinearsAreTensorwiseFloat8(models::llama::LlamaForCausalLM& model) {
  auto& layers = model->model->decoder_layers;
  if (layers.empty()) return false;
  for (auto& layer : layers) {
    for (const auto& item : layer->named_modules("", /*include_self=*/false)) {
      if (dynamic_cast<torch::nn::LinearImpl*>(item.value().get()) == nullptr) continue;
      const auto f8 = float8::AsFloat8Linear(*item.value());
      if (!f8 || f8->config().input.scaling_granularity != float8::ScalingGranularity::kTensorwise ||
          f8->config().grad_output.scaling_granularity != float8::ScalingGranularity::kTensorwise) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

std::vector<fsdp2::FSDPModule> ParallelizeLlama(models::llama::LlamaForCausalLM& model, const JobConfig& config,
                                                const ParallelMeshes& meshes, c10::Device device) {
  // torchtitan converts the model (its config) before parallelizing it.
  ConvertFloat8(model, config);
  if (meshes.cp) {
    const ParallelismConfig& p = config.parallelism;
    models::llama::ApplyContextParallel(
        *model, meshes.cp->group(0),
        {.rotate_method = p.context_parallel_rotate_method == "alltoall" ? context_parallel::RotateMethod::kAllToAll
                                                                         : context_parallel::RotateMethod::kAllGather,
         .load_balanced = p.context_parallel_load_balancer.has_value()});
  }
  if (meshes.tp) {
    // Built on the meta device and initialized after sharding: no values to broadcast.
    models::llama::TensorParallelOptions tp{.sequence_parallel = config.parallelism.enable_sequence_parallel,
                                            .src_data_rank = {}};
    if (BlockLinearsAreTensorwiseFloat8(model)) {
      // torchtitan's apply_tp with enable_float8_tensorwise_tp (before 0.3.0, which keeps the
      // generic styles): the same values, the sequence-parallel all-gathers in float8.
      tp.colwise = float8::Float8ColwiseParallel;
      tp.rowwise = float8::Float8RowwiseParallel;
      tp.prepare_module_input = [](tensor_parallel::PrepareModuleInputOptions o) {
        return float8::PrepareFloat8ModuleInput(
            {.input_layouts = o.input_layouts, .desired_input_layouts = o.desired_input_layouts});
      };
    }
    models::llama::ApplyTensorParallel(*model, meshes.tp, tp);
  }
  // torchtitan's apply_ac: FullAC or SelectiveAC on every decoder layer.
  const ActivationCheckpointConfig& ac = config.activation_checkpoint;
  if (ac.mode != ActivationCheckpointMode::kNone) {
    auto& layers = model->model->decoder_layers;
    for (size_t i = 0; i < layers.size(); ++i) {
      activation_checkpointing::CheckpointOptions options = layers[i]->checkpoint_options();
      options.preserve_rng_state = ac.preserve_rng_state;
      if (ac.mode == ActivationCheckpointMode::kSelective) {
        options.selective_policy = TorchtitanSelectivePolicy(*layers[i], "model.layers." + std::to_string(i),
                                                             ac.force_recompute_mm_shapes_by_fqns);
      }
      layers[i]->set_checkpoint_options(std::move(options));
      layers[i]->set_checkpointing_enabled(true);
    }
  }
  const ParallelismConfig& p = config.parallelism;
  // torchtitan's get_fsdp_reshard_after_forward_policy: "default" reshards the blocks unless
  // pipelining (a stage's blocks stay gathered across its microbatches), "always" does,
  // "never" does not; the final norm and head only under "always".
  const bool pipelined = meshes.pp != nullptr;
  const bool reshard_blocks = p.fsdp_reshard_after_forward == ReshardAfterForward::kAlways ||
                              (p.fsdp_reshard_after_forward == ReshardAfterForward::kDefault && !pipelined);
  const bool reshard_root = p.fsdp_reshard_after_forward == ReshardAfterForward::kAlways;
  fsdp2::FullyShardOptions options;
  options.mesh = meshes.fsdp;
  options.device = device;
  options.mp_policy = {.param_dtype = ScalarTypeOf(config.training.mixed_precision_param),
                       .reduce_dtype = ScalarTypeOf(config.training.mixed_precision_reduce),
                       .cast_forward_inputs = false};
  options.detect_nonfinite_grads = !pipelined;
  std::vector<fsdp2::FSDPModule> units;
  const auto shard = [&](const std::shared_ptr<torch::nn::Module>& module, bool reshard) {
    fsdp2::FullyShardOptions o = options;
    o.reshard_after_forward = reshard;
    units.push_back(fsdp2::fully_shard(module, o));
  };
  if (model->model->embed_tokens) shard(model->model->embed_tokens.ptr(), reshard_blocks);
  for (auto& layer : model->model->decoder_layers) shard(layer.ptr(), reshard_blocks);
  // The final norm and the head: one group of their own, as torchtitan's apply_fsdp. In the
  // root's group their gradients would be reduced, and their unsharded weights and gradients
  // freed, only at the end of backward (the root's inputs, token ids, take no gradient).
  if (model->model->norm && model->lm_head) {
    fsdp2::FullyShardOptions o = options;
    o.reshard_after_forward = reshard_root;
    units.push_back(fsdp2::fully_shard({model->model->norm.ptr(), model->lm_head.ptr()}, o).front());
  }
  shard(model.ptr(), reshard_root);
  // torchtitan's disable_fsdp_gradient_division: the loss is a sum over this rank's tokens
  // divided by the global token count, so the gradients are summed, not averaged.
  for (auto& unit : units) {
    unit.set_gradient_divide_factor(1.0);
    unit.set_force_sum_reduction_for_comms(true);
  }
  return units;
}

void InitTorchtitanWeights(models::llama::LlamaForCausalLM& model, uint64_t seed) {
  std::unordered_map<const torch::nn::Module*, std::string> prefixes;
  for (const auto& item : model->named_modules()) prefixes[item.value().get()] = item.key();
  const models::llama::LlamaConfig& config = model->config;
  fsdp2::InitMetaParameters(*model, [&](torch::nn::Module& module) {
    const std::string& prefix = prefixes.at(&module);
    for (const auto& item : module.named_parameters(/*recurse=*/false)) {
      at::Tensor full = item.value();
      // The draws are a CPU generator's (the same values on every device): on a GPU they are
      // made on the host and copied.
      at::Tensor host = full.is_cpu() ? full : at::empty(full.sizes(), full.options().device(at::kCPU));
      models::llama::InitTorchtitanParameter(config, prefix.empty() ? item.key() : prefix + "." + item.key(), host,
                                             seed);
      if (!full.is_cpu()) {
        at::NoGradGuard no_grad;
        full.copy_(host);
      }
    }
  });
}

}  // namespace fsdp::train
