// The Llama demo (`./x demo`): HF's tiny LlamaForCausalLM config in C++ (models/llama/model.h), trained with
// FSDP2 (fully_shard per decoder layer, then the root), activation checkpointing and gradient
// clipping on Gloo processes, against the reference nobody here wrote: the same model in
// Hugging Face transformers trained under PyTorch's own FSDP2 (testdata/hf_llama_fsdp2.py,
// which also writes the initial weights with save_pretrained: this demo loads that directory
// into each rank's shards, and with --export_dir exports the trained model in the same layout
// for transformers to load: testdata/hf_check_export.py).
//
//   python examples/llama/testdata/hf_llama_fsdp2.py 4 20 REF 2      # the reference (peer venv)
//   ./x run -n 4 bazel-bin/examples/llama/llama_demo --reference_dir=REF --checkpoint_dir=CKPT --export_dir=OUT
//   python examples/llama/testdata/hf_check_export.py OUT OUT_logits.pt   # transformers loads OUT
//   ./x run -n 2 bazel-bin/examples/llama/llama_demo --reference_dir=REF --checkpoint_dir=CKPT
//
// Rank 0 prints per step the loss and grad norm next to the reference's, tokens/s, this rank's
// bytes of parameters + gradients + AdamW state, and the bytes FSDP all-gathered and
// reduce-scattered; then PASS, or FAIL and exit 1, for every step's loss and grad norm and the
// final parameters. With --checkpoint_dir an async sharded DCP checkpoint is saved after step
// 10, and a run that finds one there resumes from it (at any world size: the second command
// continues on 2 processes and must match the same reference).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/tensor_dict_file.h"
#include "comm/comm_trace.h"
#include "comm/gloo_process_group.h"
#include "comm/main_guard.h"
#include "dcp/hf.h"
#include "examples/llama/llama_training.h"
#include "examples/training_checkpoints.h"
#include "fsdp/fsdp2/state_dict.h"
#include "mesh/device_mesh.h"
#include "metrics/step_metrics.h"

ABSL_FLAG(std::string, reference_dir, "",
          "hf_llama_fsdp2.py's output: hf_init/ (save_pretrained's) and reference.pt (required)");
ABSL_FLAG(std::string, export_dir, "",
          "after training, export the model to DIR in Hugging Face's layout (with hf_init's config.json) and "
          "write our logits on the first batch to DIR_logits.pt");
ABSL_FLAG(std::string, checkpoint_dir, "", "save a DCP checkpoint after step 10 to DIR/steps; resume from one there");
ABSL_FLAG(bool, activation_checkpointing, true, "checkpoint every decoder layer");

