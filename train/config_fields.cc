// See config_fields.h. Keys, order and defaults follow torchtitan 0.3.0's config classes
// (torchtitan/config/configs.py, components/*.py): the tables below list them in the order of
// those classes' fields.
#include "train/config_fields.h"

#include <optional>
#include <utility>

namespace fsdp::train::config_internal {
namespace {

Field Bind(std::string_view key, int64_t& m) {
  return {key, Kind::kInt, false, {}, [&m] { return Value(m); }, [&m](const Value& v) { m = std::get<int64_t>(v); }};
}
Field Bind(std::string_view key, double& m) {
  return {key, Kind::kFloat, false, {}, [&m] { return Value(m); }, [&m](const Value& v) { m = std::get<double>(v); }};
}
Field Bind(std::string_view key, bool& m) {
  return {key, Kind::kBool, false, {}, [&m] { return Value(m); }, [&m](const Value& v) { m = std::get<bool>(v); }};
}
Field Bind(std::string_view key, std::string& m) {
  return {
      key, Kind::kString, false, {}, [&m] { return Value(m); }, [&m](const Value& v) { m = std::get<std::string>(v); }};
}
Field Bind(std::string_view key, std::array<double, 2>& m) {
  return {key,
          Kind::kFloatPair,
          false,
          {},
          [&m] { return Value(std::vector<double>(m.begin(), m.end())); },
          [&m](const Value& v) {
            const auto& pair = std::get<std::vector<double>>(v);
            m = {pair[0], pair[1]};
          }};
}
Field Bind(std::string_view key, std::vector<std::string>& m) {
  return {key, Kind::kStringList,         false,
          {},  [&m] { return Value(m); }, [&m](const Value& v) { m = std::get<std::vector<std::string>>(v); }};
}

template <class T>
Field BindOptional(std::string_view key, std::optional<T>& m, Kind kind) {
  return {key,
          kind,
          true,
          {},
          [&m] { return m ? Value(*m) : Value(); },
          [&m](const Value& v) {
            if (std::holds_alternative<std::monostate>(v)) {
              m.reset();
            } else {
              m = std::get<T>(v);
            }
          }};
}
Field Bind(std::string_view key, std::optional<int64_t>& m) { return BindOptional(key, m, Kind::kInt); }
Field Bind(std::string_view key, std::optional<double>& m) { return BindOptional(key, m, Kind::kFloat); }
Field Bind(std::string_view key, std::optional<bool>& m) { return BindOptional(key, m, Kind::kBool); }
Field Bind(std::string_view key, std::optional<std::string>& m) { return BindOptional(key, m, Kind::kString); }

// An enum as one of its names (torchtitan's Literal[...] fields).
template <class E>
Field BindChoice(std::string_view key, E& m, std::vector<std::pair<std::string_view, E>> table) {
  Field field{key, Kind::kChoice, false, {}, nullptr, nullptr};
  for (const auto& entry : table) field.choices.push_back(entry.first);
  field.get = [&m, table] {
    for (const auto& [name, value] : table) {
      if (value == m) return Value(std::string(name));
    }
    return Value(std::string("?"));  // unreachable: every enumerator is in its table
  };
  field.set = [&m, table](const Value& v) {
    for (const auto& [name, value] : table) {
      if (name == std::get<std::string>(v)) m = value;
    }
  };
  return field;
}

std::vector<std::pair<std::string_view, DType>> ParamDTypes() {
  return {{"float32", DType::kFloat32}, {"bfloat16", DType::kBFloat16}};
}

}  // namespace

std::vector<Section> Sections(JobConfig& c) {
  std::vector<Section> sections;
  sections.push_back({"", {Bind("hf_assets_path", c.hf_assets_path), Bind("dump_folder", c.dump_folder)}});
  ModelConfig& model = c.model;
  sections.push_back({"model",
                      {Bind("name", model.name), Bind("flavor", model.flavor), Bind("dim", model.dim),
                       Bind("n_layers", model.n_layers), Bind("n_heads", model.n_heads),
                       Bind("n_kv_heads", model.n_kv_heads), Bind("vocab_size", model.vocab_size),
                       Bind("multiple_of", model.multiple_of), Bind("ffn_dim_multiplier", model.ffn_dim_multiplier),
                       Bind("norm_eps", model.norm_eps), Bind("rope_theta", model.rope_theta),
                       Bind("enable_weight_tying", model.enable_weight_tying), Bind("converters", model.converters)}});
  OptimizerConfig& opt = c.optimizer;
  sections.push_back({"optimizer",
                      {BindChoice("name", opt.name, {{"AdamW", OptimizerName::kAdamW}}), Bind("lr", opt.lr),
                       Bind("betas", opt.betas), Bind("eps", opt.eps), Bind("weight_decay", opt.weight_decay)}});
  LRSchedulerConfig& lr = c.lr_scheduler;
  sections.push_back(
      {"lr_scheduler",
       {Bind("warmup_steps", lr.warmup_steps), Bind("total_steps", lr.total_steps), Bind("decay_ratio", lr.decay_ratio),
        BindChoice("decay_type", lr.decay_type,
                   {{"linear", LRDecayType::kLinear}, {"sqrt", LRDecayType::kSqrt}, {"cosine", LRDecayType::kCosine}}),
        Bind("min_lr_factor", lr.min_lr_factor)}});
  TrainingConfig& t = c.training;
  sections.push_back(
      {"training",
       {Bind("local_batch_size", t.local_batch_size), Bind("global_batch_size", t.global_batch_size),
        Bind("seq_len", t.seq_len), Bind("max_norm", t.max_norm), Bind("steps", t.steps),
        BindChoice("dtype", t.dtype, ParamDTypes()),
        BindChoice("mixed_precision_param", t.mixed_precision_param, ParamDTypes()),
        BindChoice("mixed_precision_reduce", t.mixed_precision_reduce, {{"float32", DType::kFloat32}})}});
  ParallelismConfig& p = c.parallelism;
  sections.push_back({"parallelism",
                      {Bind("data_parallel_replicate_degree", p.data_parallel_replicate_degree),
                       Bind("data_parallel_shard_degree", p.data_parallel_shard_degree),
                       BindChoice("fsdp_reshard_after_forward", p.fsdp_reshard_after_forward,
                                  {{"default", ReshardAfterForward::kDefault},
                                   {"always", ReshardAfterForward::kAlways},
                                   {"never", ReshardAfterForward::kNever}}),
                       Bind("tensor_parallel_degree", p.tensor_parallel_degree),
                       Bind("enable_sequence_parallel", p.enable_sequence_parallel),
                       Bind("pipeline_parallel_degree", p.pipeline_parallel_degree),
                       Bind("pipeline_parallel_schedule", p.pipeline_parallel_schedule),
                       Bind("pipeline_parallel_schedule_csv", p.pipeline_parallel_schedule_csv),
                       Bind("pipeline_parallel_microbatch_size", p.pipeline_parallel_microbatch_size),
                       Bind("pipeline_parallel_layers_per_stage", p.pipeline_parallel_layers_per_stage),
                       Bind("pipeline_parallel_first_stage_less_layers", p.pipeline_parallel_first_stage_less_layers),
                       Bind("pipeline_parallel_last_stage_less_layers", p.pipeline_parallel_last_stage_less_layers),
                       Bind("context_parallel_degree", p.context_parallel_degree),
                       Bind("context_parallel_load_balancer", p.context_parallel_load_balancer),
                       Bind("context_parallel_rotate_method", p.context_parallel_rotate_method)}});
  ActivationCheckpointConfig& ac = c.activation_checkpoint;
  sections.push_back({"activation_checkpoint",
                      {BindChoice("mode", ac.mode,
                                  {{"none", ActivationCheckpointMode::kNone},
                                   {"full", ActivationCheckpointMode::kFull},
                                   {"selective", ActivationCheckpointMode::kSelective}}),
                       Bind("preserve_rng_state", ac.preserve_rng_state),
                       Bind("force_recompute_mm_shapes_by_fqns", ac.force_recompute_mm_shapes_by_fqns)}});
  Float8Config& f8 = c.float8;
  sections.push_back({"float8",
                      {BindChoice("recipe_name", f8.recipe_name,
                                  {{"tensorwise", Float8Recipe::kTensorwise},
                                   {"rowwise", Float8Recipe::kRowwise},
                                   {"rowwise_with_gw_hp", Float8Recipe::kRowwiseWithGwHp}}),
                       Bind("filter_fqns", f8.filter_fqns), Bind("emulate", f8.emulate),
                       Bind("enable_fsdp_float8_all_gather", f8.enable_fsdp_float8_all_gather),
                       Bind("precompute_float8_dynamic_scale_for_fsdp", f8.precompute_float8_dynamic_scale_for_fsdp)}});
  DataloaderConfig& d = c.dataloader;
  sections.push_back(
      {"dataloader", {Bind("dataset_path", d.dataset_path), Bind("infinite", d.infinite), Bind("seed", d.seed)}});
  ValidatorConfig& v = c.validator;
  sections.push_back(
      {"validator",
       {Bind("enable", v.enable), Bind("freq", v.freq), Bind("steps", v.steps), Bind("dataset_path", v.dataset_path)}});
  MetricsConfig& m = c.metrics;
  sections.push_back({"metrics",
                      {Bind("log_freq", m.log_freq), Bind("enable_tensorboard", m.enable_tensorboard),
                       Bind("save_tb_folder", m.save_tb_folder), Bind("save_for_all_ranks", m.save_for_all_ranks),
                       Bind("enable_jsonl", m.enable_jsonl), Bind("save_jsonl_file", m.save_jsonl_file)}});
  CheckpointConfig& ck = c.checkpoint;
  sections.push_back(
      {"checkpoint",
       {Bind("enable", ck.enable), Bind("folder", ck.folder), Bind("interval", ck.interval),
        Bind("initial_load_path", ck.initial_load_path), Bind("initial_load_model_only", ck.initial_load_model_only),
        Bind("initial_load_in_hf", ck.initial_load_in_hf), Bind("last_save_model_only", ck.last_save_model_only),
        Bind("last_save_in_hf", ck.last_save_in_hf),
        BindChoice("export_dtype", ck.export_dtype,
                   {{"float16", ExportDType::kFloat16},
                    {"bfloat16", ExportDType::kBFloat16},
                    {"float32", ExportDType::kFloat32}}),
        Bind("keep_latest_k", ck.keep_latest_k), Bind("load_step", ck.load_step),
        Bind("exclude_from_loading", ck.exclude_from_loading),
        Bind("enable_first_step_checkpoint", ck.enable_first_step_checkpoint),
        Bind("continue_on_save_failure", ck.continue_on_save_failure),
        BindChoice("async_mode", ck.async_mode,
                   {{"disabled", AsyncMode::kDisabled},
                    {"async", AsyncMode::kAsync},
                    {"async_with_pinned_mem", AsyncMode::kAsyncWithPinnedMem}})}});
  CommConfig& cm = c.comm;
  sections.push_back(
      {"comm",
       {Bind("init_timeout_seconds", cm.init_timeout_seconds), Bind("train_timeout_seconds", cm.train_timeout_seconds),
        Bind("trace_buf_size", cm.trace_buf_size)}});
  DebugConfig& dbg = c.debug;
  sections.push_back({"debug", {Bind("seed", dbg.seed), Bind("deterministic", dbg.deterministic)}});
  return sections;
}

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kInt: return "an integer";
    case Kind::kFloat: return "a number";
    case Kind::kBool: return "a boolean";
    case Kind::kString: return "a string";
    case Kind::kChoice: return "a string";
    case Kind::kFloatPair: return "an array of two numbers";
    case Kind::kStringList: return "an array of strings";
  }
  return "?";
}

std::string DottedKey(const Section& section, const Field& field) {
  if (section.name.empty()) return std::string(field.key);
  return std::string(section.name) + "." + std::string(field.key);
}

}  // namespace fsdp::train::config_internal
