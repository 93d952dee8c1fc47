// FSDP2 showcase: a tiny decoder-only language model trained with fully_shard on 4 processes,
// checkpointed, and resumed on 2.
//   ./x run -n 4 bazel-bin/examples/fsdp2_demo --checkpoint_dir=build/demo
//   ./x run -n 2 bazel-bin/examples/fsdp2_demo --checkpoint_dir=build/demo --resume
// (`./x demo` builds and runs both.)
// Every block, then the root, is fully_shard'ed over a Gloo world group; each rank trains on
// its slice of the global batch with AdamW. Rank 0 prints per step the global loss, the step
// time, this rank's bytes of parameters + gradients + optimizer state, and the bytes FSDP
// moved. After kSteps every rank trains the same model on the whole batch without FSDP and
// checks that the loss curve and the final parameters agree. With --checkpoint_dir the run
// then saves a distributed checkpoint (DCP: every rank writes its own shards of the weights
// and AdamW state) to DIR/dcp and the full model (gathered to rank 0, one file) to DIR/full.pt.
// --resume starts a fresh, differently initialized model at this run's world size, loads
// DIR/dcp into it (dcp::Load reshards, e.g. 4 -> 2 ranks), checks the loaded weights are
// DIR/full.pt bitwise, trains kResumeSteps more steps, and compares with a single-rank run
// that trained kSteps + kResumeSteps steps without a break. Each run ends with PASS, or FAIL
// and exit 1.
// --checkpoint_every=K also saves an async sharded checkpoint to DIR/steps/step-<N> every K
// steps and, on start, resumes from the latest complete one there: run it under
// `torchrun --max-restarts 1` and a lost rank costs at most K steps; the relaunched job ends
// with the same bits as an uninterrupted one (FSDP_FAULT injects the loss: see
// examples/training_checkpoints.h). Any error ends every rank with one line and exit 1.
// --device=cuda trains on GPU cuda:LOCAL_RANK over NCCL (c10d's ProcessGroupNCCL; a
// --config=cuda build), the single-rank reference on the same GPU.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/comm_trace.h"
#include "comm/init_process_group.h"
#include "comm/main_guard.h"
#include "dcp/dcp.h"
#include "examples/training_checkpoints.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "mesh/device_mesh.h"
#include "metrics/step_metrics.h"
#include "tools/fsdp_memory.h"
#include "tools/fsdp_plan_lib.h"

ABSL_FLAG(std::string, checkpoint_dir, "",
          "after training, save a DCP checkpoint to DIR/dcp and the full model to DIR/full.pt (empty: none)");
ABSL_FLAG(int64_t, checkpoint_every, 0,
          "save an async sharded checkpoint to DIR/steps/step-<N> every K steps, and resume from the latest complete "
          "one there on start (0: none)");
ABSL_FLAG(std::string, device, "cpu",
          "cpu (Gloo) or cuda (NCCL through c10d's ProcessGroupNCCL, rank on cuda:LOCAL_RANK; needs a "
          "--config=cuda build)");
ABSL_FLAG(bool, resume, false,
          "instead of training from scratch: load DIR/dcp at this world size and train kResumeSteps more steps");

