// See trainer.h. Each block names the part of torchtitan/trainer.py it follows.
#include "train/trainer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "checkpoint/dcp_storage.h"
#include "context_parallel/load_balancer.h"
#include "dcp/checkpoint_dirs.h"
#include "dcp/hf.h"
#include "float8/fsdp_float8.h"
#include "fsdp/fsdp2/clip_grad_norm.h"
#include "metrics/step_metrics.h"
#include "models/llama/flavors.h"
#include "pipelining/pipeline_schedule.h"
#include "train/loss.h"
#include "train/metrics_log.h"
#include "train/pipeline_fsdp.h"
#include "train/pipeline_llama.h"
#include "train/torchtitan_checkpoint.h"

namespace fsdp::train {
namespace {

using Clock = std::chrono::steady_clock;
using StoredFqn = std::function<std::string(const std::string&)>;

// A name in Trainer::Pipeline::parts_module without its part's index ("1.layers.3.x" ->
// "layers.3.x"): the whole model's.
std::string WholeModelFqn(const std::string& fqn) { return fqn.substr(fqn.find('.') + 1); }

double Seconds(Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); }

// The sum over `group` (a no-op for one rank); `op` for every element.
at::Tensor AllReduce(const mesh::DeviceMeshPtr& batch, at::Tensor t, comm::ReduceOp op) {
  if (batch->size() > 1) batch->group(0)->all_reduce(t, op)->wait();
  return t;
}

c10::ScalarType ExportScalarType(ExportDType dtype) {
  switch (dtype) {
    case ExportDType::kFloat16: return at::kHalf;
    case ExportDType::kBFloat16: return at::kBFloat16;
    case ExportDType::kFloat32: break;
  }
  return at::kFloat;
}

}  // namespace

double TorchtitanFlopsPerToken(const models::llama::LlamaConfig& c, int64_t seq_len) {
  const int64_t params = models::llama::ParameterCount(c);
  const int64_t for_matmul = c.tie_word_embeddings ? params : params - models::llama::EmbeddingParameterCount(c);
  return metrics::DecoderFlopsPerToken(for_matmul, c.num_hidden_layers, c.num_attention_heads, c.head_dim(), seq_len);
}

