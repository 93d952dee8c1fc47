// The trainer against torchtitan 0.3.0's own components (testdata/torchtitan_reference.py, run
// with the peer venv's Python): torchtitan's Llama3Model (the debugmodel flavor's builders,
// shrunk through its config fields), parallelize_llama, LR schedule, loss, packing and
// Trainer.train_step on CPU Gloo, against our Trainer on threaded ranks with the same config,
// the same initial weights (torchtitan's init_weights, exported in Hugging Face's names, which
// both load) and the same windows: 20 steps of loss, grad norm and learning rate, and the final
// parameters, at FSDP
// (dp_shard 4), HSDP (2 x 2), FSDP + TP (2 x 2), gradient accumulation 2, full and selective
// (per-operator, torchtitan's SelectiveAC) activation checkpointing, and pipeline parallelism
// against torchtitan's own (its pipeline_llm over PyTorch's torch.distributed.pipelining
// schedules): pp 2 x dp 2 with 1F1B, Interleaved1F1B and ZBVZeroBubble, pp 2 x TP 2 with 1F1B.
// Skipped, with the reason, without the peer venv or its torchtitan.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_dict_file.h"
#include "comm/comm_trace.h"
#include "comm/process_group.h"
#include "fsdp/fsdp2/state_dict.h"
#include "optim_state/fsdp2_optim_state.h"
#include "testing/multi_rank.h"
#include "testing/peer_python.h"
#include "train/config.h"
#include "train/trainer.h"

