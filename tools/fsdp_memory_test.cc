// fsdp_plan --memory: the model's terms against sums worked out by hand from its definition
// (tools/fsdp_memory.h), for the two bench/e2e models; how close it comes to measured peaks
// is in the README (bench/e2e vs `fsdp_plan --memory`).
#include "tools/fsdp_memory.h"

#include <gtest/gtest.h>

#include <string>

#include "tools/fsdp_plan_lib.h"

namespace fsdp_plan {
namespace {

Plan PlanFor(const std::string& shapes, const std::string& world, const std::string& style = "fsdp2") {
  RawFlags flags;
  flags.shapes = shapes;
  flags.world = world;
  flags.style = style;
  flags.align = false;
  PlanOptions options;
  EXPECT_EQ(ParseOptions(flags, &options), "");
  return MakePlan(options);
}

MemoryOptions Memory(int64_t units, int64_t activation_bytes, int64_t states = 2, bool reshard = true) {
  return {.units = units,
          .optimizer_states = states,
          .reshard_after_forward = reshard,
          .activation_bytes = activation_bytes};
}

// bench/e2e's compute model: 4 x Linear(1024, 1024), batch 64 per rank, W = 2. Each block
// saves its input (for addmm) and the ReLU's output: 2 x 64 x 1024 floats.
TEST(FsdpMemory, ComputeModelPeaksInTheBackwardOfTheSecondUnit) {
  const Plan plan = PlanFor("1024x1024,1024", "2");
  const MemoryEstimate m = EstimateMemory(plan, Memory(4, 2 * 64 * 1024 * 4));
  const int64_t shard = (512 * 1024 + 512) * 4;  // rank 0's rows of the weight and the bias
  const int64_t unit = 1049600 * 4;
  EXPECT_EQ(m.sharded_params, 4 * shard);
  EXPECT_EQ(m.optimizer_state, 8 * shard);
  EXPECT_EQ(m.unsharded_unit, unit);
  // Backward of unit 1: units 2 and 3 reduced (2 gradient shards), activations of units 0
  // and 1, and three unsharded copies: unit 1's and the prefetched unit 0's parameters and
  // unit 1's unsharded gradients, then (unit 1 resharded) the prefetched unit, the gradients
  // and the reduce-scatter input.
  EXPECT_EQ(m.peak, 12 * shard + 2 * shard + 2 * 524288 + 3 * unit);
  EXPECT_EQ(m.peak_phase, "backward of unit 1");
}

// The same model under FSDP1: its flat gradient (the reduce-scatter input) is filled while
// the unit is still unsharded, beside the original parameters' gradients: four copies.
TEST(FsdpMemory, ComputeModelUnderFsdp1HoldsFourUnshardedCopies) {
  const Plan plan = PlanFor("1024x1024,1024", "2", "fsdp1");
  const MemoryEstimate m = EstimateMemory(plan, Memory(4, 2 * 64 * 1024 * 4));
  const int64_t shard = (1049600 / 2) * 4;  // rank 0's half of the flat parameter
  const int64_t unit = 1049600 * 4;
  EXPECT_EQ(m.sharded_params, 4 * shard);
  EXPECT_EQ(m.peak, 12 * shard + 2 * shard + 2 * 524288 + 4 * unit);
  EXPECT_EQ(m.peak_phase, "backward of unit 1");
}

// bench/e2e's overhead model: 64 x (LayerNorm(64) + Linear(64, 64)), batch 8 per rank, W = 2:
// LayerNorm saves its input, mean and rstd; addmm its input; ReLU its output.
TEST(FsdpMemory, OverheadModelPeaksWhenTheLastPrefetchIsHeld) {
  const Plan plan = PlanFor("64x64,64,64,64", "2");
  const int64_t activations = 3 * 8 * 64 * 4 + 2 * 8 * 4;
  const MemoryEstimate m = EstimateMemory(plan, Memory(64, activations));
  const int64_t shard = (32 * 64 + 3 * 32) * 4, unit = 4288 * 4;
  EXPECT_EQ(m.sharded_params + m.optimizer_state, 64 * 3 * shard);
  // Backward of unit 1: 62 gradient shards, the activations of units 0 and 1, and three
  // unsharded copies (two units' parameters and the gradients, or after the reshard the
  // prefetched unit, the gradients and the reduce-scatter input). Unit 0 holds one gradient
  // shard more but no prefetched unit (8576 < 17152 B).
  EXPECT_EQ(m.peak, 64 * 3 * shard + 62 * shard + 2 * activations + 3 * unit);
  EXPECT_EQ(m.peak_phase, "backward of unit 1");
}

TEST(FsdpMemory, OneUnitOnOneRankHoldsTwoUnshardedCopiesInBackwardThreeUnderFsdp1) {
  // One 1000x10 parameter (40 KB) on 1 rank: parameter and AdamW state; in backward the
  // parameter and its gradient, then (resharded) the gradient and the reduce-scatter input:
  // two copies, below the optimizer step's gradient and two temporaries.
  const Plan plan = PlanFor("1000x10", "1");
  const MemoryEstimate m = EstimateMemory(plan, Memory(1, 0));
  EXPECT_EQ(m.peak, 3 * 40000 + 3 * 40000);
  EXPECT_EQ(m.peak_phase, "optimizer step");
  const MemoryEstimate sgd = EstimateMemory(plan, Memory(1, 0, /*states=*/0));
  EXPECT_EQ(sgd.peak, 40000 + 3 * 40000);
  // FSDP1: parameter, original gradients and the flat gradient at once (three copies; the
  // step's gradient and two flat-shard-sized temporaries tie with it, the first phase found
  // is named).
  const Plan flat = PlanFor("1000x10,10", "1", "fsdp1");
  const MemoryEstimate f = EstimateMemory(flat, Memory(1, 0));
  EXPECT_EQ(f.unsharded_unit, 10010 * 4);
  EXPECT_EQ(f.peak, 3 * 40040 + 3 * 40040);
  EXPECT_EQ(f.peak_phase, "backward of unit 0");
}

TEST(FsdpMemory, KeepingParametersAfterForwardHoldsEveryUnitInBackward) {
  const Plan plan = PlanFor("100x100", "4");
  const int64_t unit = 10000 * 4, shard = 2500 * 4;
  const MemoryEstimate kept = EstimateMemory(plan, Memory(8, 0, 2, /*reshard=*/false));
  // Backward of the last forward unit: all 8 units unsharded and its gradients (then 7
  // units, the gradients and the reduce-scatter input), no gradient shard yet.
  EXPECT_EQ(kept.peak, 8 * 3 * shard + 8 * unit + unit);
  EXPECT_EQ(kept.peak_phase, "backward of unit 7");
  EXPECT_LT(EstimateMemory(plan, Memory(8, 0)).peak, kept.peak);
}

TEST(FsdpMemory, BadFlagsNameTheFlagAndValue) {
  MemoryOptions out;
  RawMemoryFlags flags;
  flags.units = "0";
  EXPECT_EQ(ParseMemoryOptions(flags, &out), "--units must be an integer in [1, 1048576], got '0'");
  flags.units = "3";
  flags.activation_bytes = "-1";
  EXPECT_EQ(ParseMemoryOptions(flags, &out), "--activation_bytes must be an integer in [0, 2^50], got '-1'");
  flags.activation_bytes = "12";
  flags.optimizer = "lamb";
  EXPECT_EQ(ParseMemoryOptions(flags, &out),
            "--optimizer must be adamw, adam, sgd, sgd_momentum, adagrad or rmsprop, got 'lamb'");
  flags.optimizer = "rmsprop";
  flags.reshard_after_forward = false;
  ASSERT_EQ(ParseMemoryOptions(flags, &out), "");
  EXPECT_EQ(out.units, 3);
  EXPECT_EQ(out.activation_bytes, 12);
  EXPECT_EQ(out.optimizer_states, 1);
  EXPECT_FALSE(out.reshard_after_forward);
}

TEST(FsdpMemory, FormatsNameEveryTerm) {
  const MemoryEstimate m = EstimateMemory(PlanFor("8x8", "2"), Memory(2, 100));
  const std::string text = FormatMemoryText(m);
  for (const char* term : {"sharded parameters", "optimizer state", "activations", "predicted peak"}) {
    EXPECT_NE(text.find(term), std::string::npos) << term;
  }
  EXPECT_NE(FormatMemoryJson(m).find("\"peak\": " + std::to_string(m.peak)), std::string::npos);
}

}  // namespace
}  // namespace fsdp_plan