Trainer::Trainer(const JobConfig& config, comm::ProcessGroupPtr world, c10::Device device)
    : config_(config), world_(std::move(world)), device_(device) {
  TORCH_CHECK(world_ != nullptr, "Trainer: the world process group is null");
  TORCH_CHECK(device_.is_cpu() || (device_.is_cuda() && device_.has_index()),
              "Trainer: device must be the CPU or a CUDA device with an index, got ", device_.str());
  // Everything a bad config or file can fail is checked before any collective or allocation.
  degrees_ = ValidateConfig(config_, world_->size());
  model_config_ = ResolveModelConfig(config_, degrees_.tp);
  TORCH_CHECK(!config_.dataloader.dataset_path.empty(),
              "dataloader.dataset_path is empty: a prepared dataset is required (docs/guide/data_format.md)");
  std::shared_ptr<const TokenDataset> dataset = TokenDataset::Open(config_.dataloader.dataset_path);
  TORCH_CHECK(dataset->vocab_size() <= model_config_.vocab_size, "dataloader.dataset_path ",
              config_.dataloader.dataset_path, ": the tokenizer's vocab_size ", dataset->vocab_size(),
              " exceeds the model's ", model_config_.vocab_size, " (model.vocab_size)");
  if (config_.validator.enable) {
    TORCH_CHECK(!config_.validator.dataset_path.empty(), "validator.enable = true needs validator.dataset_path");
    validation_data_ = TokenDataset::Open(config_.validator.dataset_path);
    TORCH_CHECK(validation_data_->vocab_size() <= model_config_.vocab_size, "validator.dataset_path ",
                config_.validator.dataset_path, ": the tokenizer's vocab_size ", validation_data_->vocab_size(),
                " exceeds the model's ", model_config_.vocab_size);
  }
  const CheckpointConfig& ck = config_.checkpoint;

  meshes_ = BuildMeshes(world_, degrees_);

  // torchtitan's order: build on the meta device, parallelize, then init_weights, each rank
  // drawing every full parameter from (seed, name) and keeping its shard: no rank holds the
  // whole model, and the values do not depend on the world size or mesh.
  flops_per_token_ = TorchtitanFlopsPerToken(model_config_, config_.training.seq_len);
  if (degrees_.pp > 1) {
    BuildPipeline();
  } else {
    model_ = models::llama::LlamaForCausalLM(model_config_, c10::Device(c10::kMeta));
    model_->to(ScalarTypeOf(config_.training.dtype));
    ParallelizeLlama(model_, config_, meshes_, device_);
    InitTorchtitanWeights(model_, static_cast<uint64_t>(config_.debug.seed.value_or(0)));
  }
  if (!ck.initial_load_path.empty() && ck.initial_load_in_hf) {
    // A pipeline rank's parts hold some of the checkpoint's tensors, under their index.
    dcp::LoadHuggingFace(
        CheckpointedModel(), ck.initial_load_path,
        {.key_of = degrees_.pp > 1 ? WholeModelFqn : StoredFqn(), .allow_unexpected_keys = degrees_.pp > 1});
  }
  // torchtitan's set_determinism: deterministic ATen algorithms (an error where one has none).
  if (config_.debug.deterministic) at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);

  const OptimizerConfig& o = config_.optimizer;
  std::vector<at::Tensor> params;
  for (const auto& part : model_parts()) {
    for (const at::Tensor& p : part->parameters()) params.push_back(p);
  }
  optimizer_ = std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(o.lr).betas({o.betas[0], o.betas[1]}).eps(o.eps).weight_decay(o.weight_decay));
  lr_schedulers_ = std::make_unique<LRSchedulers>(std::vector<torch::optim::Optimizer*>{optimizer_.get()},
                                                  WarmupStableDecay(config_.lr_scheduler, config_.training.steps));
  data_ = std::make_unique<DataLoader>(
      dataset, DataLoaderConfig{.seq_len = config_.training.seq_len,
                                .local_batch_size = config_.training.local_batch_size,
                                .dp_degree = meshes_.dp_size,
                                .dp_rank = meshes_.dp_rank,
                                .gradient_accumulation_steps = degrees_.gradient_accumulation_steps,
                                .seed = config_.dataloader.seed});
  // torchtitan's CheckpointManager states: model and optimizer, then these.
  stateful_.emplace_back("train_state", std::make_unique<TrainStateStateful>(progress_));
  stateful_.emplace_back("lr_scheduler", std::make_unique<LRSchedulersStateful>(*lr_schedulers_));
  stateful_.emplace_back("dataloader", std::make_unique<DataLoaderStateful>(*data_));
  stateful_.emplace_back("rng", std::make_unique<RngStateful>());
  if (ck.enable) {
    dcp::StatefulItems items;
    for (const auto& [name, object] : stateful_) items.emplace_back(name, object.get());
    checkpointer_ = std::make_unique<dcp::CheckpointManager>(
        CheckpointedModel(), optimizer_.get(), std::move(items),
        dcp::CheckpointManagerOptions{.folder = CheckpointFolder(),
                                      .interval = ck.interval,
                                      .keep_latest_k = ck.keep_latest_k,
                                      .load_step = ck.load_step,
                                      .exclude_from_loading = ck.exclude_from_loading,
                                      .async = ck.async_mode != AsyncMode::kDisabled,
                                      .pin_memory = ck.async_mode == AsyncMode::kAsyncWithPinnedMem,
                                      .async_staging = ck.async_mode == AsyncMode::kAsyncWithPinnedMem,
                                      .enable_first_step_checkpoint = ck.enable_first_step_checkpoint,
                                      .last_save_model_only = ck.last_save_model_only,
                                      .export_dtype = ExportScalarType(ck.export_dtype),
                                      // Pipeline stages hold different parameters (dcp.h).
                                      .flatten_optimizer_state_dict = degrees_.pp > 1,
                                      .stored_fqn = degrees_.pp > 1 ? WholeModelFqn : StoredFqn(),
                                      .continue_on_save_failure = ck.continue_on_save_failure},
        world_);
  }
}