namespace fsdp::train {
namespace {

constexpr int64_t kSteps = 20;

struct Case {
  const char* name;
  int world;
  int64_t dp_replicate, tp, local_batch_size;
  const char* ac;
  // torchtitan's default fused qkv projection, and its CheckpointManager saving step kSaveStep.
  bool torchtitan_checkpoint = false;
  // parallelism.pipeline_parallel_{degree,schedule,microbatch_size}.
  int64_t pp = 1;
  const char* pp_schedule = "1F1B";
  int64_t pp_microbatch_size = 1;
  int64_t n_layers = 2;  // model.n_layers (more for pp 4's interleaved stages)
  // model.converters = ["float8"] with this float8.recipe_name (torchtitan's Float8Linear with
  // torchao's recipe) and torchtitan's configs' filter_fqns = ["output"], which in 0.3.0 matches
  // nothing on either side (the head is lm_head): every Linear runs in float8, so float8's
  // effect on the loss stands well above reduction-order noise (without it every float8 case
  // fails).
  const char* float8 = nullptr;
  // Ours all-gathers the weights in float8 with precomputed scales; torchtitan's Gloo run
  // cannot (no float8 all-gather on Gloo) and casts after its float32 all-gather: the same
  // bits (float8/fsdp_float8_test.cc).
  bool float8_all_gather = false;
};

constexpr int64_t kSaveStep = 10;

// torchtitan on one rank with the 6-layer model of the pp 4 cases: their spread's reference.
constexpr Case kOneRankSixLayers = {.name = "one_rank_6_layers",
                                    .world = 1,
                                    .dp_replicate = 1,
                                    .tp = 1,
                                    .local_batch_size = 8,
                                    .ac = "none",
                                    .n_layers = 6};

// The global batch is 8 windows of 32 tokens in every case; local batch x dp x accumulation.
// With pp 2 the 2 layers split as torchtitan splits them (the embedding and the head count as a
// layer each): 1F1B's two stages are embedding + layer 0 and layer 1 + head, Interleaved1F1B's
// and ZBVZeroBubble's four the embedding, a layer each and the head (placed 0 1 0 1 and 0 1 1 0).
constexpr Case kCases[] = {
    {"one_rank", 1, 1, 1, 8, "none"},
    {"fsdp4", 4, 1, 1, 2, "none"},
    {"hsdp2x2", 4, 2, 1, 2, "none"},
    {"fsdp2_tp2", 4, 1, 2, 4, "none"},
    {"fsdp4_accum2", 4, 1, 1, 1, "none"},
    {"fsdp2_full_ac", 2, 1, 1, 4, "full"},
    {"fsdp2_selective_ac", 2, 1, 1, 4, "selective"},
    {"fsdp2_tp2_selective_ac", 4, 1, 2, 4, "selective"},
    {.name = "pp2_dp2_1f1b", .world = 4, .dp_replicate = 1, .tp = 1, .local_batch_size = 4, .ac = "none", .pp = 2},
    {.name = "pp2_dp2_interleaved1f1b",
     .world = 4,
     .dp_replicate = 1,
     .tp = 1,
     .local_batch_size = 4,
     .ac = "none",
     .pp = 2,
     .pp_schedule = "Interleaved1F1B"},
    {.name = "pp2_dp2_zbv",
     .world = 4,
     .dp_replicate = 1,
     .tp = 1,
     .local_batch_size = 4,
     .ac = "none",
     .pp = 2,
     .pp_schedule = "ZBVZeroBubble"},
    {.name = "pp2_tp2_1f1b",
     .world = 4,
     .dp_replicate = 1,
     .tp = 2,
     .local_batch_size = 8,
     .ac = "none",
     .pp = 2,
     .pp_microbatch_size = 2},
    // pp 4 with the looped and the V schedules: 8 stages over 6 layers, the embedding and the
    // head alone on the first and last.
    {.name = "pp4_interleaved1f1b",
     .world = 4,
     .dp_replicate = 1,
     .tp = 1,
     .local_batch_size = 8,
     .ac = "none",
     .pp = 4,
     .pp_schedule = "Interleaved1F1B",
     .pp_microbatch_size = 2,
     .n_layers = 6},
    {.name = "pp4_zbv",
     .world = 4,
     .dp_replicate = 1,
     .tp = 1,
     .local_batch_size = 8,
     .ac = "none",
     .pp = 4,
     .pp_schedule = "ZBVZeroBubble",
     .pp_microbatch_size = 2,
     .n_layers = 6},
    // Float8: W = 2 (FSDP) and 2 x 2 (dp x tp), each of torchao's recipes.
    {.name = "fsdp2_float8_rowwise",
     .world = 2,
     .dp_replicate = 1,
     .tp = 1,
     .local_batch_size = 4,
     .ac = "none",
     .float8 = "rowwise"},
    {.name = "fsdp2_float8_tensorwise_all_gather",
     .world = 2,
     .dp_replicate = 1,
     .tp = 1,
     .local_batch_size = 4,
     .ac = "none",
     .float8 = "tensorwise",
     .float8_all_gather = true},
    {.name = "fsdp2_float8_rowwise_with_gw_hp",
     .world = 2,
     .dp_replicate = 1,
     .tp = 1,
     .local_batch_size = 4,
     .ac = "none",
     .float8 = "rowwise_with_gw_hp"},
    {.name = "fsdp2_tp2_float8_rowwise",
     .world = 4,
     .dp_replicate = 1,
     .tp = 2,
     .local_batch_size = 4,
     .ac = "none",
     .float8 = "rowwise"},
    {.name = "fsdp2_tp2_float8_tensorwise",
     .world = 4,
     .dp_replicate = 1,
     .tp = 2,
     .local_batch_size = 4,
     .ac = "none",
     .float8 = "tensorwise"},
    // 3-D: pp 2 x dp 2 x tp 2 on 8 processes.
    {.name = "pp2_dp2_tp2_1f1b",
     .world = 8,
     .dp_replicate = 1,
     .tp = 2,
     .local_batch_size = 4,
     .ac = "none",
     .pp = 2,
     .pp_microbatch_size = 2},
};

std::string SpecJson(const Case& c) {
  return absl::StrCat(
      R"({"world": )", c.world, R"(, "dp_replicate": )", c.dp_replicate, R"(, "tp": )", c.tp,
      R"(, "sp": true, "steps": )", kSteps, R"(, "seq_len": 32, "local_batch_size": )", c.local_batch_size,
      R"(, "global_batch_size": 8, "dim": 64, "n_layers": )" + std::to_string(c.n_layers) + R"(, "n_heads": 4,)",
      R"( "n_kv_heads": 2, "vocab_size": 2048, "lr": 0.0008, "warmup_steps": 3, "decay_ratio": 0.5,)",
      R"( "decay_type": "cosine", "min_lr_factor": 0.1, "max_norm": 1.0, "ac": ")", c.ac,
      R"(", "dataset": "train/testdata/corpus/train", "seed": 5)",
      c.torchtitan_checkpoint ? absl::StrCat(R"(, "fuse_qkv": true, "checkpoint_step": )", kSaveStep) : "",
      c.pp > 1 ? absl::StrCat(R"(, "pp": )", c.pp, R"(, "pp_schedule": ")", c.pp_schedule,
                              R"(", "pp_microbatch_size": )", c.pp_microbatch_size)
               : "",
      c.float8 ? absl::StrCat(R"(, "float8": {"recipe": ")", c.float8, R"(", "filter_fqns": ["output"]})") : "", "}");
}