namespace {

using fsdp::Hooked;

constexpr int64_t kVocab = 64, kDim = 32, kBlocks = 3, kSeq = 16;
constexpr int64_t kGlobalBatch = 32;  // sequences per step, split evenly over the ranks
constexpr int kSteps = 30;            // from scratch, then the checkpoint
constexpr int kResumeSteps = 10;      // after loading it
constexpr double kLr = 1e-2;          // AdamW's

// The tolerance after `steps` AdamW steps, relative to max(1, |reference|), from AdamW and float32
// rather than from what one machine printed. AdamW moves a parameter by about lr per step whatever its
// gradient's scale (lr * m / sqrt(v)), so by at most about steps * lr in all. FSDP averages the ranks'
// slice-mean gradients where the reference takes one whole-batch mean; the two orders round differently,
// by some float32 ulps of a step per step (a resumed run adds nothing: the checkpoint holds the exact
// bits), and AdamW makes that visible where a gradient element is near zero. Allowed: 2^-10 of the total
// movement, 2^13 ulps of it (float32's epsilon is 2^-23), for that rounding to compound through the
// network over the steps. A wrong shard, a lost gradient or a stale parameter is off by a whole step, lr,
// from the first step on. The losses follow the parameters, to the same relative accuracy.
double Tolerance(int steps) { return steps * kLr * std::ldexp(1.0, -10); }

// Pre-norm transformer block: causal single-head self-attention, then an MLP, each residual.
struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        // No bias on q, k, v: a key bias shifts every score of a query equally, so its gradient
        // is exactly zero and AdamW would turn float noise into full-size steps there.
        qkv(register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(kDim, 3 * kDim).bias(false)))),
        proj(register_module("proj", torch::nn::Linear(kDim, kDim))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        fc1(register_module("fc1", torch::nn::Linear(kDim, 4 * kDim))),
        fc2(register_module("fc2", torch::nn::Linear(4 * kDim, kDim))) {}

  at::Tensor forward(const at::Tensor& x) {  // [batch, seq, dim]
    std::vector<at::Tensor> qkv_parts = qkv(ln1(x)).chunk(3, -1);
    at::Tensor scores = at::matmul(qkv_parts[0], qkv_parts[1].transpose(-2, -1)) / std::sqrt(double(kDim));
    const int64_t t = x.size(1);
    scores =
        scores.masked_fill(at::ones({t, t}, scores.options().dtype(at::kBool)).triu(1), -INFINITY);  // no peeking ahead
    at::Tensor h = x + proj(at::matmul(at::softmax(scores, -1), qkv_parts[2]));
    return h + fc2(at::gelu(fc1(ln2(h))));
  }

  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
};

// Hooked<Impl> is Impl whose forward runs FSDP's hooks once fully_shard attached them;
// without fully_shard it is the plain module (the single-rank reference below uses that).
struct DecoderImpl : torch::nn::Module {
  DecoderImpl()
      : embed(register_module("embed", torch::nn::Embedding(kVocab, kDim))),
        pos(register_parameter("pos", at::zeros({kSeq, kDim}))),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))) {
    for (int64_t i = 0; i < kBlocks; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), Hooked<BlockImpl>()));
    }
  }

  at::Tensor forward(const at::Tensor& tokens) {  // [batch, seq] -> logits [batch, seq, vocab]
    at::Tensor h = embed(tokens) + pos.narrow(0, 0, tokens.size(1));
    for (auto& block : blocks) h = block(h);
    // The output head is tied to the embedding: it registers no parameter of its own but
    // reads embed->weight, which the root's FSDP group holds all-gathered during this
    // forward (the root keeps it until after backward), so both uses see the full matrix
    // and both gradient contributions meet in one reduce-scatter.
    return at::linear(ln_f(h), embed->weight);
  }

  torch::nn::Embedding embed;
  at::Tensor pos;
  torch::nn::LayerNorm ln_f;
  std::vector<Hooked<BlockImpl>> blocks;
};
using Decoder = Hooked<DecoderImpl>;

// Same values on every rank and in the reference: one generator per parameter, never the
// global RNG (whose state depends on what ran before). Parameter k's generator is seeded with
// first_seed + k.
constexpr uint64_t kInitSeed = 1;
// The resumed model starts elsewhere, so only the checkpoint can make it match.
constexpr uint64_t kResumeInitSeed = 1000;
void InitDeterministic(torch::nn::Module& model, uint64_t first_seed) {
  at::NoGradGuard no_grad;
  uint64_t seed = first_seed;
  for (auto& item : model.named_parameters()) {
    at::Tensor& p = item.value();
    if (p.dim() == 1) {
      p.fill_(absl::EndsWith(item.key(), "bias") ? 0.0 : 1.0);  // biases 0, LayerNorm gains 1
    } else {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(seed++);
      p.copy_(at::randn(p.sizes(), gen) / std::sqrt(double(p.size(-1))));
    }
  }
}