int64_t Trainer::LoadCheckpoint() {
  if (checkpointer_ != nullptr) {
    if (const int64_t step = checkpointer_->Load(); step >= 0) return step;
  }
  const CheckpointConfig& ck = config_.checkpoint;
  if (!ck.initial_load_path.empty() && !ck.initial_load_in_hf) LoadInitialCheckpoint();
  return -1;
}

// torchtitan's CheckpointManager._load when the folder holds no checkpoint: initial_load_path,
// the model alone (initial_load_model_only) or every state exclude_from_loading leaves.
void Trainer::LoadInitialCheckpoint() {
  const CheckpointConfig& ck = config_.checkpoint;
  checkpoint::DcpMetadata metadata;
  try {
    metadata = checkpoint::ReadMetadata(ck.initial_load_path);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "checkpoint.initial_load_path = \"", ck.initial_load_path,
                "\" is not a DCP checkpoint (a Hugging Face directory needs checkpoint.initial_load_in_hf = true): ",
                e.what_without_backtrace());
  }
  const bool torchtitan = IsTorchtitanCheckpoint(metadata);
  dcp::LoadOptions options;
  if (torchtitan) options.layout = TorchtitanLayout(model_config_, metadata);
  if (pipeline_ != nullptr) {  // the parts' FQNs are the whole model's after their index
    const auto whole = [](const std::function<dcp::StoredTensor(const std::string&)>& stored) {
      return [stored](const std::string& fqn) {
        return stored ? stored(WholeModelFqn(fqn)) : dcp::StoredTensor{WholeModelFqn(fqn), {}};
      };
    };
    options.layout.model = whole(options.layout.model);
    options.layout.optimizer = whole(options.layout.optimizer);
  }
  const auto excluded = [&](const std::string& name) {
    return ck.initial_load_model_only || std::find(ck.exclude_from_loading.begin(), ck.exclude_from_loading.end(),
                                                   name) != ck.exclude_from_loading.end();
  };
  for (const auto& [name, object] : stateful_) {
    // torchtitan's loader state is pickled per rank and its data pipeline another; no RNG state.
    const bool absent = torchtitan && (name == "dataloader" || name == "rng");
    if (!excluded(name) && !absent) options.stateful.emplace_back(name, object.get());
  }
  dcp::Load(CheckpointedModel(), excluded("optimizer") ? nullptr : optimizer_.get(), ck.initial_load_path, options);
  if (torchtitan && !excluded("dataloader")) {
    // The data position of torchtitan's step: this trainer's stream after as many global batches.
    const int64_t windows = progress_.step * data_->global_batch_size();
    data_->LoadState(
        {.epoch = data_->stream().EpochOfWindow(windows), .windows_consumed = windows, .seed = data_->stream().seed()});
  }
  initial_load_ = absl::StrCat("loaded ", torchtitan ? "torchtitan's checkpoint " : "the checkpoint ",
                               ck.initial_load_path, ck.initial_load_model_only ? " (the model only)" : "",
                               "; training continues at step ", progress_.step + 1);
}

void Trainer::SaveCheckpoint() {
  if (checkpointer_ == nullptr) return;
  // torchtitan's checkpointer.save(step, last_step): with last_save_in_hf the last save is
  // Train()'s Hugging Face export.
  const bool last_step = progress_.step == config_.training.steps;
  if (!(last_step && config_.checkpoint.last_save_in_hf)) checkpointer_->Save(progress_.step, last_step);
}

struct Trainer::Pipeline {
  PipelineSplit split;
  std::vector<models::llama::LlamaForCausalLM> parts;  // this rank's, by stage index
  // What checkpoints save and load: the parts as children "0", "1", ... (WholeModelFqn).
  std::shared_ptr<torch::nn::Module> parts_module;
  std::vector<std::shared_ptr<pipelining::PipelineStage>> stages;
  std::unique_ptr<pipelining::PipelineSchedule> schedule;
  bool has_first = false, has_last = false;
  double global_tokens = 1;  // the step's, for the loss function (torchtitan's rescaled loss)
};