using NamedTensors = std::map<std::string, at::Tensor>;
// [rank][step] -> "all_gather", "reduce_scatter", "send", "recv" -> how many.
using CommCounts = std::vector<std::vector<std::map<std::string, int64_t>>>;

struct Reference {
  std::string skip_reason, dir;
  std::vector<double> losses, grad_norms, lrs;
  NamedTensors final_params;  // after the last step, in Hugging Face's names (= ours)
  CommCounts comm_counts;
};

// OUT_DIR/comm_counts/rank<r>.json: [{"all_gather": n, ...} per step], parsed by hand (flat
// objects of non-negative integers, as json.dump writes them).
CommCounts LoadCommCounts(const std::string& dir, int world) {
  CommCounts out(world);
  for (int r = 0; r < world; ++r) {
    const std::string path = absl::StrCat(dir, "/comm_counts/rank", r, ".json");
    std::ifstream in(path);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    TORCH_CHECK(!text.empty(), "cannot read ", path);
    for (size_t at = text.find('{'); at != std::string::npos; at = text.find('{', at)) {
      const size_t end = text.find('}', at);
      TORCH_CHECK(end != std::string::npos, path, ": an unterminated object");
      std::map<std::string, int64_t>& step = out[r].emplace_back();
      for (size_t q = text.find('"', at); q < end; q = text.find('"', q)) {
        const size_t close = text.find('"', q + 1);
        const std::string key = text.substr(q + 1, close - q - 1);
        step[key] = std::strtoll(text.c_str() + text.find(':', close) + 1, nullptr, 10);
        q = close + 1;
      }
      at = end;
    }
  }
  return out;
}

// Counts of what CommCounter counts on the reference's side, from our records.
std::map<std::string, int64_t> CountOf(const std::vector<comm::CollectiveRecord>& records) {
  std::map<std::string, int64_t> out = {{"all_gather", 0}, {"reduce_scatter", 0}, {"send", 0}, {"recv", 0}};
  for (const comm::CollectiveRecord& r : records) {
    if (r.op == "all_gather_into_tensor") ++out["all_gather"];
    if (r.op == "reduce_scatter_tensor") ++out["reduce_scatter"];
    if (r.op == "send") ++out["send"];
    if (r.op == "recv") ++out["recv"];
  }
  return out;
}

// Every rank's `final/rank<r>.safetensors` of a torchtitan run merged (pipeline ranks hold
// different parts; data-parallel replicas the same values).
NamedTensors LoadFinalParams(const std::string& dir, int world) {
  NamedTensors out;
  for (int r = 0; r < world; ++r) {
    const checkpoint::TensorDict part =
        checkpoint::LoadSafetensors(absl::StrCat(dir, "/final/rank", r, ".safetensors"));
    for (const auto& item : part) {
      auto [it, inserted] = out.emplace(item.key(), item.value());
      TORCH_CHECK(inserted || at::equal(it->second, item.value()), dir, ": ranks disagree on the final ", item.key());
    }
  }
  return out;
}

// The largest elementwise difference between two runs' final parameters (the same names).
double MaxAbsDiff(const NamedTensors& a, const NamedTensors& b) {
  TORCH_CHECK(a.size() == b.size(), "final parameters: ", a.size(), " vs ", b.size(), " tensors");
  double d = 0;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    TORCH_CHECK(it != b.end(), "final parameters: ", name, " only on one side");
    d = std::max(d, (t.to(at::kDouble) - it->second.to(at::kDouble)).abs().max().item<double>());
  }
  return d;
}

