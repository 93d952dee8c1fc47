// See torchtitan_runs.h.
#include "train/torchtitan_runs.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_dict_file.h"
#include "comm/comm_trace.h"
#include "comm/process_group.h"
#include "fsdp/fsdp2/state_dict.h"
#include "testing/multi_rank.h"
#include "testing/peer_python.h"
#include "train/config.h"

namespace fsdp::train::torchtitan_runs {
namespace {

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

}  // namespace

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

std::vector<StepResult> OursRun(const Case& c, const std::vector<std::string>& args, int64_t steps,
                                const std::function<void(Trainer&, int rank)>& after_load, NamedTensors* final_params,
                                CommCounts* comm_counts) {
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

}  // namespace fsdp::train::torchtitan_runs
