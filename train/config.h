// The training job's configuration: one struct per table of the TOML file, its keys and
// defaults torchtitan 0.3.0's `Trainer.Config` tree (torchtitan/trainer.py,
// torchtitan/config/configs.py and the component configs it names), so that a torchtitan user
// finds each setting under the name they know. torchtitan builds its config from Python
// functions (config_registry.py); here the same tree is a TOML file, overridden from the
// command line in torchtitan's dotted form (`--training.steps=20`, `--training.steps 20`).
//
// Where torchtitan's value is a class rather than a field (the optimizer's param groups, the
// activation-checkpointing config class, the model spec) the table flattens it to the fields
// a Llama-3 job sets: `[optimizer]` is default_adamw()'s one catch-all AdamW group,
// `[activation_checkpoint] mode` picks FullAC / SelectiveAC / none, `[model]` names a flavor
// of torchtitan's llama3 registry and may override its dimensions. docs/guide/train.md lists
// every key.
//
// Contract:
// - ParseConfig reads TOML text, then applies the overrides in order; then ValidateConfig.
//   Every error is one c10::Error naming where (file, line and column for TOML syntax; the
//   dotted key) and the bad value: an unknown table or key, a value of the wrong type or out
//   of its choices, an override without a value. Nothing is allocated but the config.
// - ValidateConfig checks what needs no model and no process group: positive sizes, the
//   degrees against the world size (data_parallel_shard_degree = -1 resolves to the rest), the
//   global batch against local batch * data-parallel degree. The model's divisibility by the
//   tensor-parallel degree is checked where the model's dimensions are known (ResolveModel).
// - PrintConfig writes TOML that ParseConfig reads back to the same config (an unset optional
//   is a comment). Thread-compatible plain data; no global state.
#ifndef FSDP_TRAIN_CONFIG_H_
#define FSDP_TRAIN_CONFIG_H_

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "train/lr_scheduler.h"