namespace {

using fsdp::examples::llama::ShardedLlama;
using fsdp::examples::llama::StepResult;

constexpr int64_t kCheckpointEvery = 10;

double Kib(int64_t bytes) { return bytes / 1024.0; }

// This rank's parameters, gradients and AdamW moments (all shards between steps).
int64_t ShardBytes(const ShardedLlama& s) {
  int64_t bytes = 0;
  for (const at::Tensor& p : s.model->parameters()) {
    bytes += p.nbytes() + (p.grad().defined() ? p.grad().nbytes() : 0);
  }
  for (const auto& entry : s.opt->state()) {
    const auto& st = static_cast<const torch::optim::AdamWParamState&>(*entry.second);
    bytes += st.exp_avg().nbytes() + st.exp_avg_sq().nbytes();
  }
  return bytes;
}

const at::Tensor& Get(const fsdp::checkpoint::TensorDict& dict, const std::string& key, const std::string& file) {
  const at::Tensor* t = dict.find(key);
  TORCH_CHECK(t != nullptr, "llama_demo: ", file, " has no '", key, "' (not hf_llama_fsdp2.py's output?)");
  return *t;
}

double Rel(double got, double want) { return std::abs(got - want) / std::max(1.0, std::abs(want)); }

int Run() {
  const std::string ref_dir = absl::GetFlag(FLAGS_reference_dir);
  TORCH_CHECK(!ref_dir.empty(), "llama_demo: --reference_dir is required (hf_llama_fsdp2.py's output directory)");
  const fsdp::comm::ProcessGroupPtr world = fsdp::comm::CreateGlooProcessGroupFromEnv();
  const bool log = world->rank() == 0;
  auto trace = std::make_shared<fsdp::comm::CommTrace>(world);
  auto mesh = fsdp::mesh::DeviceMesh::Create(trace, {world->size()});
  const auto ref = fsdp::checkpoint::LoadTensorDict(ref_dir + "/reference.pt");
  const std::string ref_file = ref_dir + "/reference.pt";
  const at::Tensor& tokens = Get(ref, "tokens", ref_file);  // [steps, global batch, seq]
  const at::Tensor ref_losses = Get(ref, "losses", ref_file), ref_norms = Get(ref, "grad_norms", ref_file);
  const int64_t steps = tokens.size(0);
  // Derived from the reference's own runs (llama_training.h): its f32 rounding error, and the
  // spread to this world size's summation order (the resumed run uses another world size).
  const double tol = fsdp::examples::llama::TrainingTolerance(ref, world->size());
  TORCH_CHECK(tokens.dim() == 3 && tokens.size(1) % world->size() == 0, "llama_demo: a global batch of ",
              tokens.size(1), " rows does not split over ", world->size(), " ranks");

  const bool ac = absl::GetFlag(FLAGS_activation_checkpointing);
  ShardedLlama s = fsdp::examples::llama::BuildShardedLlama(ref_dir + "/hf_init", mesh, ac);
  const std::string ckpt_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  fsdp::examples::PeriodicCheckpointer checkpoints(ckpt_dir + "/steps", ckpt_dir.empty() ? 0 : kCheckpointEvery, world,
                                                   fsdp::examples::ReadInjectedFault(), log);
  const int64_t first = checkpoints.Resume(*s.model, s.opt.get());
  if (log) {
    const auto c = fsdp::examples::llama::HfReferenceConfig();
    std::printf(
        "Llama demo: HF LlamaForCausalLM config (%ld layers, hidden %ld, %ld heads / %ld kv heads, vocab %ld), FSDP2 "
        "per layer + root on %d ranks, activation checkpointing %s, clip_grad_norm %.1f, AdamW; global batch %ld x "
        "%ld tokens\nreference: HF transformers under PyTorch FSDP2 (%s)\n",
        long(c.num_hidden_layers), long(c.hidden_size), long(c.num_attention_heads), long(c.num_key_value_heads),
        long(c.vocab_size), world->size(), ac ? "on" : "off", fsdp::examples::llama::kMaxNorm, long(tokens.size(1)),
        long(tokens.size(2)), ref_file.c_str());
    std::printf("%4s %9s %9s %9s %9s %9s %13s %11s %11s\n", "step", "loss", "HF loss", "norm", "HF norm", "tokens/s",
                "P+G+O KiB/rk", "AG KiB", "RS KiB");
  }
  // Rank 0 prints the metrics line every 5 steps (metrics/step_metrics.h); FLOPs as torchtitan
  // counts them (the embedding table excluded; the untied LM head counted).
  const auto c = fsdp::examples::llama::HfReferenceConfig();
  const int64_t h = c.hidden_size, kv = c.num_key_value_heads * c.head_dim();
  const int64_t layer_params = 2 * h * h + 2 * h * kv + 3 * h * c.intermediate_size + 2 * h;
  fsdp::metrics::StepMetrics metrics({.rank = world->rank(),
                                      .tokens_per_step = tokens.size(1) / world->size() * tokens.size(2),
                                      .flops_per_token = fsdp::metrics::DecoderFlopsPerToken(
                                          c.num_hidden_layers * layer_params + h + h * c.vocab_size,
                                          c.num_hidden_layers, c.num_attention_heads, c.head_dim(), tokens.size(2)),
                                      .peak_flops = fsdp::metrics::MeasureMatmulPeakFlops(),
                                      .print_every = log ? 5 : 0});
  double worst = 0;
  for (int64_t step = first; step < steps; ++step) {
    checkpoints.fault().MaybeKillAt(world->rank(), step);
    trace->clear();
    const auto t0 = std::chrono::steady_clock::now();
    metrics.BeginStep();
    const StepResult r = fsdp::examples::llama::TrainStep(s, tokens[step]);
    metrics.EndStep();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double want_loss = ref_losses[step].item<double>(), want_norm = ref_norms[step].item<double>();
    worst = std::max({worst, Rel(r.loss, want_loss), Rel(r.grad_norm, want_norm)});
    if (log) {
      std::printf("%4ld %9.5f %9.5f %9.5f %9.5f %9.0f %13.1f %11.1f %11.1f\n", long(step), r.loss, want_loss,
                  r.grad_norm, want_norm, double(tokens.size(1) * tokens.size(2)) / seconds, Kib(ShardBytes(s)),
                  Kib(trace->total_output_bytes("all_gather_into_tensor")),
                  Kib(trace->total_input_bytes("reduce_scatter_tensor")));
    }
    checkpoints.AfterStep(step, steps, *s.model, *s.opt);
  }
  checkpoints.Finish();
  double worst_param = 0;
  const auto trained = fsdp::fsdp2::GetFullStateDict(*s.model);  // collective
  for (const auto& item : trained) {
    const at::Tensor& want = Get(ref, "final." + item.key(), ref_file);
    worst_param = std::max(worst_param, fsdp::examples::llama::RelDiff(item.value(), want));
  }
  const std::string export_dir = absl::GetFlag(FLAGS_export_dir);
  if (!export_dir.empty()) {
    fsdp::dcp::SaveHuggingFace(*s.model, export_dir, {.copy_files_from = ref_dir + "/hf_init"});
    at::NoGradGuard no_grad;
    const at::Tensor logits = s.model(tokens[0], at::Tensor());  // every rank the whole first batch
    fsdp::checkpoint::TensorDict ours;
    ours.insert("tokens", tokens[0]);
    ours.insert("logits", logits);
    if (log) {
      fsdp::checkpoint::SaveTensorDict(ours, export_dir + "_logits.pt");
      std::printf("exported to %s (Hugging Face's layout), our logits on the first batch in %s_logits.pt\n",
                  export_dir.c_str(), export_dir.c_str());
    }
  }
  const bool ok = worst <= tol && worst_param <= tol;
  if (log) {
    std::printf(
        "vs HF under PyTorch FSDP2: steps %ld-%ld, max loss / grad-norm diff %.1e, max final-parameter diff %.1e "
        "(tol %.1e, relative to max(1, |HF|))\n%s\n",
        long(first), long(steps - 1), worst, worst_param, tol, ok ? "PASS" : "FAIL");
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  at::set_num_threads(1);  // the ranks share the machine's cores
  return fsdp::comm::RunMain(Run);
}
