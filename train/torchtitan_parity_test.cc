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
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "train/torchtitan_runs.h"

namespace fsdp::train::torchtitan_runs {
namespace {

// The global batch is 8 windows of 32 tokens in every case; local batch x dp x accumulation.
// With pp 2 the 2 layers split as torchtitan splits them (the embedding and the head count as a
// layer each): 1F1B's two stages are embedding + layer 0 and layer 1 + head, Interleaved1F1B's
// and ZBVZeroBubble's four the embedding, a layer each and the head (placed 0 1 0 1 and 0 1 1 0).
constexpr Case kCases[] = {
    kOneRank,
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

class TorchtitanParity : public ::testing::TestWithParam<Case> {};

TEST_P(TorchtitanParity, LossGradNormAndLrMatchTorchtitanStepForStep) {
  const Case& c = GetParam();
  const Reference& theirs = TorchtitanRun(c);
  if (!theirs.skip_reason.empty()) GTEST_SKIP() << theirs.skip_reason;
  ASSERT_TRUE(c.n_layers == kOneRank.n_layers || c.n_layers == kOneRankSixLayers.n_layers)
      << "no one-rank torchtitan run of " << c.n_layers << " layers for the spread";
  // A float8 case's spread is against torchtitan with the same recipe. Rowwise scales are per
  // token and per weight column, so one rank computes the same float8 values as the mesh: the
  // one-rank run. Tensorwise scales each rank's activations by their own amax, so another
  // data-parallel split is another computation, not another order: the reference is then the
  // same per-rank batches under HSDP (gradients all-reduced instead of reduce-scattered).
  Case one_rank_case = c.n_layers == kOneRank.n_layers ? kOneRank : kOneRankSixLayers;
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

}  // namespace
}  // namespace fsdp::train::torchtitan_runs