// torchtitan's pipeline_llm: split the model into stages, build this rank's parts on the meta
// device, parallelize and initialize each (the same values as the whole model's: the init
// draws per parameter name), wrap them as stages, and build the schedule.
void Trainer::BuildPipeline() {
  pipeline_ = std::make_unique<Pipeline>();
  Pipeline& pl = *pipeline_;
  TORCH_CHECK(!model_config_.tie_word_embeddings,
              "model.enable_weight_tying = true is not supported with pipeline parallelism (the embedding and the "
              "head live on different stages)");
  const ParallelismConfig& p = config_.parallelism;
  pl.split = PipelineLayerSplit(p, model_config_.num_hidden_layers, config_.training.local_batch_size);
  const comm::ProcessGroupPtr& pp = meshes_.pp->group(0);
  const int num_stages = static_cast<int>(pl.split.parts.size());
  for (const int s : LocalStageIndices(pl.split, pp->rank(), pp->size())) {
    models::llama::LlamaForCausalLM part(model_config_, c10::Device(c10::kMeta), pl.split.parts[s]);
    part->to(ScalarTypeOf(config_.training.dtype));
    std::vector<fsdp2::FSDPModule> units = ParallelizeLlama(part, config_, meshes_, device_);
    InitTorchtitanWeights(part, static_cast<uint64_t>(config_.debug.seed.value_or(0)));
    const fsdp2::FSDPModule root = units.back();
    units.pop_back();
    pipelining::PipelineStageOptions options;
    options.device = device_;
    options.data_parallel = std::make_shared<FsdpStageDataParallel>(root, units);
    // Our activation checkpointing is reentrant: the zero-bubble schedules' input halves
    // run whole backwards (torchtitan's non-reentrant checkpoint splits them).
    options.whole_backward_in_input = config_.activation_checkpoint.mode != ActivationCheckpointMode::kNone;
    // in: the tokens (the hidden state after the first stage), then each token's rotary
    // position, which every rank has and passes as a kwarg (torchtitan passes the positions to
    // every stage as a keyword argument): only the hidden state travels; the last stage
    // returns the logits.
    const bool last = s == num_stages - 1;
    pipelining::StageForward forward = [part](const std::vector<at::Tensor>& in) mutable {
      return std::vector<at::Tensor>{part(in[0], in.size() > 1 ? in[1] : at::Tensor())};
    };
    pl.stages.push_back(std::make_shared<pipelining::PipelineStage>(part.ptr(), forward, s, num_stages, pp, options));
    pl.parts.push_back(part);
    pl.has_first = pl.has_first || s == 0;
    pl.has_last = pl.has_last || last;
  }
  model_ = pl.parts.front();
  // Each part is named as the whole model's, so the ranks' parts together are the whole model
  // under its names and a checkpoint moves between pipeline degrees (any, and none).
  pl.parts_module = std::make_shared<torch::nn::Module>("PipelineParts");
  for (size_t i = 0; i < pl.parts.size(); ++i) pl.parts_module->register_module(std::to_string(i), pl.parts[i].ptr());
  pipelining::PipelineScheduleOptions options{
      .n_microbatches = static_cast<int>(pl.split.n_microbatches),
      // torchtitan's loss: the summed cross-entropy over the global valid tokens; scale_grads
      // off (the division is in the loss).
      .loss_fn = [&pl](const std::vector<at::Tensor>& out,
                       const at::Tensor& labels) { return CrossEntropySum(out[0], labels) / pl.global_tokens; },
      .scale_grads = false};
  if (pl.split.custom_csv) {
    const pipelining::ScheduleKind kind = pl.split.kind;
    const int ranks = pp->size();
    pl.schedule = std::make_unique<pipelining::PipelineSchedule>(
        pipelining::ReadScheduleCsv(p.pipeline_parallel_schedule_csv),
        [kind, ranks](int stage) { return pipelining::StageRank(kind, stage, ranks); }, pl.stages, options);
  } else {
    pl.schedule = std::make_unique<pipelining::PipelineSchedule>(pl.split.kind, pl.stages, options);
  }
}

torch::nn::Module& Trainer::CheckpointedModel() { return pipeline_ != nullptr ? *pipeline_->parts_module : *model_; }

std::vector<models::llama::LlamaForCausalLM> Trainer::model_parts() const {
  if (pipeline_ != nullptr) return pipeline_->parts;
  return {model_};
}

Trainer::~Trainer() = default;

at::Tensor Trainer::Forward(const TokenBatch& batch) { return model_(batch.input, batch.positions); }