// torchtitan's run of `c`, once per case per process.
const Reference& TorchtitanRun(const Case& c) {
  static auto* cache = new std::map<std::string, Reference>;
  if (auto it = cache->find(c.name); it != cache->end()) return it->second;
  Reference& r = (*cache)[c.name];
  const std::string python = fsdp::testing::PeerPython(&r.skip_reason);
  if (python.empty()) return r;
  std::string output;
  if (fsdp::testing::RunCommand(python + " -c 'import torchtitan'", &output) != 0) {
    r.skip_reason = absl::StrCat("torchtitan is not importable by ", python, " (./x setup installs it): ", output);
    return r;
  }
  const char* tmp = std::getenv("TEST_TMPDIR");
  r.dir = absl::StrCat(tmp ? tmp : "/tmp", "/torchtitan_", getpid(), "_", c.name);
  const std::string spec = r.dir + ".json";
  std::ofstream(spec) << SpecJson(c);
  output.clear();
  const int status = fsdp::testing::RunCommand(
      absl::StrCat(python, " train/testdata/torchtitan_reference.py ", spec, " ", r.dir), &output);
  TORCH_CHECK(status == 0, "torchtitan_reference.py ", c.name, " failed (status ", status, "):\n", output);
  const checkpoint::TensorDict ref = checkpoint::LoadTensorDict(r.dir + "/reference.pt");
  const auto values = [&](const char* key) {
    const at::Tensor* t = ref.find(key);
    TORCH_CHECK(t != nullptr && t->numel() == kSteps, r.dir, "/reference.pt: no ", kSteps, " values of ", key);
    const at::Tensor d = t->to(at::kDouble).contiguous();
    return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + kSteps);
  };
  r.losses = values("losses");
  r.grad_norms = values("grad_norms");
  r.lrs = values("lrs");
  r.final_params = LoadFinalParams(r.dir, c.world);
  r.comm_counts = LoadCommCounts(r.dir, c.world);
  return r;
}

// Our trainer's arguments for `c`'s run, starting from the weights in `hf_init` (with a
// pipeline, each rank's parts load their tensors of it).
std::vector<std::string> OursArgs(const Case& c, const std::string& hf_init) {
  std::vector<std::string> args = {"--model.dim=64",
                                   "--model.n_layers=" + std::to_string(c.n_layers),
                                   "--model.n_heads=4",
                                   "--model.n_kv_heads=2",
                                   "--training.seq_len=32",
                                   absl::StrCat("--training.local_batch_size=", c.local_batch_size),
                                   "--training.global_batch_size=8",
                                   absl::StrCat("--training.steps=", kSteps),
                                   "--training.mixed_precision_param=float32",
                                   absl::StrCat("--parallelism.data_parallel_replicate_degree=", c.dp_replicate),
                                   absl::StrCat("--parallelism.tensor_parallel_degree=", c.tp),
                                   absl::StrCat("--activation_checkpoint.mode=", c.ac),
                                   "--lr_scheduler.warmup_steps=3",
                                   "--lr_scheduler.decay_ratio=0.5",
                                   "--lr_scheduler.decay_type=cosine",
                                   "--lr_scheduler.min_lr_factor=0.1",
                                   "--dataloader.dataset_path=train/testdata/corpus/train"};
  if (c.float8) {
    args.insert(args.end(), {"--model.converters=float8", absl::StrCat("--float8.recipe_name=", c.float8),
                             "--float8.filter_fqns=output"});
  }
  if (c.float8_all_gather) {
    args.insert(args.end(), {"--float8.enable_fsdp_float8_all_gather=true",
                             "--float8.precompute_float8_dynamic_scale_for_fsdp=true"});
  }
  if (c.pp > 1) {
    args.insert(args.end(), {absl::StrCat("--parallelism.pipeline_parallel_degree=", c.pp),
                             absl::StrCat("--parallelism.pipeline_parallel_schedule=", c.pp_schedule),
                             absl::StrCat("--parallelism.pipeline_parallel_microbatch_size=", c.pp_microbatch_size)});
  }
  args.insert(args.end(), {"--checkpoint.initial_load_path=" + hf_init, "--checkpoint.initial_load_in_hf=true"});
  return args;
}

