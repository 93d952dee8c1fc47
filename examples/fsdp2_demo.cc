// FSDP2 showcase: a tiny decoder-only language model trained with fully_shard on 4 processes.
//   ./x run -n 4 bazel-bin/examples/fsdp2_demo        (`./x demo` builds and runs it)
// Every block, then the root, is fully_shard'ed over a Gloo world group; each rank trains on
// its quarter of the global batch with AdamW. Rank 0 prints per step the global loss, the
// step time, this rank's bytes of parameters + gradients + optimizer state, and the bytes
// FSDP moved. At the end every rank trains the same model on the whole batch without FSDP
// and checks that the loss curve and the final parameters agree: PASS, or FAIL and exit 1.
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
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "comm/comm_trace.h"
#include "comm/gloo_process_group.h"
#include "fsdp/per_param/fsdp_state.h"  // runtime introspection for the printout (CollectStates)
#include "fsdp/per_param/fully_shard.h"
#include "fsdp/per_param/state_dict.h"
#include "mesh/device_mesh.h"

namespace {

using fsdp::per_param::FullySharded;

constexpr int64_t kVocab = 64, kDim = 32, kBlocks = 3, kSeq = 16;
constexpr int64_t kGlobalBatch = 32;  // sequences per step, split evenly over the ranks
constexpr int kSteps = 30;
// FSDP averages the ranks' slice-mean gradients where the reference takes one whole-batch mean: equal up
// to float rounding. Losses agree to ~1e-7. AdamW divides each gradient element by its own
// running RMS, so an element whose gradient is nearly zero (e.g. a GELU unit that rarely fires)
// turns that rounding into visible step differences: ~1e-5 after 30 steps here (in double,
// ~1e-14). A sharding or reduction bug shows up as 1e-2 or more.
constexpr double kLossTol = 1e-4, kParamTol = 1e-4;  // relative to max(1, |reference|)

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
    scores = scores.masked_fill(at::ones({t, t}, at::kBool).triu(1), -INFINITY);  // no peeking ahead
    at::Tensor h = x + proj(at::matmul(at::softmax(scores, -1), qkv_parts[2]));
    return h + fc2(at::gelu(fc1(ln2(h))));
  }

  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
};

// FullySharded<Impl> is Impl whose forward runs FSDP's hooks once fully_shard attached them;
// without fully_shard it is the plain module (the single-rank reference below uses that).
struct DecoderImpl : torch::nn::Module {
  DecoderImpl()
      : embed(register_module("embed", torch::nn::Embedding(kVocab, kDim))),
        pos(register_parameter("pos", at::zeros({kSeq, kDim}))),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))) {
    for (int64_t i = 0; i < kBlocks; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), FullySharded<BlockImpl>()));
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
  std::vector<FullySharded<BlockImpl>> blocks;
};
using Decoder = FullySharded<DecoderImpl>;

// Same values on every rank and in the reference: one generator per parameter, never the
// global RNG (whose state depends on what ran before).
void InitDeterministic(torch::nn::Module& model) {
  at::NoGradGuard no_grad;
  uint64_t seed = 1;
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

}  // namespace