TokenBatch Trainer::LocalTokens(TokenBatch batch) const {
  if (meshes_.cp) {
    const int64_t rank = meshes_.cp->coordinate()[0], cp = meshes_.cp->size();
    const bool balanced = config_.parallelism.context_parallel_load_balancer.has_value();
    if (!batch.positions.defined()) batch.positions = at::arange(batch.input.size(1), at::kLong).unsqueeze(0);
    batch.input = context_parallel::ShardSequence(batch.input, 1, rank, cp, balanced);
    batch.labels = context_parallel::ShardSequence(batch.labels, 1, rank, cp, balanced);
    batch.positions = context_parallel::ShardSequence(batch.positions, 1, rank, cp, balanced);
  }
  if (!device_.is_cpu()) {
    for (at::Tensor* t : {&batch.input, &batch.labels, &batch.positions}) {
      if (t->defined()) *t = t->to(device_);
    }
  }
  return batch;
}

StepResult Trainer::Step(bool global_metrics) {
  const Clock::time_point start = Clock::now();
  StepResult r;
  r.step = ++progress_.step;
  // train_step: zero the gradients; the lr this step uses (get_metrics() before the step).
  optimizer_->zero_grad(/*set_to_none=*/true);
  r.lr = lr_schedulers_->last_lrs().at(0);
  std::vector<TokenBatch> micro_batches;
  int64_t local_valid = 0;
  const Clock::time_point data_start = Clock::now();
  for (int64_t m = 0; m < degrees_.gradient_accumulation_steps; ++m) {
    micro_batches.push_back(LocalTokens(data_->NextBatch()));
    r.local_tokens += micro_batches.back().labels.numel();
    local_valid += micro_batches.back().labels.ne(kIgnoreIndex).sum().item<int64_t>();
  }
  r.data_seconds = Seconds(data_start);
  progress_.ntokens_seen += r.local_tokens;
  // global_valid_tokens: the batch mesh's sum, before any forward (every micro-batch's loss
  // divides by it).
  r.global_tokens =
      AllReduce(meshes_.loss, at::tensor({local_valid}, at::kLong).to(device_), comm::ReduceOp::Sum()).item<int64_t>();
  TORCH_CHECK(r.global_tokens > 0, "step ", r.step, ": the global batch has no valid token");
  if (pipeline_ != nullptr) return PipelinedStep(r, micro_batches, local_valid, global_metrics, start);
  at::Tensor accumulated = at::zeros({}, at::TensorOptions(at::kFloat).device(device_));
  const Clock::time_point model_start = Clock::now();
  for (const TokenBatch& batch : micro_batches) {
    const at::Tensor loss = CrossEntropySum(Forward(batch), batch.labels) / static_cast<double>(r.global_tokens);
    loss.backward();
    accumulated.add_(loss.detach());
  }
  r.model_seconds = Seconds(model_start);
  return FinishStep(r, accumulated.to(at::kDouble).reshape({1}), local_valid, global_metrics, start,
                    [&] { return fsdp2::clip_grad_norm_(*model_, config_.training.max_norm).item<double>(); });
}

// optim: clip_grad_norm_ (the total norm before clipping), optimizer, schedule; then
// collect_dist_metrics: global_avg_loss = sum of the ranks' accumulated losses; max loss = the
// largest rank's local mean (its accumulated loss * global / local tokens).
StepResult Trainer::FinishStep(StepResult r, const at::Tensor& loss_sum, int64_t local_valid, bool global_metrics,
                               Clock::time_point start, const std::function<double()>& clip) {
  const Clock::time_point optimizer_start = Clock::now();
  r.grad_norm = clip();
  // An async_with_pinned_mem save may still be copying the parameters and optimizer state.
  if (checkpointer_ != nullptr) checkpointer_->MaybeWaitForStaging();
  optimizer_->step();
  if (config_.float8.precompute_float8_dynamic_scale_for_fsdp) {
    for (auto& part : model_parts()) float8::precompute_float8_dynamic_scale_for_fsdp(*part);
  }
  lr_schedulers_->Step();
  r.optimizer_seconds = Seconds(optimizer_start);
  const double local_mean =
      local_valid > 0 ? loss_sum.item<double>() * static_cast<double>(r.global_tokens) / local_valid : 0.0;
  if (!global_metrics) {
    r.loss = r.max_loss = local_mean;
    r.seconds = Seconds(start);
    return r;
  }
  r.loss = AllReduce(meshes_.loss, loss_sum, comm::ReduceOp::Sum()).item<double>();
  r.max_loss =
      AllReduce(meshes_.loss, at::tensor({local_mean}, at::kDouble).to(device_), comm::ReduceOp::Max()).item<double>();
  TORCH_CHECK(std::isfinite(r.loss), "step ", r.step, ": the loss is not finite (global_avg_loss=", r.loss,
              "); stopping training");
  r.seconds = Seconds(start);
  return r;
}