// Our trainer's steps on `c`'s mesh: LoadCheckpoint, `after_load` (every rank), then `steps`
// Step() + SaveCheckpoint(); `final_params` set: every rank's parts' full parameters after them;
// `comm_counts` set: each rank's counts per step (its world traced by comm::CommTrace).
std::vector<StepResult> OursRun(const Case& c, const std::vector<std::string>& args, int64_t steps = kSteps,
                                const std::function<void(Trainer&, int rank)>& after_load = nullptr,
                                NamedTensors* final_params = nullptr, CommCounts* comm_counts = nullptr) {
  std::mutex mu;
  if (comm_counts != nullptr) comm_counts->assign(c.world, {});
  const JobConfig config = ParseConfig("", "test", ParseCommandLine(args).overrides);
  std::vector<StepResult> out;
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, c.world, [&](const comm::ProcessGroupPtr& pg) {
    const auto trace = comm_counts != nullptr ? std::make_shared<comm::CommTrace>(pg) : nullptr;
    Trainer trainer(config, trace != nullptr ? trace : pg);
    trainer.LoadCheckpoint();
    if (after_load) after_load(trainer, pg->rank());
    std::vector<StepResult> mine;
    for (int64_t s = 0; s < steps; ++s) {
      // all_records() keeps each group's records together: a step's are the counts' growth.
      const std::map<std::string, int64_t> before =
          trace != nullptr ? CountOf(trace->all_records()) : std::map<std::string, int64_t>{};
      mine.push_back(trainer.Step());
      if (trace != nullptr) {
        std::map<std::string, int64_t> counts = CountOf(trace->all_records());
        for (auto& [kind, n] : counts) n -= before.at(kind);
        (*comm_counts)[pg->rank()].push_back(counts);
      }
      trainer.SaveCheckpoint();
    }
    if (pg->rank() == 0) out = mine;
    if (final_params == nullptr) return;
    for (models::llama::LlamaForCausalLM part : trainer.model_parts()) {
      const fsdp2::FullStateDict full = fsdp2::GetFullStateDict(*part);  // collective over the part's mesh
      const std::lock_guard<std::mutex> lock(mu);
      for (const auto& item : full) (*final_params)[item.key()] = item.value();
    }
  });
  return out;
}

double MaxRelDiff(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(a[i] - b[i]) / std::abs(b[i]));
  return d;
}

class TorchtitanParity : public ::testing::TestWithParam<Case> {};

struct Tolerances {
  double loss_spread, norm_spread, loss, norm;
  // Per step: the same from the spread of the steps up to it (see TolerancesOf).
  std::vector<double> loss_by_step, norm_by_step;
};

// Tolerances, from torchtitan's own runs: torchtitan on one rank and torchtitan on the case's
// mesh are two legitimate float32 evaluations of the same training, and their spread S over
// the 20 steps is what reduction order alone does to this training on this machine's kernels
// (Adam carries each step's rounding into the next). Ours is a third such evaluation, so it
// must lie within a few spreads of torchtitan's run: 4 S, plus 64 float32 ulps for the loss
// (a spread that happens to be tiny) and sqrt(n) ulps for the gradient norm (torch's float32
// norm kernels' own rounding over the largest gradient, lm_head's n = 2048 x 64 elements, which
// differs with the sharding). A wrong convention (rope layout, loss scale, schedule, packing)
// moves the loss by 1e-3 or more in the first steps. A pipeline is one more such order (the
// microbatches' losses and gradients summed on each stage, the norm over the stages): the
// spread of torchtitan's own pipelined run covers it, so the same argument holds there.
// Rounding differences grow as training carries them from step to step, so step s is held to
// the spread of steps 1..s (a running maximum): early steps, where a wrong computation (a float8
// cast left out) shows before the runs drift apart, get the tight bound.
Tolerances TolerancesOf(const Reference& theirs, const Reference& one_rank) {
  constexpr double kEps = std::numeric_limits<float>::epsilon();
  const double loss_floor = 64 * kEps, norm_floor = std::sqrt(2048.0 * 64.0) * kEps;
  Tolerances t{MaxRelDiff(theirs.losses, one_rank.losses), MaxRelDiff(theirs.grad_norms, one_rank.grad_norms)};
  t.loss = 4 * t.loss_spread + loss_floor;
  t.norm = 4 * t.norm_spread + norm_floor;
  double loss_max = 0, norm_max = 0;
  for (size_t s = 0; s < theirs.losses.size(); ++s) {
    loss_max = std::max(loss_max, std::abs(theirs.losses[s] - one_rank.losses[s]) / std::abs(one_rank.losses[s]));
    norm_max =
        std::max(norm_max, std::abs(theirs.grad_norms[s] - one_rank.grad_norms[s]) / std::abs(one_rank.grad_norms[s]));
    t.loss_by_step.push_back(4 * loss_max + loss_floor);
    t.norm_by_step.push_back(4 * norm_max + norm_floor);
  }
  return t;
}

