// The training job: torchtitan's Trainer (torchtitan/trainer.py) over this repository's
// parts. One Trainer per rank, built from a validated JobConfig on the world group:
//
//   Trainer trainer(config, world);   // collective: meshes, sharding, data
//   trainer.Train();                  // training.steps steps, logs, validation
//
// A step (Step()) is torchtitan's train_step: zero the gradients; take this rank's
// gradient_accumulation_steps micro-batches from the data loader; count their valid tokens
// and sum the count over the data-parallel ranks; for each micro-batch, forward, the summed
// cross-entropy divided by that global count, backward (FSDP sums the gradients); clip the
// gradients' total norm to training.max_norm; AdamW step; the learning-rate schedule's step.
// The step's loss is the global mean over tokens (the micro-batches' losses summed over the
// data-parallel ranks), its max loss the largest rank's own mean, as torchtitan logs them; the
// learning rate is the one the step used.
//
// Contract: the constructor and Step / Validate / Train are collective over `world` (every
// rank calls them alike). Errors: a config the model cannot take (ResolveModelConfig), a
// missing or corrupt dataset (TokenDataset), a non-finite loss (c10::Error naming the step and
// the loss) or gradient (FSDP's sentinel, naming the first parameter). Not thread-safe.
#ifndef FSDP_TRAIN_TRAINER_H_
#define FSDP_TRAIN_TRAINER_H_

#include <c10/core/Device.h>
#include <torch/optim/adamw.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "comm/process_group.h"
#include "dcp/checkpoint_manager.h"
#include "models/llama/model.h"
#include "train/checkpoint_state.h"
#include "train/config.h"
#include "train/dataloader.h"
#include "train/lr_scheduler.h"
#include "train/parallelize.h"

namespace fsdp::train {

class MetricsLog;

// torchtitan's FLOPs per token of a Llama model at `seq_len`, forward + backward
// (get_dense_model_nparams_and_flops, torchtitan/models/utils.py): 6 per parameter but the
// embedding's (all of them when tied) plus 6 * layers * heads * (qk + v head dims) * seq_len,
// through metrics::DecoderFlopsPerToken.
double TorchtitanFlopsPerToken(const models::llama::LlamaConfig& config, int64_t seq_len);

struct StepResult {
  int64_t step = 0;              // 1-based, as torchtitan's
  double loss = 0;               // global mean over the step's valid tokens
  double max_loss = 0;           // the largest data-parallel rank's own mean
  double grad_norm = 0;          // total, before clipping
  double lr = 0;                 // the learning rate the step used
  int64_t global_tokens = 0;     // valid tokens of the step, all ranks
  int64_t local_tokens = 0;      // this rank's tokens (label positions) of the step
  double data_seconds = 0;       // this rank's time in the data loader
  double model_seconds = 0;      // forward, loss and backward of every micro-batch
  double optimizer_seconds = 0;  // clip_grad_norm_, the optimizer and the schedule
  double seconds = 0;            // this rank's whole step
  // The step's time outside the model and the optimizer: data loading, the token count and
  // loss reductions, the trainer's own work.
  double non_model_seconds() const { return seconds - model_seconds - optimizer_seconds; }
};

class Trainer {
 public:
  // `device`: where this rank trains, the CPU (over a Gloo world) or a CUDA device (over
  // NCCL; torchtitan's cuda:LOCAL_RANK): the model, its gradients and optimizer state, each
  // batch and the loss and token-count reductions live there, and with a pipeline each
  // stage's receive buffers and messages (PipelineStageOptions::device).
  Trainer(const JobConfig& config, comm::ProcessGroupPtr world, c10::Device device = c10::Device(c10::kCPU));
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // `global_metrics` false (torchtitan's steps that do not log): the loss and max loss are
  // this rank's own (no reduction over the data-parallel ranks) and the non-finite loss check
  // is left to the next logged step; the gradients' sentinel checks every step.
  StepResult Step(bool global_metrics = true);
  // The validation loss over validator.steps batches (-1: the whole validation set once):
  // summed cross-entropy over summed valid tokens, all data-parallel ranks.
  struct ValidationResult {
    double loss = 0;
    int64_t local_tokens = 0;  // this rank's
  };
  ValidationResult Validate();
  // Steps until training.steps (with dataloader.infinite = false, or until one pass over the
  // data cannot fill another global batch); rank 0 writes torchtitan's log line every
  // metrics.log_freq steps to `log` and, if enabled, the metrics files; validation every
  // validator.freq steps.
  // Then, with checkpoint.enable and checkpoint.last_save_in_hf, torchtitan's last save in
  // Hugging Face's layout: dcp::SaveHuggingFace to ExportDirectory() in export_dtype, with
  // hf_assets_path's other files (its config.json) copied beside the weights.
  //
  // With checkpoint.enable, first the newest complete checkpoint under
  // dump_folder/checkpoint.folder is loaded (LoadCheckpoint), and after each step one is saved
  // when due (dcp/checkpoint_manager.h: interval, keep_latest_k, async_mode; the last one
  // model-only unless last_save_model_only is false, or the Hugging Face export instead with
  // last_save_in_hf).
  void Train(std::ostream& log);
  // With checkpoint.enable: loads dump_folder/checkpoint.folder/step-<load_step> (-1: the newest
  // complete one) into the model, optimizer and the objects of train/checkpoint_state.h and
  // returns its step (training continues after it). Else (none there, or checkpointing off),
  // as torchtitan, checkpoint.initial_load_path when it is a DCP checkpoint
  // (initial_load_in_hf = false), ours or torchtitan's (train/torchtitan_checkpoint.h: a
  // torchtitan checkpoint's data position is its step's in this trainer's stream): the model
  // alone with initial_load_model_only, else everything exclude_from_loading leaves; then -1.
  // Collective.
  int64_t LoadCheckpoint();
  // With checkpoint.enable, after a Step(): saves the checkpoint of this step when it is due
  // (Train() calls it; the last step's save is left to Train() with last_save_in_hf).
  void SaveCheckpoint();
  // dump_folder/checkpoint.folder/step-<step>, torchtitan's checkpoint directory of a step.
  std::string ExportDirectory() const;