// train_step with a pipeline (torchtitan's forward_backward_step under pp): each micro-batch
// through the schedule (tokens into the first stage, positions to every stage, labels to the last); the
// loss, known on the last stage, summed over the pipeline group so every rank reports it;
// clipping over the pipeline's stages.
StepResult Trainer::PipelinedStep(StepResult r, const std::vector<TokenBatch>& micro_batches, int64_t local_valid,
                                  bool global_metrics, Clock::time_point start) {
  Pipeline& pl = *pipeline_;
  pl.global_tokens = static_cast<double>(r.global_tokens);
  at::Tensor accumulated = at::zeros({}, at::TensorOptions(at::kFloat).device(device_));
  const Clock::time_point model_start = Clock::now();
  for (const TokenBatch& batch : micro_batches) {
    std::vector<at::Tensor> losses;
    pl.schedule->step({batch.input}, batch.labels, &losses, {batch.positions});
    for (const at::Tensor& loss : losses) accumulated.add_(loss.to(at::kFloat));
  }
  at::Tensor summed = accumulated.to(at::kDouble).reshape({1});
  meshes_.pp->group(0)->all_reduce(summed)->wait();  // only the last stage's rank holds the losses
  r.model_seconds = Seconds(model_start);
  std::vector<torch::nn::Module*> modules;
  for (auto& part : pl.parts) modules.push_back(part.ptr().get());
  return FinishStep(r, summed, local_valid, global_metrics, start,
                    [&] { return ClipGradNormAcrossStages(modules, meshes_.pp->group(0), config_.training.max_norm); });
}

// The summed cross-entropy of a batch; with a pipeline (torchtitan's validator under pp) through
// the schedule's eval(), known on the last stage's rank (0 elsewhere).
at::Tensor Trainer::ValidationLossSum(const TokenBatch& batch) {
  if (pipeline_ == nullptr) return CrossEntropySum(Forward(batch), batch.labels).to(at::kDouble);
  Pipeline& pl = *pipeline_;
  pl.global_tokens = 1;  // the schedule's loss is then each microbatch's sum
  std::vector<at::Tensor> losses;
  pl.schedule->eval({batch.input}, batch.labels, &losses, {batch.positions});
  at::Tensor sum = at::zeros({}, at::TensorOptions(at::kDouble).device(device_));
  for (const at::Tensor& loss : losses) sum += loss.to(at::kDouble);
  return sum;
}

Trainer::ValidationResult Trainer::Validate() {
  TORCH_CHECK(validation_data_ != nullptr, "Validate: validator.enable is false");
  at::NoGradGuard no_grad;
  const TrainingConfig& t = config_.training;
  DataLoader loader(validation_data_, {.seq_len = t.seq_len,
                                       .local_batch_size = t.local_batch_size,
                                       .dp_degree = meshes_.dp_size,
                                       .dp_rank = meshes_.dp_rank,
                                       .gradient_accumulation_steps = 1,
                                       .seed = config_.dataloader.seed});
  // torchtitan's validator reads its dataset once (infinite=False): the whole global batches
  // of one pass, at most validator.steps of them.
  int64_t batches = loader.stream().windows_per_epoch() / (t.local_batch_size * meshes_.dp_size);
  if (config_.validator.steps != -1) batches = std::min(batches, config_.validator.steps);
  TORCH_CHECK(batches > 0, "validator.dataset_path ", config_.validator.dataset_path,
              ": fewer windows than one global batch of local_batch_size * data-parallel degree = ",
              t.local_batch_size * meshes_.dp_size);
  at::Tensor sums = at::zeros({2}, at::TensorOptions(at::kDouble).device(device_));  // loss sum, valid tokens
  ValidationResult result;
  for (int64_t b = 0; b < batches; ++b) {
    const TokenBatch batch = LocalTokens(loader.NextBatch());
    result.local_tokens += batch.labels.numel();
    sums[0] += ValidationLossSum(batch);
    sums[1] += batch.labels.ne(kIgnoreIndex).sum().to(at::kDouble);
  }
  if (pipeline_ != nullptr) {  // the losses are on the last stage's rank
    at::Tensor loss = sums.narrow(0, 0, 1).clone();
    meshes_.pp->group(0)->all_reduce(loss)->wait();
    sums[0] = loss[0];
  }
  sums = AllReduce(meshes_.loss, sums, comm::ReduceOp::Sum());
  result.loss = sums[0].item<double>() / sums[1].item<double>();
  return result;
}