TEST_P(TorchtitanParity, LossGradNormAndLrMatchTorchtitanStepForStep) {
  const Case& c = GetParam();
  const Reference& theirs = TorchtitanRun(c);
  if (!theirs.skip_reason.empty()) GTEST_SKIP() << theirs.skip_reason;
  ASSERT_TRUE(c.n_layers == kCases[0].n_layers || c.n_layers == kOneRankSixLayers.n_layers)
      << "no one-rank torchtitan run of " << c.n_layers << " layers for the spread";
  // A float8 case's spread is against torchtitan with the same recipe. Rowwise scales are per
  // token and per weight column, so one rank computes the same float8 values as the mesh: the
  // one-rank run. Tensorwise scales each rank's activations by their own amax, so another
  // data-parallel split is another computation, not another order: the reference is then the
  // same per-rank batches under HSDP (gradients all-reduced instead of reduce-scattered).
  Case one_rank_case = c.n_layers == kCases[0].n_layers ? kCases[0] : kOneRankSixLayers;
  std::string spread_name;
  if (c.float8 != nullptr) {
    const bool tensorwise = std::string(c.float8) == "tensorwise";
    spread_name = absl::StrCat(tensorwise ? c.name : "one_rank", "_float8_", tensorwise ? "hsdp" : c.float8);
    if (tensorwise) {
      one_rank_case = c;
      one_rank_case.dp_replicate = c.world / c.tp;
      one_rank_case.float8_all_gather = false;
    }
    one_rank_case.name = spread_name.c_str();
    one_rank_case.float8 = c.float8;
  }
  const Reference& one_rank = TorchtitanRun(one_rank_case);
  NamedTensors final_params;
  CommCounts comm_counts;
  // Without TP: PyTorch's TP collectives go through DTensor's functional collectives, which
  // CommCounter does not see.
  const bool count = c.tp == 1;
  const std::vector<StepResult> ours =
      OursRun(c, OursArgs(c, theirs.dir + "/hf_init"), kSteps, nullptr, &final_params, count ? &comm_counts : nullptr);
  ASSERT_EQ(ours.size(), static_cast<size_t>(kSteps));
  std::vector<double> losses, norms;
  for (const StepResult& r : ours) {
    losses.push_back(r.loss);
    norms.push_back(r.grad_norm);
  }
  const Tolerances tol = TolerancesOf(theirs, one_rank);
  const double loss_tolerance = tol.loss, norm_tolerance = tol.norm;
  const double loss_spread = tol.loss_spread, norm_spread = tol.norm_spread;
  for (int64_t s = 0; s < kSteps; ++s) {
    SCOPED_TRACE(absl::StrCat("step ", s + 1));
    // The schedule is exact: the same doubles from the same formula.
    EXPECT_NEAR(ours[s].lr, theirs.lrs[s], 1e-15);
    EXPECT_LE(std::abs(losses[s] - theirs.losses[s]), tol.loss_by_step[s] * std::abs(theirs.losses[s]))
        << "ours " << losses[s] << ", torchtitan " << theirs.losses[s];
    EXPECT_LE(std::abs(norms[s] - theirs.grad_norms[s]), tol.norm_by_step[s] * std::abs(theirs.grad_norms[s]))
        << "ours " << norms[s] << ", torchtitan " << theirs.grad_norms[s];
  }
  // The final parameters, by the same argument: within 4 times the largest elementwise
  // difference between torchtitan's two runs (Adam turns a rounding difference in a near-zero
  // gradient into up to a learning rate per step), plus 64 float32 ulps of the largest weight
  // (the one-rank case's spread is 0). A wrong update moves an element by about a learning
  // rate (8e-4) per step, some 25 times that floor.
  double largest = 0;
  for (const auto& [name, t] : theirs.final_params) largest = std::max(largest, t.abs().max().item<double>());
  const double param_spread = MaxAbsDiff(theirs.final_params, one_rank.final_params);
  const double param_tolerance = 4 * param_spread + 64 * std::numeric_limits<float>::epsilon() * largest;
  ASSERT_EQ(final_params.size(), theirs.final_params.size());
  const double param_diff = MaxAbsDiff(final_params, theirs.final_params);
  EXPECT_LE(param_diff, param_tolerance);
  // FSDP's all-gathers and reduce-scatters and the pipeline's sends and receives, per rank and
  // step, as many as torchtitan's run issues. From step 2: a pipeline's first step also carries
  // each side's shape inference (ours sends a length and the metadata per stage boundary;
  // PyTorch's sends pickled metadata and runs each stage's forward once more).
  // Without a pipeline the trainer's non-finite gradient sentinel (no PyTorch counterpart)
  // all-gathers its flags once per backward: once per accumulated micro-batch.
  const int64_t sentinel = c.pp > 1 ? 0 : 8 / (c.local_batch_size * (c.world / c.tp));
  for (int r = 0; count && r < c.world; ++r) {
    ASSERT_EQ(comm_counts[r].size(), theirs.comm_counts[r].size()) << "rank " << r;
    for (size_t s = 1; s < comm_counts[r].size(); ++s) {
      std::map<std::string, int64_t> fsdp_and_p2p = comm_counts[r][s];
      fsdp_and_p2p["all_gather"] -= sentinel;
      EXPECT_EQ(fsdp_and_p2p, theirs.comm_counts[r][s]) << "rank " << r << " step " << s + 1;
    }
  }
  std::printf(
      "%s: max rel diff loss %.3g (tol %.3g), grad norm %.3g (tol %.3g); torchtitan's spread %.3g / %.3g; final "
      "parameters max abs diff %.3g (tol %.3g, spread %.3g)\n",
      c.name, MaxRelDiff(losses, theirs.losses), loss_tolerance, MaxRelDiff(norms, theirs.grad_norms), norm_tolerance,
      loss_spread, norm_spread, param_diff, param_tolerance, param_spread);
  EXPECT_LT(theirs.losses.back(), theirs.losses.front());  // it learns
}

