// ValidateConfig (config.h): the checks that need neither the model nor a process group, so
// every rank fails the same way before it allocates anything. Each message names the dotted
// key and its value.
#include <c10/util/Exception.h>

#include <cmath>
#include <filesystem>

#include "pipelining/schedule_orders.h"
#include "train/config.h"
#include "train/lr_scheduler.h"

namespace fsdp::train {
namespace {

void CheckAtLeast(const char* key, int64_t value, int64_t low) {
  TORCH_CHECK(value >= low, key, " = ", value, " must be at least ", low);
}

void CheckMinusOneOrPositive(const char* key, int64_t value) {
  TORCH_CHECK(value == -1 || value >= 1, key, " = ", value, " must be -1 or at least 1");
}

void CheckFinite(const char* key, double value, double low, bool low_inclusive) {
  TORCH_CHECK(std::isfinite(value) && (low_inclusive ? value >= low : value > low), key, " = ", value,
              " must be finite and ", low_inclusive ? "at least " : "greater than ", low);
}

}  // namespace

ResolvedDegrees ValidateConfig(const JobConfig& config, int64_t world_size) {
  TORCH_CHECK(world_size >= 1, "ValidateConfig: world_size = ", world_size, " must be at least 1");
  const TrainingConfig& t = config.training;
  CheckAtLeast("training.local_batch_size", t.local_batch_size, 1);
  CheckMinusOneOrPositive("training.global_batch_size", t.global_batch_size);
  CheckAtLeast("training.seq_len", t.seq_len, 1);
  CheckAtLeast("training.steps", t.steps, 1);
  CheckFinite("training.max_norm", t.max_norm, 0.0, /*low_inclusive=*/false);

  // torch.optim.AdamW's own checks (torch/optim/adamw.py).
  const OptimizerConfig& o = config.optimizer;
  CheckFinite("optimizer.lr", o.lr, 0.0, true);
  CheckFinite("optimizer.eps", o.eps, 0.0, true);
  CheckFinite("optimizer.weight_decay", o.weight_decay, 0.0, true);
  for (const double beta : o.betas) {
    TORCH_CHECK(beta >= 0.0 && beta < 1.0, "optimizer.betas = [", o.betas[0], ", ", o.betas[1],
                "]: each must be in [0, 1)");
  }
  WarmupStableDecay(config.lr_scheduler, t.steps);  // names the lr_scheduler key it rejects

  // torchtitan's model converters; [float8] as torchao allows it.
  for (const std::string& converter : config.model.converters) {
    TORCH_CHECK(converter == "float8", "model.converters: unknown converter \"", converter, "\" (known: \"float8\")");
  }
  const Float8Config& f8 = config.float8;
  TORCH_CHECK(!f8.enable_fsdp_float8_all_gather || f8.recipe_name == Float8Recipe::kTensorwise,
              "float8.enable_fsdp_float8_all_gather = true needs float8.recipe_name = \"tensorwise\" (torchao "
              "all-gathers float8 weights with tensorwise scales only), got \"",
              f8.recipe_name == Float8Recipe::kRowwise ? "rowwise" : "rowwise_with_gw_hp", "\"");
  TORCH_CHECK(!f8.precompute_float8_dynamic_scale_for_fsdp || f8.enable_fsdp_float8_all_gather,
              "float8.precompute_float8_dynamic_scale_for_fsdp = true needs float8.enable_fsdp_float8_all_gather = "
              "true (the scales it precomputes are the float8 all-gather's)");

  const ParallelismConfig& p = config.parallelism;
  CheckAtLeast("parallelism.data_parallel_replicate_degree", p.data_parallel_replicate_degree, 1);
  CheckMinusOneOrPositive("parallelism.data_parallel_shard_degree", p.data_parallel_shard_degree);
  CheckAtLeast("parallelism.tensor_parallel_degree", p.tensor_parallel_degree, 1);
  CheckAtLeast("parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree, 1);
  CheckAtLeast("parallelism.pipeline_parallel_microbatch_size", p.pipeline_parallel_microbatch_size, 1);
  CheckAtLeast("parallelism.pipeline_parallel_first_stage_less_layers", p.pipeline_parallel_first_stage_less_layers, 0);
  CheckAtLeast("parallelism.pipeline_parallel_last_stage_less_layers", p.pipeline_parallel_last_stage_less_layers, 0);
  if (p.pipeline_parallel_layers_per_stage) {
    CheckAtLeast("parallelism.pipeline_parallel_layers_per_stage", *p.pipeline_parallel_layers_per_stage, 1);
  }
  CheckAtLeast("parallelism.context_parallel_degree", p.context_parallel_degree, 1);
  ResolvedDegrees degrees{p.data_parallel_replicate_degree,
                          p.data_parallel_shard_degree,
                          p.tensor_parallel_degree,
                          p.context_parallel_degree,
                          0,
                          0,
                          p.pipeline_parallel_degree};
  const int64_t others = degrees.dp_replicate * degrees.cp * degrees.tp * degrees.pp;
  if (degrees.dp_shard == -1) {
    TORCH_CHECK(world_size % others == 0, "parallelism.data_parallel_shard_degree = -1: the world size ", world_size,
                " is not a multiple of data_parallel_replicate_degree * context_parallel_degree * "
                "tensor_parallel_degree * pipeline_parallel_degree = ",
                others);
    degrees.dp_shard = world_size / others;
  }
  const int64_t product = degrees.pp * degrees.dp_replicate * degrees.dp_shard * degrees.cp * degrees.tp;
  TORCH_CHECK(product == world_size, "parallelism: pipeline_parallel_degree (", degrees.pp,
              ") * data_parallel_replicate_degree (", degrees.dp_replicate, ") * data_parallel_shard_degree (",
              degrees.dp_shard, ") * context_parallel_degree (", degrees.cp, ") * tensor_parallel_degree (", degrees.tp,
              ") = ", product, ", not the world size ", world_size);
  const auto& balancer = p.context_parallel_load_balancer;
  TORCH_CHECK(!balancer || *balancer == "headtail", "parallelism.context_parallel_load_balancer = \"",
              balancer.value_or(""),
              "\": \"headtail\" or None (\"ptrr\" balances FlexAttention, which the model "
              "does not use)");
  TORCH_CHECK(p.context_parallel_rotate_method == "allgather" || p.context_parallel_rotate_method == "alltoall",
              "parallelism.context_parallel_rotate_method = \"", p.context_parallel_rotate_method,
              "\" is not one of allgather, alltoall");
  if (degrees.cp > 1) {
    const int64_t pieces = balancer ? 2 * degrees.cp : degrees.cp;
    TORCH_CHECK(t.seq_len % pieces == 0, "training.seq_len = ", t.seq_len, " is not divisible by ", pieces,
                balancer ? " (2 x parallelism.context_parallel_degree: head-tail chunks)"
                         : " (parallelism.context_parallel_degree)");
  }
  if (degrees.pp > 1) {
    // A schedule name PyTorch knows (its message names it), a CSV file that exists, and
    // microbatches that divide the local batch: each an error before anything runs.
    try {
      pipelining::ScheduleKindFromName(p.pipeline_parallel_schedule);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "parallelism.pipeline_parallel_schedule = \"", p.pipeline_parallel_schedule,
                  "\": ", e.what_without_backtrace());
    }
    if (!p.pipeline_parallel_schedule_csv.empty()) {
      TORCH_CHECK(std::filesystem::is_regular_file(p.pipeline_parallel_schedule_csv),
                  "parallelism.pipeline_parallel_schedule_csv = \"", p.pipeline_parallel_schedule_csv,
                  "\" does not exist or is not a file");
    }
    TORCH_CHECK(
        t.local_batch_size % p.pipeline_parallel_microbatch_size == 0,
        "training.local_batch_size = ", t.local_batch_size,
        " is not divisible by parallelism.pipeline_parallel_microbatch_size = ", p.pipeline_parallel_microbatch_size);
  }

  // torchtitan's Trainer.__init__: global batch = local batch * dp degree * accumulation steps.
  const int64_t per_micro_step = t.local_batch_size * degrees.dp();
  degrees.global_batch_size = t.global_batch_size == -1 ? per_micro_step : t.global_batch_size;
  TORCH_CHECK(degrees.global_batch_size % per_micro_step == 0, "training.global_batch_size = ", t.global_batch_size,
              " is not a multiple of local_batch_size * data-parallel degree = ", t.local_batch_size, " * ",
              degrees.dp(), " = ", per_micro_step);
  degrees.gradient_accumulation_steps = degrees.global_batch_size / per_micro_step;

  const ValidatorConfig& v = config.validator;
  CheckAtLeast("validator.freq", v.freq, 1);
  CheckMinusOneOrPositive("validator.steps", v.steps);
  CheckAtLeast("metrics.log_freq", config.metrics.log_freq, 1);
  const CheckpointConfig& ck = config.checkpoint;
  CheckAtLeast("checkpoint.interval", ck.interval, 1);
  CheckAtLeast("checkpoint.keep_latest_k", ck.keep_latest_k, 0);
  // torchtitan/components/checkpointer/base.py (Config.__post_init__): the newest checkpoint may
  // still be being written, so one kept is not enough.
  TORCH_CHECK(ck.keep_latest_k != 1,
              "checkpoint.keep_latest_k = 1 must be 0 (keep every checkpoint) or at least 2 "
              "(the newest may still be being written)");
  // Step 0 is torchtitan's model-only initial checkpoint (components/checkpointer/dcp.py:
  // model_only = step == 0), so it is a valid load_step.
  CheckMinusOneOrPositive("checkpoint.load_step", ck.load_step == 0 ? 1 : ck.load_step);
  CheckAtLeast("comm.init_timeout_seconds", config.comm.init_timeout_seconds, 1);
  CheckAtLeast("comm.train_timeout_seconds", config.comm.train_timeout_seconds, 1);
  CheckAtLeast("comm.trace_buf_size", config.comm.trace_buf_size, 0);
  if (config.debug.seed) CheckAtLeast("debug.seed", *config.debug.seed, 0);
  return degrees;
}

}  // namespace fsdp::train