  // With pipeline parallelism the model is cut into stages (train/pipeline_llama.h): model()
  // is this rank's first stage's part, model_parts() all of this rank's, and a step runs each
  // micro-batch through the schedule (parallelism.pipeline_parallel_schedule), its
  // microbatches of pipeline_parallel_microbatch_size sequences each.
  int64_t step() const { return progress_.step; }
  std::vector<models::llama::LlamaForCausalLM> model_parts() const;
  const JobConfig& config() const { return config_; }
  const ResolvedDegrees& degrees() const { return degrees_; }
  const models::llama::LlamaConfig& model_config() const { return model_config_; }
  models::llama::LlamaForCausalLM& model() { return model_; }
  const torch::optim::AdamW& optimizer() const { return *optimizer_; }
  DataLoader& data_loader() { return *data_; }
  // torchtitan's FLOPs per token of this model at training.seq_len (forward + backward).
  double flops_per_token() const { return flops_per_token_; }

 private:
  at::Tensor Forward(const TokenBatch& batch);
  // This rank's tokens of a data-parallel batch, on its device: with context parallelism its
  // part of each row's sequence (input, labels and positions alike; head-tail with the load
  // balancer).
  TokenBatch LocalTokens(TokenBatch batch) const;
  // dump_folder/checkpoint.folder: the step-<N> checkpoints and the Hugging Face export.
  std::string CheckpointFolder() const;
  void LoadInitialCheckpoint();

  StepResult PipelinedStep(StepResult r, const std::vector<TokenBatch>& micro_batches, int64_t local_valid,
                           bool global_metrics, std::chrono::steady_clock::time_point start);
  StepResult FinishStep(StepResult r, const at::Tensor& loss_sum, int64_t local_valid, bool global_metrics,
                        std::chrono::steady_clock::time_point start, const std::function<double()>& clip);
  void BuildPipeline();
  at::Tensor ValidationLossSum(const TokenBatch& batch);
  // What checkpoints save and load: the model, or with pipeline parallelism this rank's parts.
  torch::nn::Module& CheckpointedModel();

  JobConfig config_;
  ResolvedDegrees degrees_;
  comm::ProcessGroupPtr world_;
  c10::Device device_;
  models::llama::LlamaConfig model_config_;
  ParallelMeshes meshes_;
  models::llama::LlamaForCausalLM model_{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::unique_ptr<LRSchedulers> lr_schedulers_;
  std::unique_ptr<DataLoader> data_;
  std::shared_ptr<const TokenDataset> validation_data_;
  double flops_per_token_ = 0;
  TrainProgress progress_;
  // The checkpointed objects (train/checkpoint_state.h) and their manager (checkpoint.enable).
  std::vector<std::pair<std::string, std::unique_ptr<dcp::Stateful>>> stateful_;
  std::unique_ptr<dcp::CheckpointManager> checkpointer_;
  std::string initial_load_;  // what LoadCheckpoint loaded from initial_load_path, for the log
  // Pipeline parallelism: this rank's parts, stages and the schedule (null without).
  struct Pipeline;
  std::unique_ptr<Pipeline> pipeline_;
};

}  // namespace fsdp::train

#endif  // FSDP_TRAIN_TRAINER_H_