namespace fsdp::train {

// [model]: which Llama-3 (torchtitan's models/llama3 registry) and optional changes to its
// dimensions. The registry and the resolution live with the model; unset keeps the flavor's.
struct ModelConfig {
  std::string name = "llama3";
  std::string flavor = "debugmodel";  // debugmodel, 8B, 70B, 405B; "" = hf_assets_path's config.json
  std::optional<int64_t> dim, n_layers, n_heads, n_kv_heads, vocab_size, multiple_of;
  std::optional<double> ffn_dim_multiplier, norm_eps, rope_theta;
  std::optional<bool> enable_weight_tying;
  // torchtitan's model converters applied before parallelizing: "float8" (the [float8] table).
  std::vector<std::string> converters;
};

enum class OptimizerName { kAdamW };

// [optimizer]: torchtitan's default_adamw(): one AdamW over every parameter.
struct OptimizerConfig {
  OptimizerName name = OptimizerName::kAdamW;
  double lr = 8e-4;
  std::array<double, 2> betas = {0.9, 0.95};
  double eps = 1e-8;
  double weight_decay = 0.1;
};

enum class DType { kFloat32, kBFloat16 };

// [training]: torchtitan's TrainingConfig.
struct TrainingConfig {
  int64_t local_batch_size = 8;
  int64_t global_batch_size = -1;  // -1: local_batch_size * data-parallel degree (no accumulation)
  int64_t seq_len = 2048;
  double max_norm = 1.0;
  int64_t steps = 10000;
  DType dtype = DType::kFloat32;  // the parameters' dtype when FSDP's mixed precision is not in use
  DType mixed_precision_param = DType::kBFloat16;
  DType mixed_precision_reduce = DType::kFloat32;
};

enum class ReshardAfterForward { kDefault, kAlways, kNever };

// [parallelism]: torchtitan's ParallelismConfig (data and tensor parallelism).
struct ParallelismConfig {
  int64_t data_parallel_replicate_degree = 1;
  int64_t data_parallel_shard_degree = -1;  // -1: the world size divided by the other degrees
  ReshardAfterForward fsdp_reshard_after_forward = ReshardAfterForward::kDefault;
  int64_t tensor_parallel_degree = 1;
  bool enable_sequence_parallel = true;
  // Pipeline parallelism (torchtitan's keys and defaults; distributed/pipeline_parallel.py):
  // the degree, a schedule name (pipelining::ScheduleKindFromName) or a compute-only CSV file
  // (pipelining::ReadScheduleCsv) that replaces it, the microbatch size (local_batch_size /
  // it microbatches per step), and the layer split: layers_per_stage (unset: one stage per
  // rank for GPipe / 1F1B, two for the others), the first and last stages counting the
  // embedding and the norm + head as this many layers.
  int64_t pipeline_parallel_degree = 1;
  std::string pipeline_parallel_schedule = "1F1B";
  std::string pipeline_parallel_schedule_csv;
  int64_t pipeline_parallel_microbatch_size = 1;
  std::optional<int64_t> pipeline_parallel_layers_per_stage;
  int64_t pipeline_parallel_first_stage_less_layers = 1;
  int64_t pipeline_parallel_last_stage_less_layers = 1;
  // Context parallelism (torchtitan's keys): the degree, the load balancer ("headtail"; unset:
  // none, contiguous shards), and the ring's rotate method as PyTorch's set_rotate_method
  // ("allgather", "alltoall").
  int64_t context_parallel_degree = 1;
  std::optional<std::string> context_parallel_load_balancer = "headtail";
  std::string context_parallel_rotate_method = "allgather";
};

enum class ActivationCheckpointMode { kNone, kFull, kSelective };

// [activation_checkpoint]: which of torchtitan's configs (distributed/activation_checkpoint.py):
// none, FullAC (every block recomputed) or SelectiveAC (torchtitan's default).
struct ActivationCheckpointConfig {
  ActivationCheckpointMode mode = ActivationCheckpointMode::kSelective;
  bool preserve_rng_state = true;
  // SelectiveAC: the matmuls with the weight shape of a Linear whose name contains one of these
  // are always recomputed (train/selective_ac.h).
  std::vector<std::string> force_recompute_mm_shapes_by_fqns = {"moe.router.gate"};
};

enum class Float8Recipe { kTensorwise, kRowwise, kRowwiseWithGwHp };

// [float8]: torchtitan 0.3.0's Float8LinearConverter.Config (components/quantization/float8.py)
// and torchao's float8 all-gather options (float8/float8_linear.h, fsdp_float8.h); used when
// model.converters names "float8".
struct Float8Config {
  Float8Recipe recipe_name = Float8Recipe::kRowwise;
  // Linears whose FQN (ours or torchtitan 0.3.0's: "lm_head", "qkv_linear.wq") contains an entry stays
  // in high precision, as do those with in or out features not multiples of 16;
  // "auto_filter_small_kn" adds torchao's size thresholds.
  std::vector<std::string> filter_fqns;
  // float32 matmuls of the dequantized operands instead of _scaled_mm (for hardware without
  // float8) with torchao's default recipe, tensorwise, whatever recipe_name says: torchtitan
  // 0.3.0's Float8LinearConverter replaces the config with Float8LinearConfig(emulate=True).
  bool emulate = false;
  // tensorwise only: FSDP2 all-gathers the weights in float8.
  bool enable_fsdp_float8_all_gather = false;
  // with the float8 all-gather: every weight's scale from one all-reduce after the optimizer step.
  bool precompute_float8_dynamic_scale_for_fsdp = false;
};

// [dataloader]: a prepared token dataset (docs/guide/data_format.md), packed as torchtitan's
// HuggingFaceTextDataset packs text.
struct DataloaderConfig {
  std::string dataset_path;  // the prepared dataset
  bool infinite = true;      // re-loop (a new epoch) when the data ends
  int64_t seed = 42;         // the order of the documents in epochs after the first
};

// [validator]: torchtitan's Validator.Config, on its own prepared dataset.
struct ValidatorConfig {
  bool enable = false;
  int64_t freq = 10;
  int64_t steps = -1;  // -1: the whole validation dataset
  std::string dataset_path;
};

// [metrics]: torchtitan's MetricsProcessor.Config, with a JSONL file besides TensorBoard.
struct MetricsConfig {
  int64_t log_freq = 10;
  bool enable_tensorboard = false;
  std::string save_tb_folder = "tb";
  bool save_for_all_ranks = false;
  bool enable_jsonl = false;
  std::string save_jsonl_file = "metrics.jsonl";
};

enum class ExportDType { kFloat16, kBFloat16, kFloat32 };
enum class AsyncMode { kDisabled, kAsync, kAsyncWithPinnedMem };

// [checkpoint]: torchtitan's CheckpointManager.Config.
struct CheckpointConfig {
  bool enable = false;
  std::string folder = "checkpoint";
  int64_t interval = 500;
  std::string initial_load_path;
  bool initial_load_model_only = true;
  bool initial_load_in_hf = false;
  bool last_save_model_only = true;
  bool last_save_in_hf = false;
  ExportDType export_dtype = ExportDType::kFloat32;
  int64_t keep_latest_k = 10;
  int64_t load_step = -1;
  std::vector<std::string> exclude_from_loading;
  bool enable_first_step_checkpoint = false;
  AsyncMode async_mode = AsyncMode::kDisabled;
  // Ours (torchtitan stops): a failed save is logged and training goes on; an older complete
  // checkpoint stays loadable (dcp/checkpoint_manager.h).
  bool continue_on_save_failure = false;
};

// [comm]: torchtitan's CommConfig.
struct CommConfig {
  int64_t init_timeout_seconds = 300;
  int64_t train_timeout_seconds = 100;
  int64_t trace_buf_size = 20000;
};

// [debug]: torchtitan's DebugConfig.
struct DebugConfig {
  std::optional<int64_t> seed;
  bool deterministic = false;
};

// The whole job: torchtitan's Trainer.Config.
struct JobConfig {
  std::string hf_assets_path;  // a Hugging Face directory: config.json, tokenizer, weights
  std::string dump_folder = "./outputs";
  ModelConfig model;
  OptimizerConfig optimizer;
  LRSchedulerConfig lr_scheduler;
  TrainingConfig training;
  ParallelismConfig parallelism;
  ActivationCheckpointConfig activation_checkpoint;
  Float8Config float8;
  DataloaderConfig dataloader;
  ValidatorConfig validator;
  MetricsConfig metrics;
  CheckpointConfig checkpoint;
  CommConfig comm;
  DebugConfig debug;
};

// One `--section.key=value` or `--section.key value` from the command line, already split.
struct ConfigOverride {
  std::string key;  // dotted: "training.steps"; top-level keys have no dot
  std::string value;
  bool has_value = true;  // false: `--debug.deterministic` alone, which sets a boolean to true
};

// Splits the trainer's arguments into the config file (`--config FILE` / `--config=FILE`),
// `--print-config`, `--nproc N` and the dotted overrides; anything else is a c10::Error naming it.
struct CommandLine {
  std::string config_file;  // empty: the defaults
  bool print_config = false;
  int nproc = 0;  // > 0: run that many processes on this machine (torchrun --standalone's job)
  std::vector<ConfigOverride> overrides;
};
CommandLine ParseCommandLine(const std::vector<std::string>& args);

// `toml_text` parsed (errors name `source`, e.g. the file's path), then `overrides` applied.
// Does not validate: call ValidateConfig.
JobConfig ParseConfig(std::string_view toml_text, std::string_view source,
                      const std::vector<ConfigOverride>& overrides = {});
// Reads the file (an unreadable file is a c10::Error naming it), then ParseConfig.
JobConfig LoadConfig(const CommandLine& command_line);

// The degrees of a validated config: data_parallel_shard_degree resolved, gradient
// accumulation from the global batch.
struct ResolvedDegrees {
  int64_t dp_replicate, dp_shard, tp;
  int64_t cp = 1;  // parallelism.context_parallel_degree
  int64_t dp() const { return dp_replicate * dp_shard; }
  int64_t global_batch_size, gradient_accumulation_steps;
  int64_t pp = 1;  // parallelism.pipeline_parallel_degree
};
// The checks of the contract above for `world_size` processes.
ResolvedDegrees ValidateConfig(const JobConfig& config, int64_t world_size);

std::string PrintConfig(const JobConfig& config);

}  // namespace fsdp::train

#endif  // FSDP_TRAIN_CONFIG_H_