int main() {
  at::set_num_threads(1);  // the ranks share the machine's cores
  // Wrap the world group BEFORE building the mesh, so every FSDP collective goes through the
  // trace (a 1-D mesh over the whole world reuses the group it is given).
  auto world = fsdp::comm::CreateGlooProcessGroupFromEnv();
  auto trace = std::make_shared<fsdp::comm::CommTrace>(world);
  const int W = world->size(), me = world->rank();
  const bool log = me == 0;
  if (kGlobalBatch % W != 0) {
    if (log) std::printf("global batch %ld is not divisible by %d ranks\n", kGlobalBatch, W);
    return 2;
  }
  auto mesh = fsdp::mesh::DeviceMesh::Create(trace, {W});

  // Full model on every rank (same values), then shard it: blocks first, the root last, so
  // the root's group gets what no block claims (embedding = tied head, pos, final LayerNorm).
  Decoder model;
  InitDeterministic(*model);
  for (auto& block : model->blocks) fsdp::per_param::fully_shard(block.ptr(), {.mesh = mesh});
  fsdp::per_param::fully_shard(model.ptr(), {.mesh = mesh});
  // Built after fully_shard: the optimizer sees (and keeps state only for) the shards.
  const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.01);
  torch::optim::AdamW opt(model->parameters(), options);

  const int64_t local = kGlobalBatch / W;
  if (log) {
    std::printf(
        "FSDP2 demo: %ld-block decoder (vocab %ld, d %ld, tied head), %d ranks, global batch %ld x %ld tokens, AdamW\n",
        kBlocks, kVocab, kDim, W, kGlobalBatch, kSeq);
    std::printf("%4s %8s %7s %18s %15s %19s\n", "step", "loss", "ms", "P+G+O KiB/rank", "all-gather KiB",
                "reduce-scatter KiB");
  }
  std::vector<double> losses, step_ms;
  Bytes sharded;
  int64_t ag = 0, rs = 0;
  for (int step = 0; step < kSteps; ++step) {
    const at::Tensor seqs = Sequences(step, kGlobalBatch).narrow(0, me * local, local);  // my slice
    trace->clear();
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor loss = Loss(model, seqs);
    loss.backward();  // blocks re-gather their weights; gradients are reduce-scattered (averaged)
    opt.step();
    step_ms.push_back(Ms(t0));                       // step 0 includes FSDP's lazy initialization
    sharded = CountBytes(model->parameters(), opt);  // before zero_grad: gradients still there
    opt.zero_grad();
    // Sizes of the full buffers: all-gather outputs and reduce-scatter inputs.
    ag = trace->total_output_bytes("all_gather_into_tensor");
    rs = trace->total_input_bytes("reduce_scatter_tensor");
    // The global loss is the mean over ranks (equal slices); reduced outside the trace.
    at::Tensor global = loss.detach().clone();
    world->all_reduce(global, fsdp::comm::ReduceOp::Avg())->wait();
    losses.push_back(global.item<double>());
    if (log)
      std::printf("%4d %8.4f %7.1f %18.1f %15.1f %19.1f\n", step, losses.back(), step_ms.back(), Kib(sharded.total()),
                  Kib(ag), Kib(rs));
  }

  // Gather every trained parameter (collective: all ranks, same order) keyed by its name.
  std::map<std::string, at::Tensor> trained;
  for (const auto& item : fsdp::per_param::GetFullStateDict(*model)) trained[item.key()] = item.value();

  // The same training on one rank without FSDP: same init, the whole global batch per step.
  Decoder ref;
  InitDeterministic(*ref);
  torch::optim::AdamW ref_opt(ref->parameters(), options);
  double loss_diff = 0, param_diff = 0;
  Bytes full;
  for (int step = 0; step < kSteps; ++step) {
    at::Tensor loss = Loss(ref, Sequences(step, kGlobalBatch));
    loss.backward();
    ref_opt.step();
    full = CountBytes(ref->parameters(), ref_opt);
    ref_opt.zero_grad();
    const double expected = loss.item<double>();
    loss_diff = std::max(loss_diff, std::abs(losses[step] - expected) / std::max(1.0, std::abs(expected)));
  }
  bool ok = loss_diff <= kLossTol && trained.size() == ref->named_parameters().size();
  for (const auto& item : ref->named_parameters()) {
    auto it = trained.find(item.key());
    if (it == trained.end()) {
      if (log) std::printf("missing from FSDP: %s\n", item.key().c_str());
      ok = false;
      continue;
    }
    const double scale = std::max(1.0, item.value().abs().max().item<double>());
    param_diff = std::max(param_diff, (it->second - item.value()).abs().max().item<double>() / scale);
  }
  ok = ok && param_diff <= kParamTol;
  // Every rank checked its own copy; one FAIL fails all.
  at::Tensor failed = at::tensor({ok ? 0.0f : 1.0f});
  world->all_reduce(failed, fsdp::comm::ReduceOp::Max())->wait();
  ok = failed.item<float>() == 0.0f;

  if (log) {
    std::printf("\nloss: %.4f -> %.4f over %d steps\n", losses.front(), losses.back(), kSteps);
    // What each fully_shard call manages (names are known after the first forward's lazy
    // init): the tied head adds no tensor, the root's embed.weight serves both uses.
    for (auto* state : fsdp::per_param::CollectStates(*model)) {
      const auto& group = state->param_group();
      std::string names;
      for (const auto& p : group->fsdp_params()) names += " " + p->fqn();
      std::printf("fully_shard(%s): %zu tensors%s\n",
                  group->module_fqn().empty() ? "root" : group->module_fqn().c_str(), group->fsdp_params().size(),
                  state->is_root().value_or(false) ? (":" + names).c_str() : "");
    }
    std::sort(step_ms.begin() + 1, step_ms.end());
    std::printf(
        "median step %.1f ms; per step all-gather %.1f KiB (root once, kept through backward; each block\n"
        "  twice: forward, then again for backward), reduce-scatter %.1f KiB (every gradient once)\n",
        step_ms[kSteps / 2], Kib(ag), Kib(rs));
    std::printf(
        "KiB per rank, params + grads + AdamW state: FSDP %.1f + %.1f + %.1f = %.1f, single rank %.1f + %.1f + %.1f = "
        "%.1f (%.2fx)\n",
        Kib(sharded.params), Kib(sharded.grads), Kib(sharded.optim), Kib(sharded.total()), Kib(full.params),
        Kib(full.grads), Kib(full.optim), Kib(full.total()), double(full.total()) / double(sharded.total()));
    std::printf(
        "vs single-rank reference: max loss diff %.1e (tol %.0e), max param diff %.1e (tol %.0e), %zu tensors\n",
        loss_diff, kLossTol, param_diff, kParamTol, trained.size());
    std::printf("%s\n", ok ? "PASS" : "FAIL");
  }
  return ok ? 0 : 1;
}