// Synthetic sequences with a pattern to learn: token[t] = (start + stride * t) mod vocab with a
// per-sequence stride from {1, 2, 3, 5}; predicting the next token needs the previous two
// (attention). Returns [batch, seq + 1]: inputs are [:, :-1], targets [:, 1:].
at::Tensor Sequences(int step, int64_t batch) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  at::Tensor start = at::randint(kVocab, {batch, 1}, gen, at::kLong);
  at::Tensor stride = at::tensor(std::vector<int64_t>{1, 2, 3, 5}).index({at::randint(4, {batch, 1}, gen, at::kLong)});
  return (start + stride.view({batch, 1}) * at::arange(kSeq + 1, at::kLong)).remainder(kVocab);
}

at::Tensor Loss(Decoder& model, const at::Tensor& seqs) {
  at::Tensor logits = model(seqs.narrow(1, 0, kSeq));
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), seqs.narrow(1, 1, kSeq).reshape(-1));
}

// Bytes of this process's parameters, gradients and AdamW moments. With FSDP every one of
// them is a local shard between steps, so this is about 1/world of the unsharded model's.
struct Bytes {
  int64_t params = 0, grads = 0, optim = 0;
  int64_t total() const { return params + grads + optim; }
};
Bytes CountBytes(const std::vector<at::Tensor>& params, torch::optim::AdamW& opt) {
  Bytes b;
  for (const at::Tensor& p : params) {
    b.params += p.nbytes();
    if (p.grad().defined()) b.grads += p.grad().nbytes();
  }
  for (const auto& entry : opt.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*entry.second);
    for (const at::Tensor& t : {s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()}) {
      if (t.defined()) b.optim += t.nbytes();
    }
  }
  return b;
}

double Kib(int64_t bytes) { return bytes / 1024.0; }

double Ms(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - since).count();
}

torch::optim::AdamWOptions OptimizerOptions() { return torch::optim::AdamWOptions(kLr).weight_decay(0.01); }

// The world group and the traced wrapper FSDP's mesh is built on.
struct World {
  fsdp::comm::ProcessGroupPtr group;  // untraced: the demo's own collectives (global loss, verdict)
  std::shared_ptr<fsdp::comm::CommTrace> trace;
  fsdp::mesh::DeviceMeshPtr mesh;
  c10::Device device = c10::Device(c10::kCPU);  // model, batches and the reference
  int size = 0, rank = 0;
  double peak_flops = 0;        // the measured matmul rate (CPU); 0 on a GPU (no MFU)
  double flops_per_token = 0;   // of the unsharded model
  int64_t predicted_peak = -1;  // fsdp_plan --memory for this model and world
  bool log() const { return rank == 0; }
};

// torchtitan's count: embeddings (embed, pos) excluded, attention over kSeq tokens.
double FlopsPerToken(DecoderImpl& model) {
  int64_t params = 0;
  for (const auto& p : model.parameters()) params += p.numel();
  params -= model.embed->weight.numel() + model.pos.numel();
  return fsdp::metrics::DecoderFlopsPerToken(params, kBlocks, /*heads=*/1, /*head_dim=*/kDim, kSeq);
}

// fsdp_plan --memory's allocation peak per rank for kBlocks blocks sharded over `world` ranks
// with AdamW: parameters, gradients, optimizer state and the unsharded block; activations are
// not modeled here (0), nor the root's embedding and LayerNorm.
int64_t PredictedPeak(DecoderImpl& model, int world) {
  std::vector<std::string> shapes;
  for (const auto& p : model.blocks[0]->parameters()) shapes.push_back(absl::StrJoin(p.sizes(), "x"));
  fsdp_plan::RawFlags flags;
  flags.shapes = absl::StrJoin(shapes, ",");
  flags.world = std::to_string(world);
  fsdp_plan::PlanOptions options;
  const std::string error = fsdp_plan::ParseOptions(flags, &options);
  TORCH_CHECK(error.empty(), "PredictedPeak: ", error);
  return fsdp_plan::EstimateMemory(fsdp_plan::MakePlan(options), {.units = kBlocks}).peak;
}

// Full model on every rank (same values), then shard it: blocks first, the root last, so the
// root's group gets what no block claims (embedding = tied head, pos, final LayerNorm).
Decoder BuildSharded(const World& w, uint64_t init_seed) {
  Decoder model;
  InitDeterministic(*model, init_seed);
  model->to(w.device);
  for (auto& block : model->blocks) fsdp::fsdp2::fully_shard(block.ptr(), {.mesh = w.mesh, .device = w.device});
  fsdp::fsdp2::fully_shard(model.ptr(), {.mesh = w.mesh, .device = w.device});
  return model;
}

