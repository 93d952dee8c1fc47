// Runs of one training case (a mesh, a pipeline schedule, a float8 recipe) by torchtitan 0.3.0's
// own components (testdata/torchtitan_reference.py, run with the peer venv's Python: its
// Llama3Model, parallelize_llama, LR schedule, loss, packing and Trainer.train_step on CPU Gloo)
// and by our Trainer on threaded ranks, from the same initial weights (torchtitan's
// init_weights, exported in Hugging Face's names) and the same windows; and the tolerances
// between them, from torchtitan's own spread. For //train:torchtitan_parity_test.
//
// Errors: a failing reference run or unreadable outputs are c10::Errors naming the case; a
// missing peer venv or torchtitan is Reference::skip_reason, for the caller to skip with.
#ifndef FSDP_TRAIN_TORCHTITAN_RUNS_H_
#define FSDP_TRAIN_TORCHTITAN_RUNS_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "train/trainer.h"

namespace fsdp::train::torchtitan_runs {

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

// torchtitan on one rank: the spread's reference of the 2-layer cases.
inline constexpr Case kOneRank = {"one_rank", 1, 1, 1, 8, "none"};

// torchtitan on one rank with the 6-layer model of the pp 4 cases: their spread's reference.
inline constexpr Case kOneRankSixLayers = {.name = "one_rank_6_layers",
                                           .world = 1,
                                           .dp_replicate = 1,
                                           .tp = 1,
                                           .local_batch_size = 8,
                                           .ac = "none",
                                           .n_layers = 6};

using NamedTensors = std::map<std::string, at::Tensor>;
// [rank][step] -> "all_gather", "reduce_scatter", "send", "recv" -> how many.
using CommCounts = std::vector<std::vector<std::map<std::string, int64_t>>>;

struct Reference {
  std::string skip_reason, dir;
  std::vector<double> losses, grad_norms, lrs;
  NamedTensors final_params;  // after the last step, in Hugging Face's names (= ours)
  CommCounts comm_counts;
};

// The reference's spec of `c` (testdata/torchtitan_reference.py reads it).
std::string SpecJson(const Case& c);

// torchtitan's run of `c`, once per case name per process (later calls return the first's).
const Reference& TorchtitanRun(const Case& c);

// The largest elementwise difference between two runs' final parameters (the same names).
double MaxAbsDiff(const NamedTensors& a, const NamedTensors& b);

// The largest |a[i] - b[i]| / |b[i]|.
double MaxRelDiff(const std::vector<double>& a, const std::vector<double>& b);

// Our trainer's arguments for `c`'s run, starting from the weights in `hf_init` (with a
// pipeline, each rank's parts load their tensors of it).
std::vector<std::string> OursArgs(const Case& c, const std::string& hf_init);

// Our trainer's steps on `c`'s mesh: LoadCheckpoint, `after_load` (every rank), then `steps`
// Step() + SaveCheckpoint(); `final_params` set: every rank's parts' full parameters after them;
// `comm_counts` set: each rank's counts per step (its world traced by comm::CommTrace). Rank 0's
// results.
std::vector<StepResult> OursRun(const Case& c, const std::vector<std::string>& args, int64_t steps = kSteps,
                                const std::function<void(Trainer&, int rank)>& after_load = nullptr,
                                NamedTensors* final_params = nullptr, CommCounts* comm_counts = nullptr);

struct Tolerances {
  double loss_spread, norm_spread, loss, norm;
  // Per step: the same from the spread of the steps up to it (see TolerancesOf).
  std::vector<double> loss_by_step, norm_by_step;
};

// The tolerances of a case whose torchtitan run is `theirs`, from its spread against
// `one_rank` (the argument is at the definition, torchtitan_runs.cc).
Tolerances TolerancesOf(const Reference& theirs, const Reference& one_rank);

}  // namespace fsdp::train::torchtitan_runs

#endif  // FSDP_TRAIN_TORCHTITAN_RUNS_H_