void Trainer::Train(std::ostream& log) {
  const bool writes = world_->rank() == 0 || config_.metrics.save_for_all_ranks;
  MetricsLog metrics(config_, world_->rank(), writes ? &log : nullptr, flops_per_token_, degrees_.tp, device_);
  const CheckpointConfig& ck = config_.checkpoint;
  if (const int64_t loaded = LoadCheckpoint(); loaded >= 0 && writes) {
    log << "loaded the checkpoint of step " << loaded << " from " << checkpointer_->StepDirectory(loaded)
        << "; training continues at step " << loaded + 1 << std::endl;
  } else if (!initial_load_.empty() && writes) {
    log << initial_load_ << std::endl;
  }
  while (progress_.step < config_.training.steps) {
    // dataloader.infinite = false: torchtitan's loader stops at the end of one pass over the
    // data (DataloaderExhaustedError) and the trainer ends there.
    if (!config_.dataloader.infinite &&
        data_->state().windows_consumed + data_->global_batch_size() > data_->stream().windows_per_epoch()) {
      if (writes) log << "the data ran out (dataloader.infinite = false) after step " << progress_.step << std::endl;
      break;
    }
    const int64_t next = progress_.step + 1;  // torchtitan's should_log
    const StepResult r = Step(next == 1 || next % config_.metrics.log_freq == 0);
    metrics.RecordStep(r);
    if (validation_data_ != nullptr && r.step % config_.validator.freq == 0) {
      const Clock::time_point start = Clock::now();
      const ValidationResult v = Validate();
      metrics.LogValidation(r.step, v.loss, v.local_tokens, Seconds(start));
    }
    const int64_t failed_saves = checkpointer_ != nullptr ? checkpointer_->failures() : 0;
    SaveCheckpoint();
    if (checkpointer_ != nullptr && checkpointer_->failures() > failed_saves && writes) {
      log << "step " << r.step << ": " << checkpointer_->last_failure()
          << "; training goes on (checkpoint.continue_on_save_failure)" << std::endl;
    }
    if (checkpointer_ != nullptr && checkpointer_->last_wait_seconds() > 1e-3 && writes) {
      log << "step " << r.step << ": waited " << checkpointer_->last_wait_seconds()
          << " s for the previous checkpoint save to finish" << std::endl;
    }
  }
  if (checkpointer_ != nullptr) checkpointer_->Wait();
  if (ck.enable && ck.last_save_in_hf) {
    const std::string dir = ExportDirectory();
    dcp::SaveHuggingFace(CheckpointedModel(), dir,
                         {.key_of = degrees_.pp > 1 ? WholeModelFqn : StoredFqn(),
                          .dtype = ExportScalarType(ck.export_dtype),
                          .keep_sharded = false,
                          .copy_files_from = config_.hf_assets_path});
    if (world_->rank() == 0) log << "exported the model in Hugging Face's layout to " << dir << std::endl;
  }
}

std::string Trainer::CheckpointFolder() const {
  return (std::filesystem::path(config_.dump_folder) / config_.checkpoint.folder).string();
}

std::string Trainer::ExportDirectory() const { return dcp::StepCheckpointDir(CheckpointFolder(), progress_.step); }

}  // namespace fsdp::train