// What an FSDP2 run measured, for the summary.
struct ShardedRun {
  std::vector<double> losses, step_ms;  // element i: step first + i
  Bytes sharded;                        // this rank's, at the last step
  int64_t ag = 0, rs = 0;               // bytes all-gathered / reduce-scattered in the last step
};

// Steps [first, first + steps), each rank on its slice of the global batch; rank 0 prints a
// row per step. `checkpoints` (may be null) injects its fault and saves after each step.
ShardedRun TrainSharded(const World& w, Decoder& model, torch::optim::AdamW& opt, int first, int steps,
                        fsdp::examples::PeriodicCheckpointer* checkpoints = nullptr) {
  if (w.log()) {
    std::printf("%4s %8s %7s %18s %15s %19s\n", "step", "loss", "ms", "P+G+O KiB/rank", "all-gather KiB",
                "reduce-scatter KiB");
  }
  const int64_t local = kGlobalBatch / w.size;
  // Rank 0 prints the metrics line every 10 steps (metrics/step_metrics.h).
  fsdp::metrics::StepMetrics metrics({.rank = w.rank,
                                      .device = w.device,
                                      .tokens_per_step = local * kSeq,
                                      .flops_per_token = w.flops_per_token,
                                      .peak_flops = w.peak_flops,
                                      .predicted_peak_bytes = w.predicted_peak,
                                      .print_every = w.log() ? 10 : 0});
  ShardedRun run;
  for (int step = first; step < first + steps; ++step) {
    if (checkpoints != nullptr) checkpoints->fault().MaybeKillAt(w.rank, step);
    const at::Tensor seqs = Sequences(step, kGlobalBatch).narrow(0, w.rank * local, local).to(w.device);  // my slice
    w.trace->clear();
    const auto t0 = std::chrono::steady_clock::now();
    metrics.BeginStep();
    at::Tensor loss = Loss(model, seqs);
    loss.backward();  // blocks re-gather their weights; gradients are reduce-scattered (averaged)
    opt.step();
    metrics.EndStep();
    run.step_ms.push_back(Ms(t0));                       // the first step includes FSDP's lazy initialization
    run.sharded = CountBytes(model->parameters(), opt);  // before zero_grad: gradients still there
    opt.zero_grad();
    // Sizes of the full buffers: all-gather outputs and reduce-scatter inputs.
    run.ag = w.trace->total_output_bytes("all_gather_into_tensor");
    run.rs = w.trace->total_input_bytes("reduce_scatter_tensor");
    // The global loss is the mean over ranks (equal slices); reduced outside the trace.
    at::Tensor global = loss.detach().clone();
    w.group->all_reduce(global, fsdp::comm::ReduceOp::Avg())->wait();
    run.losses.push_back(global.item<double>());
    if (checkpoints != nullptr) checkpoints->AfterStep(step, first + steps, *model, opt);
    if (w.log()) {
      std::printf("%4d %8.4f %7.1f %18.1f %15.1f %19.1f\n", step, run.losses.back(), run.step_ms.back(),
                  Kib(run.sharded.total()), Kib(run.ag), Kib(run.rs));
    }
  }
  return run;
}

// The same training on one rank without FSDP: same init, the whole global batch per step.
struct Reference {
  Decoder model;
  std::vector<double> losses;
  Bytes bytes;  // at the last step
};
Reference TrainReference(int steps, c10::Device device) {
  Reference ref;
  InitDeterministic(*ref.model, kInitSeed);
  ref.model->to(device);
  torch::optim::AdamW opt(ref.model->parameters(), OptimizerOptions());
  for (int step = 0; step < steps; ++step) {
    at::Tensor loss = Loss(ref.model, Sequences(step, kGlobalBatch).to(device));
    loss.backward();
    opt.step();
    ref.bytes = CountBytes(ref.model->parameters(), opt);
    opt.zero_grad();
    ref.losses.push_back(loss.item<double>());
  }
  return ref;
}