INSTANTIATE_TEST_SUITE_P(Meshes, TorchtitanParity, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// torchtitan's checkpoints and ours, both ways (train/torchtitan_checkpoint.h). torchtitan's run
// at FSDP 4 with its default fused qkv saves step 10 with its CheckpointManager; our trainer at
// FSDP 2 x TP 2 starts from that folder (initial_load_path, initial_load_model_only = false:
// model, optimizer, schedule, step; the data position from the step). The loaded weights and
// Adam moments equal, bitwise, torchtitan's own state mapped by its own code (the reference's
// state_step_10: the losses alone would not see q/k rows in the wrong order, since attention
// logits are tiny at this scale), and steps 11-20 match torchtitan's within the tolerance of
// the test above, the learning rate exactly. Our own
// step-10 checkpoint, loaded by torchtitan_reference.py --load-ours with dcp.load into an
// unsharded torchtitan Llama3Model, gives the loss of our step 11 (one forward in another
// reduction order: within the same tolerance).
TEST(TorchtitanCheckpoint, TorchtitansLoadsIntoOursAndOursIntoTorchtitans) {
  constexpr Case kSaver = {"fsdp4_fused_qkv_checkpoint", 4, 1, 1, 2, "none", /*torchtitan_checkpoint=*/true};
  constexpr Case kLoader = {"fsdp2_tp2", 4, 1, 2, 4, "none"};
  const Reference& theirs = TorchtitanRun(kSaver);
  if (!theirs.skip_reason.empty()) GTEST_SKIP() << theirs.skip_reason;
  const Tolerances tol = TolerancesOf(theirs, TorchtitanRun(kCases[0]));

  std::vector<std::string> args = OursArgs(kLoader, theirs.dir + "/hf_init");
  args.push_back(absl::StrCat("--checkpoint.initial_load_path=", theirs.dir, "/checkpoint/step-", kSaveStep));
  args.push_back("--checkpoint.initial_load_in_hf=false");
  args.push_back("--checkpoint.initial_load_model_only=false");
  // The loaded state is torchtitan's, bitwise, as its own hook and adapter map it to our names and rows.
  const std::string state = absl::StrCat(theirs.dir, "/state_step_", kSaveStep, "/");
  const auto expect_loaded = [&](Trainer& trainer, int rank) {
    const fsdp2::FullStateDict model = fsdp2::GetFullStateDict(*trainer.model());
    const optim_state::OptimStateDict optim = optim_state::GetFullOptimStateDict(*trainer.model(), trainer.optimizer());
    if (rank != 0) return;
    size_t compared = 0;
    for (const auto& [file, what] : {std::pair{"model", ""}, {"exp_avg", "exp_avg"}, {"exp_avg_sq", "exp_avg_sq"}}) {
      const checkpoint::TensorDict want = checkpoint::LoadSafetensors(state + file + ".safetensors");
      for (const auto& item : want) {
        const at::Tensor got =
            *what == '\0' ? *model.find(item.key()) : std::get<at::Tensor>(optim.state.at(item.key()).at(what));
        EXPECT_TRUE(at::equal(got, item.value())) << file << " " << item.key();
        ++compared;
      }
    }
    EXPECT_EQ(compared, 3 * model.size());
    EXPECT_EQ(std::get<int64_t>(optim.state.at("lm_head.weight").at("step")), kSaveStep);
    EXPECT_EQ(trainer.step(), kSaveStep);
  };
  const std::vector<StepResult> resumed = OursRun(kLoader, args, kSteps - kSaveStep, expect_loaded);
  ASSERT_EQ(resumed.size(), static_cast<size_t>(kSteps - kSaveStep));
  for (size_t i = 0; i < resumed.size(); ++i) {
    const int64_t s = kSaveStep + static_cast<int64_t>(i);
    SCOPED_TRACE(absl::StrCat("step ", s + 1));
    EXPECT_EQ(resumed[i].step, s + 1);
    EXPECT_NEAR(resumed[i].lr, theirs.lrs[s], 1e-15);
    EXPECT_LE(std::abs(resumed[i].loss - theirs.losses[s]), tol.loss * std::abs(theirs.losses[s]))
        << "ours " << resumed[i].loss << ", torchtitan " << theirs.losses[s];
    EXPECT_LE(std::abs(resumed[i].grad_norm - theirs.grad_norms[s]), tol.norm * std::abs(theirs.grad_norms[s]))
        << "ours " << resumed[i].grad_norm << ", torchtitan " << theirs.grad_norms[s];
  }

  const std::string ours_dir = theirs.dir + "_ours";
  args = OursArgs(kLoader, theirs.dir + "/hf_init");
  args.insert(args.end(), {"--checkpoint.enable=true", "--dump_folder=" + ours_dir,
                           absl::StrCat("--checkpoint.interval=", kSaveStep)});
  const std::vector<StepResult> ours = OursRun(kLoader, args, kSaveStep + 1);
  const std::string spec = ours_dir + ".json", out = ours_dir + "/loaded.pt";
  std::ofstream(spec) << SpecJson(kSaver);
  std::string output, why_not;
  const int status = fsdp::testing::RunCommand(
      absl::StrCat(fsdp::testing::PeerPython(&why_not), " train/testdata/torchtitan_reference.py --load-ours ", spec,
                   " ", ours_dir, "/checkpoint/step-", kSaveStep, " ", out),
      &output);
  ASSERT_EQ(status, 0) << output;
  const checkpoint::TensorDict loaded = checkpoint::LoadTensorDict(out);
  const at::Tensor* loss = loaded.find("loss");
  ASSERT_NE(loss, nullptr);
  const double python = loss->item<double>();
  EXPECT_LE(std::abs(ours[kSaveStep].loss - python), tol.loss * std::abs(python))
      << "our step " << kSaveStep + 1 << " " << ours[kSaveStep].loss << ", torchtitan's model from our checkpoint "
      << python;
  std::printf("torchtitan -> ours: steps %ld-%ld within tolerance %.3g; ours -> torchtitan: loss %.9g vs ours %.9g\n",
              static_cast<long>(kSaveStep + 1), static_cast<long>(kSteps), tol.loss, python, ours[kSaveStep].loss);
}

}  // namespace
}  // namespace fsdp::train