// How far an FSDP run (its losses from step `first` on, its gathered parameters) is from the
// reference.
struct Agreement {
  double loss = 0, param = 0;  // the largest differences, relative to max(1, |reference|)
  double tol = 0;              // Tolerance of the steps compared
  bool ok = true;
};
Agreement Compare(const ShardedRun& run, int first, const Reference& ref, const fsdp::fsdp2::FullStateDict& trained,
                  bool log) {
  Agreement a;
  a.tol = Tolerance(first + static_cast<int>(run.losses.size()));
  for (size_t i = 0; i < run.losses.size(); ++i) {
    const double expected = ref.losses[first + i];
    a.loss = std::max(a.loss, std::abs(run.losses[i] - expected) / std::max(1.0, std::abs(expected)));
  }
  a.ok = a.loss <= a.tol && trained.size() == ref.model->named_parameters().size();
  for (const auto& item : ref.model->named_parameters()) {
    const at::Tensor* got = trained.find(item.key());
    if (got == nullptr) {
      if (log) std::printf("missing from FSDP: %s\n", item.key().c_str());
      a.ok = false;
      continue;
    }
    const at::Tensor expected = item.value().detach().to(at::kCPU);
    const double scale = std::max(1.0, expected.abs().max().item<double>());
    a.param = std::max(a.param, (got->to(at::kCPU) - expected).abs().max().item<double>() / scale);
  }
  a.ok = a.ok && a.param <= a.tol;
  return a;
}

// Every rank checked its own copy; one FAIL fails all.
bool AllRanksOk(const World& w, bool ok) {
  at::Tensor failed = at::tensor({ok ? 0.0f : 1.0f}).to(w.device);
  w.group->all_reduce(failed, fsdp::comm::ReduceOp::Max())->wait();
  return failed.item<float>() == 0.0f;
}

// A DCP checkpoint directory: one __<rank>_0.distcp per writing rank, plus .metadata.
struct CheckpointFiles {
  int shard_files = 0;
  int64_t bytes = 0;
};
CheckpointFiles ListCheckpoint(const std::string& dir) {
  CheckpointFiles files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    files.shard_files += entry.path().extension() == ".distcp";
    files.bytes += static_cast<int64_t>(entry.file_size());
  }
  return files;
}

// DIR/dcp: every rank writes only its own shards of the parameters and AdamW state (no rank
// gathers the model); rank 0 writes .metadata last. DIR/full.pt: the whole model gathered to
// rank 0 alone, on the CPU, as one torch pickle file (Python: torch.load(path)).
void SaveCheckpoint(const World& w, Decoder& model, const torch::optim::AdamW& opt, const std::string& dir) {
  const auto t0 = std::chrono::steady_clock::now();
  fsdp::dcp::Save(*model, &opt, dir + "/dcp");
  const double save_ms = Ms(t0);
  const auto full = fsdp::fsdp2::GetFullStateDict(*model, {.rank0_only = true, .cpu_offload = true});
  if (!w.log()) return;
  fsdp::fsdp2::SaveFullStateDict(full, dir + "/full.pt");
  const CheckpointFiles files = ListCheckpoint(dir + "/dcp");
  std::printf(
      "saved after %d steps: %s/dcp (%d shard files + .metadata, %.1f KiB, %.1f ms), %s/full.pt (%zu tensors)\n",
      kSteps, dir.c_str(), files.shard_files, Kib(files.bytes), save_ms, dir.c_str(), full.size());
}

// kSteps from scratch (or from the latest periodic checkpoint), checked against the
// single-rank reference, then the checkpoint.
int TrainFromScratch(const World& w, const std::string& checkpoint_dir, int64_t checkpoint_every) {
  Decoder model = BuildSharded(w, kInitSeed);
  // Built after fully_shard: the optimizer sees (and keeps state only for) the shards.
  torch::optim::AdamW opt(model->parameters(), OptimizerOptions());
  fsdp::examples::PeriodicCheckpointer checkpoints(checkpoint_dir + "/steps", checkpoint_every, w.group,
                                                   fsdp::examples::ReadInjectedFault(), w.log());
  const int first = static_cast<int>(checkpoints.Resume(*model, &opt));
  if (w.log()) {
    std::printf(
        "FSDP2 demo: %ld-block decoder (vocab %ld, d %ld, tied head), %d ranks, global batch %ld x %ld tokens, AdamW\n",
        kBlocks, kVocab, kDim, w.size, kGlobalBatch, kSeq);
  }
  ShardedRun run = TrainSharded(w, model, opt, first, kSteps - first, &checkpoints);
  checkpoints.Finish();
  // Gather every trained parameter (collective: all ranks, same order) keyed by its name.
  const auto trained = fsdp::fsdp2::GetFullStateDict(*model);
  const Reference ref = TrainReference(kSteps, w.device);
  const Agreement agree = Compare(run, first, ref, trained, w.log());
  const bool ok = AllRanksOk(w, agree.ok);

  if (w.log()) {
    std::printf("\nloss: %.4f -> %.4f over steps %d-%d (final loss %a; %ld periodic checkpoints)\n", run.losses.front(),
                run.losses.back(), first, kSteps - 1, run.losses.back(), static_cast<long>(checkpoints.saves()));
    // What each fully_shard call manages: the tied head adds no tensor, the root's
    // embed.weight serves both uses. The root's tensors with their global -> shard shapes.
    for (const auto& group : fsdp::fsdp2::ListFSDPGroups(*model)) {
      const bool root = group.module_fqns.front().empty();
      std::string names;
      for (const auto& p : group.params) {
        names += absl::StrCat(" ", p.fqn, " [", absl::StrJoin(p.sharding_spec.shape, ","), "]->[",
                              absl::StrJoin(p.shard_shape, ","), "]");
      }
      std::printf("fully_shard(%s): %zu tensors%s\n", root ? "root" : group.module_fqns.front().c_str(),
                  group.params.size(), root ? (":" + names).c_str() : "");
    }
    std::sort(run.step_ms.begin() + 1, run.step_ms.end());
    const size_t median = run.step_ms.size() / 2;
    std::printf(
        "median step %.1f ms; per step all-gather %.1f KiB (root once, kept through backward; each block\n"
        "  twice: forward, then again for backward), reduce-scatter %.1f KiB (every gradient once)\n",
        run.step_ms[median], Kib(run.ag), Kib(run.rs));
    const Bytes& sharded = run.sharded;
    const Bytes& full = ref.bytes;
    std::printf(
        "KiB per rank, params + grads + AdamW state: FSDP %.1f + %.1f + %.1f = %.1f, single rank %.1f + %.1f + %.1f = "
        "%.1f (%.2fx)\n",
        Kib(sharded.params), Kib(sharded.grads), Kib(sharded.optim), Kib(sharded.total()), Kib(full.params),
        Kib(full.grads), Kib(full.optim), Kib(full.total()), double(full.total()) / double(sharded.total()));
    std::printf("vs single-rank reference: max loss diff %.1e, max param diff %.1e (tol %.1e), %zu tensors\n",
                agree.loss, agree.param, agree.tol, trained.size());
    std::printf("%s\n", ok ? "PASS" : "FAIL");
  }
  if (!ok) return 1;
  if (!checkpoint_dir.empty()) SaveCheckpoint(w, model, opt, checkpoint_dir);
  return 0;
}

// A fresh model at this world size, loaded from the checkpoint, kResumeSteps more steps,
// checked against the single-rank reference run for kSteps + kResumeSteps without a break.
int Resume(const World& w, const std::string& dir) {
  Decoder model = BuildSharded(w, kResumeInitSeed);
  torch::optim::AdamW opt(model->parameters(), OptimizerOptions());  // no state yet: Load brings it
  const auto t0 = std::chrono::steady_clock::now();
  // Each rank reads only the stored chunks that overlap its new shards, whatever the saving
  // world size was.
  fsdp::dcp::Load(*model, &opt, dir + "/dcp");
  const double load_ms = Ms(t0);
  // Resharding only moves bytes: the loaded weights must be full.pt's bit for bit.
  const auto loaded = fsdp::fsdp2::GetFullStateDict(*model, {.rank0_only = true, .cpu_offload = true});
  bool same = true;
  if (w.log()) {
    const auto saved = fsdp::fsdp2::LoadFullStateDictFile(dir + "/full.pt");
    same = saved.size() == loaded.size();
    for (const auto& item : saved) {
      const at::Tensor* got = loaded.find(item.key());
      same = same && got != nullptr && at::equal(*got, item.value());
    }
    std::printf("FSDP2 demo, resumed: %s/dcp (%d shard files) loaded into %d ranks in %.1f ms; weights %s %s/full.pt\n",
                dir.c_str(), ListCheckpoint(dir + "/dcp").shard_files, w.size, load_ms,
                same ? "bitwise equal to" : "DIFFER from", dir.c_str());
  }
  const ShardedRun run = TrainSharded(w, model, opt, kSteps, kResumeSteps);
  const auto trained = fsdp::fsdp2::GetFullStateDict(*model);
  const Reference ref = TrainReference(kSteps + kResumeSteps, w.device);
  const Agreement agree = Compare(run, kSteps, ref, trained, w.log());
  const bool ok = AllRanksOk(w, same && agree.ok);
  if (w.log()) {
    std::printf("\nloss: %.4f -> %.4f over steps %d-%d\n", run.losses.front(), run.losses.back(), kSteps,
                kSteps + kResumeSteps - 1);
    std::printf("vs uninterrupted single-rank run of %d steps: max loss diff %.1e, max param diff %.1e (tol %.1e)\n",
                kSteps + kResumeSteps, agree.loss, agree.param, agree.tol);
    std::printf("%s: checkpoint saved after %d steps, resumed on %d ranks for %d more steps, %s\n",
                ok ? "PASS" : "FAIL", kSteps, w.size, kResumeSteps,
                ok     ? "matches the uninterrupted run"
                : same ? "does NOT match the uninterrupted run"
                       : "but the loaded weights differ from full.pt");
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  at::set_num_threads(1);  // the ranks share the machine's cores
  // Every error (a lost rank, a bad checkpoint directory: the message names it) ends this
  // rank with one line on stderr and exit status 1.
  return fsdp::comm::RunMain([] {
    World w;
    // Gloo on the CPU, or NCCL with rank r on cuda:LOCAL_RANK (the NCCL factory explains a
    // build without CUDA); another --device is an error naming it.
    auto [group, device] = fsdp::comm::InitProcessGroupFromEnv(absl::GetFlag(FLAGS_device));
    w.group = std::move(group);
    w.device = device;
    w.size = w.group->size();
    w.rank = w.group->rank();
    if (kGlobalBatch % w.size != 0) {
      if (w.log()) std::printf("global batch %ld is not divisible by %d ranks\n", kGlobalBatch, w.size);
      return 2;
    }
    // Wrap the world group BEFORE building the mesh, so every FSDP collective goes through the
    // trace (a 1-D mesh over the whole world reuses the group it is given).
    w.trace = std::make_shared<fsdp::comm::CommTrace>(w.group);
    w.mesh = fsdp::mesh::DeviceMesh::Create(w.trace, {w.size});
    {
      Decoder probe;  // unsharded: what the metrics count per token and the memory model plans
      w.flops_per_token = FlopsPerToken(*probe);
      w.predicted_peak = PredictedPeak(*probe, w.size);
      if (w.device.is_cpu()) w.peak_flops = fsdp::metrics::MeasureMatmulPeakFlops();
    }
    const std::string dir = absl::GetFlag(FLAGS_checkpoint_dir);
    const int64_t every = absl::GetFlag(FLAGS_checkpoint_every);
    if ((every != 0 && dir.empty()) || every < 0 || (every != 0 && absl::GetFlag(FLAGS_resume))) {
      if (w.log()) {
        std::printf("--checkpoint_every must be >= 0, and > 0 only with --checkpoint_dir and without --resume\n");
      }
      return 2;
    }
    if (!absl::GetFlag(FLAGS_resume)) return TrainFromScratch(w, dir, every);
    if (dir.empty()) {
      if (w.log()) std::printf("--resume needs --checkpoint_dir (the directory the first run saved to)\n");
      return 2;
    }
    return Resume(w, dir);
  });
}
