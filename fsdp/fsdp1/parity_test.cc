// FSDP1 parity: N AdamW steps of a wrapped model on W ranks (each its slice of the batch)
// equal N steps of the same model on one rank on the whole batch, for every sharding
// strategy, use_orig_params, nested / root-only / auto wrapping, no_sync accumulation,
// backward / forward prefetch, mixed precision and gradient clipping; the nccl_processes cases
// train on GPU cuda:rank (model, inputs and reference) and skip, with the reason, where that
// cannot run. The training loop, the comparison and its tolerances are the parity harness's
// (fsdp/common/parity_harness.h), shared with FSDP2; this file keeps FSDP1's configurations.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/common/parity_harness.h"
#include "fsdp/fsdp1/test_models.h"
#include "mesh/device_mesh.h"
#include "testing/multi_rank.h"

namespace fsdp::fsdp1 {
namespace {

using fsdp::testing::Backend;
using testing::Net;

enum class Wrap { kNested, kRootOnly, kAutoByType, kAutoBySize };
enum class Groups { kMesh, kExplicit };

struct Config {
  std::string name;
  ShardingStrategy strategy = ShardingStrategy::FULL_SHARD;
  bool use_orig_params = false;
  Wrap wrap = Wrap::kNested;
  Groups groups = Groups::kMesh;  // hybrid only: 2-D mesh or explicit intra / inter groups
  int micro_batches = 1;          // > 1: no_sync for all but the last
  std::optional<BackwardPrefetch> backward_prefetch = BackwardPrefetch::BACKWARD_PRE;
  bool forward_prefetch = false;
  bool limit_all_gathers = true;
  bool bf16 = false;
  std::optional<double> clip_norm_type;  // clip to 0.05 with this norm type
  bool offload = false;
  bool freeze_block0 = false;  // block0's parameters do not require grad
  // block1.fc1's parameters do not require grad, block1.fc2's do: mixed requires_grad in one
  // flat parameter (use_orig_params), whose post-backward must wait for fc1's backward.
  bool freeze_block1_fc1 = false;
  bool block0_twice = false;  // block0 runs forward twice per step
};

constexpr int kSteps = 3;
constexpr double kMaxNorm = 0.05;

std::string StrategyName(ShardingStrategy s) { return ToString(s); }

// `device`: where the model, its inputs and the reference live (the rank's GPU for NCCL).
void RunParity(const Config& cfg, const comm::ProcessGroupPtr& world, c10::Device device) {
  const int w = world->size(), me = world->rank();
  Net ref(2, 7, cfg.block0_twice), model(2, 7, cfg.block0_twice);
  parity::InitPair(ref, model, device);
  if (cfg.freeze_block0) {
    for (Net* m : {&ref, &model}) {
      for (at::Tensor& p : (*m)->layers[0]->parameters()) p.set_requires_grad(false);
    }
  }
  if (cfg.freeze_block1_fc1) {
    for (Net* m : {&ref, &model}) {
      for (at::Tensor& p : (*m)->layers[1]->fc1->parameters()) p.set_requires_grad(false);
    }
  }
  FSDPOptions opts;
  opts.cpu_offload.offload_params = cfg.offload;
  opts.sharding_strategy = cfg.strategy;
  opts.use_orig_params = cfg.use_orig_params;
  opts.backward_prefetch = cfg.backward_prefetch;
  opts.forward_prefetch = cfg.forward_prefetch;
  opts.limit_all_gathers = cfg.limit_all_gathers;
  opts.device = device;
  if (cfg.bf16) opts.mixed_precision = MixedPrecision{.param_dtype = at::kBFloat16};
  if (IsHybrid(ToHandleShardingStrategy(cfg.strategy))) {
    // 2 replicas x (w / 2) shards: shard groups are rows of consecutive ranks.
    if (cfg.groups == Groups::kMesh) {
      opts.device_mesh = mesh::DeviceMesh::Create(world, {2, w / 2}, {"replicate", "shard"});
    } else {
      std::vector<int> row0, row1, col;
      for (int r = 0; r < w / 2; ++r) {
        row0.push_back(r);
        row1.push_back(w / 2 + r);
      }
      auto g0 = world->new_subgroup(row0), g1 = world->new_subgroup(row1);
      comm::ProcessGroupPtr inter;
      for (int s = 0; s < w / 2; ++s) {
        auto g = world->new_subgroup({s, w / 2 + s});
        if (me % (w / 2) == s) inter = g;
      }
      opts.process_group = me < w / 2 ? g0 : g1;
      opts.inter_node_group = inter;
    }
  } else {
    opts.process_group = world;
  }
  FullyShardedDataParallel root;
  switch (cfg.wrap) {
    case Wrap::kNested:
      for (auto& b : model->layers) wrap_fsdp(b.ptr(), opts);
      root = wrap_fsdp(model.ptr(), opts);
      break;
    case Wrap::kRootOnly: root = wrap_fsdp(model.ptr(), opts); break;
    case Wrap::kAutoByType:
      opts.auto_wrap_policy = ModuleTypeWrapPolicy<testing::BlockImpl>();
      root = wrap_fsdp(model.ptr(), opts);
      break;
    case Wrap::kAutoBySize:
      // Blocks have 2 * (5 * 7 + 7) + ... = 82 elements; Linears below the blocks cannot
      // run the hooks, so the blocks are the wrapped units.
      opts.auto_wrap_policy = SizeBasedAutoWrapPolicy(50);
      root = wrap_fsdp(model.ptr(), opts);
      break;
  }
  if (cfg.wrap != Wrap::kRootOnly) {
    for (auto& b : model->layers) ASSERT_NE(GetState(*b.ptr()), nullptr) << cfg.name;
  }
  const size_t want_handles = cfg.wrap == Wrap::kRootOnly ? 1 : 1 + model->layers.size();
  ASSERT_EQ(root.handles().size(), want_handles) << cfg.name;
  parity::Trainee trainee{.params = root.parameters()};
  trainee.micro_batch = [&](const at::Tensor& x, const at::Tensor& y, bool sync) {
    auto loss = [&] { return torch::nn::functional::mse_loss(model(x).to(at::kFloat), y); };
    if (!sync) {
      NoSyncGuard no_sync = root.no_sync();
      loss().backward();
    } else {
      loss().backward();
    }
  };
  if (cfg.clip_norm_type) {
    trainee.before_step = [&](int step) {
      const double want = torch::nn::utils::clip_grad_norm_(ref->parameters(), kMaxNorm, *cfg.clip_norm_type);
      const double got = root.clip_grad_norm(kMaxNorm, *cfg.clip_norm_type).item<double>();
      // The norm sums the squares of some hundreds of float32 gradient elements in another order (per
      // shard, then across ranks) than the reference: rounding errors of random sign, ~sqrt(n) u
      // (u = 2^-24), plus the gradients' own sliced-batch rounding; 1e-5 leaves room for both and is
      // far below a missing or doubled shard (a whole fraction of the norm).
      EXPECT_NEAR(got, want, 1e-5 * std::max(1.0, want)) << cfg.name << " step " << step;
      EXPECT_GT(want, kMaxNorm) << cfg.name << ": the test should clip";
    };
  }
  parity::Train({.world = w, .rank = me, .device = device, .steps = kSteps, .micro_batches = cfg.micro_batches}, ref,
                trainee);
  // parity::ParamTolerance's argument (float32: two summation orders of the gradients; bf16
  // parameters: three whole steps, all a kSteps = 3 run can move).
  testing::ExpectParamsMatch(root, *ref, parity::ParamTolerance(kSteps, cfg.bf16), cfg.name);
}

using ParityCase = parity::Case<Config>;

class ParityTest : public ::testing::TestWithParam<ParityCase> {};

TEST_P(ParityTest, TrainingEqualsSingleRank) { parity::RunCase<Config>(GetParam(), RunParity); }

std::vector<ParityCase> Cases() {
  std::vector<ParityCase> cases;
  const ShardingStrategy flat[] = {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP,
                                   ShardingStrategy::NO_SHARD};
  const ShardingStrategy hybrid[] = {ShardingStrategy::HYBRID_SHARD, ShardingStrategy::HYBRID_SHARD_ZERO2};
  for (bool orig : {false, true}) {
    const std::string o = orig ? "_orig" : "";
    for (ShardingStrategy s : flat) {
      for (int w = 1; w <= 4; ++w) {
        cases.push_back({Backend::kThreaded, w, {.name = StrategyName(s) + o, .strategy = s, .use_orig_params = orig}});
      }
      cases.push_back(
          {Backend::kGlooThreads, 4, {.name = StrategyName(s) + o, .strategy = s, .use_orig_params = orig}});
    }
    for (ShardingStrategy s : hybrid) {
      cases.push_back({Backend::kThreaded, 4, {.name = StrategyName(s) + o, .strategy = s, .use_orig_params = orig}});
      cases.push_back({Backend::kThreaded,
                       4,
                       {.name = StrategyName(s) + o + "_groups",
                        .strategy = s,
                        .use_orig_params = orig,
                        .groups = Groups::kExplicit}});
      cases.push_back(
          {Backend::kGlooThreads, 4, {.name = StrategyName(s) + o, .strategy = s, .use_orig_params = orig}});
    }
    for (ShardingStrategy s : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP,
                               ShardingStrategy::NO_SHARD, ShardingStrategy::HYBRID_SHARD}) {
      const int w = 4;
      const std::string n = StrategyName(s) + o;
      cases.push_back({Backend::kThreaded,
                       w,
                       {.name = n + "_root_only", .strategy = s, .use_orig_params = orig, .wrap = Wrap::kRootOnly}});
      // The acceptance's 4 micro-batches (3 under no_sync, then a synchronized one).
      cases.push_back({Backend::kThreaded,
                       w,
                       {.name = n + "_no_sync4", .strategy = s, .use_orig_params = orig, .micro_batches = 4}});
      if (s == ShardingStrategy::FULL_SHARD) {
        cases.push_back({Backend::kThreaded,
                         3,
                         {.name = n + "_no_sync3", .strategy = s, .use_orig_params = orig, .micro_batches = 3}});
      }
    }
    cases.push_back(
        {Backend::kThreaded, 4, {.name = "auto_type" + o, .use_orig_params = orig, .wrap = Wrap::kAutoByType}});
    cases.push_back(
        {Backend::kThreaded, 3, {.name = "auto_size" + o, .use_orig_params = orig, .wrap = Wrap::kAutoBySize}});
    cases.push_back(
        {Backend::kThreaded,
         4,
         {.name = "prefetch_post" + o, .use_orig_params = orig, .backward_prefetch = BackwardPrefetch::BACKWARD_POST}});
    cases.push_back({Backend::kThreaded,
                     4,
                     {.name = "prefetch_none" + o,
                      .use_orig_params = orig,
                      .backward_prefetch = std::nullopt,
                      .limit_all_gathers = false}});
    cases.push_back(
        {Backend::kThreaded, 4, {.name = "forward_prefetch" + o, .use_orig_params = orig, .forward_prefetch = true}});
    cases.push_back({Backend::kThreaded, 2, {.name = "bf16" + o, .use_orig_params = orig, .bf16 = true}});
    cases.push_back({Backend::kThreaded,
                     4,
                     {.name = "bf16_shard_grad_op" + o,
                      .strategy = ShardingStrategy::SHARD_GRAD_OP,
                      .use_orig_params = orig,
                      .bf16 = true}});
    cases.push_back({Backend::kThreaded, 3, {.name = "clip_l2" + o, .use_orig_params = orig, .clip_norm_type = 2.0}});
    cases.push_back(
        {Backend::kThreaded,
         4,
         {.name = "clip_inf" + o, .use_orig_params = orig, .clip_norm_type = std::numeric_limits<double>::infinity()}});
    cases.push_back({Backend::kThreaded,
                     4,
                     {.name = "clip_l1_no_shard" + o,
                      .strategy = ShardingStrategy::NO_SHARD,
                      .use_orig_params = orig,
                      .clip_norm_type = 1.0}});
    cases.push_back({Backend::kThreaded, 4, {.name = "offload" + o, .use_orig_params = orig, .offload = true}});
    cases.push_back({Backend::kThreaded,
                     2,
                     {.name = "offload_no_shard" + o,
                      .strategy = ShardingStrategy::NO_SHARD,
                      .use_orig_params = orig,
                      .offload = true}});
    cases.push_back(
        {Backend::kThreaded, 4, {.name = "frozen_block0" + o, .use_orig_params = orig, .freeze_block0 = true}});
    cases.push_back(
        {Backend::kThreaded, 4, {.name = "block0_twice" + o, .use_orig_params = orig, .block0_twice = true}});
    if (orig) {
      cases.push_back({Backend::kThreaded,
                       2,
                       {.name = "frozen_block1_fc1" + o, .use_orig_params = true, .freeze_block1_fc1 = true}});
    }
    cases.push_back({Backend::kThreaded,
                     2,
                     {.name = "block0_twice_post" + o,
                      .use_orig_params = orig,
                      .backward_prefetch = BackwardPrefetch::BACKWARD_POST,
                      .block0_twice = true}});
    cases.push_back({Backend::kThreaded,
                     4,
                     {.name = "clip_hybrid" + o,
                      .strategy = ShardingStrategy::HYBRID_SHARD,
                      .use_orig_params = orig,
                      .clip_norm_type = 2.0}});
  }
  // CUDA + NCCL (c10d's ProcessGroupNCCL), rank r on cuda:r: skipped where that cannot run
  // (default build, too few GPUs), with the reason.
  cases.push_back({Backend::kNcclProcesses, 1, {.name = "FULL_SHARD"}});
  cases.push_back({Backend::kNcclProcesses, 2, {.name = "FULL_SHARD"}});
  cases.push_back({Backend::kNcclProcesses, 2, {.name = "FULL_SHARD_orig", .use_orig_params = true}});
  cases.push_back({Backend::kNcclProcesses, 2, {.name = "SHARD_GRAD_OP", .strategy = ShardingStrategy::SHARD_GRAD_OP}});
  cases.push_back({Backend::kNcclProcesses, 2, {.name = "no_sync2", .micro_batches = 2}});
  cases.push_back({Backend::kNcclProcesses, 2, {.name = "bf16", .bf16 = true}});
  cases.push_back({Backend::kNcclProcesses, 4, {.name = "HYBRID_SHARD", .strategy = ShardingStrategy::HYBRID_SHARD}});
  return cases;
}

// Tied weights inside one wrapped unit: `embed` and `unembed` register the same tensor w
// [6, 3] (x @ w^T, then h @ w), flattened once into the root's handle, so its gradient is the
// sum of both uses; the block between them is its own FSDP unit. 3 AdamW steps on W ranks
// equal 3 steps of the same tied model on one rank (whose optimizer gets w once).
struct TiedProjImpl : torch::nn::Module {
  TiedProjImpl(at::Tensor tied, bool transpose) : transpose(transpose) { w = register_parameter("w", std::move(tied)); }
  at::Tensor forward(const at::Tensor& x) { return transpose ? x.matmul(w.t()) : x.matmul(w); }
  at::Tensor w;
  bool transpose;
};
TORCH_MODULE(TiedProj);

struct TiedNetImpl : torch::nn::Module {
  TiedNetImpl()
      : embed(register_module("embed", TiedProj(at::zeros({6, 3}), true))),
        block(register_module("block", testing::Block(6, 7))),
        unembed(register_module("unembed", TiedProj(embed->w, false))),
        head(register_module("head", torch::nn::Linear(3, 1))) {}
  at::Tensor forward(const at::Tensor& x) { return head(unembed(block(embed(x)))); }
  TiedProj embed;
  testing::Block block;
  TiedProj unembed;
  torch::nn::Linear head;
};
using TiedNet = Hooked<TiedNetImpl>;

void RunTiedParity(ShardingStrategy strategy, bool use_orig_params, const comm::ProcessGroupPtr& world) {
  const std::string label = StrategyName(strategy) + (use_orig_params ? "_orig" : "");
  const int w = world->size(), me = world->rank();
  TiedNet ref, model;
  parity::InitPair(ref, model, c10::Device(c10::kCPU));
  ASSERT_TRUE(model->unembed->w.is_same(model->embed->w));
  ASSERT_EQ(test_models::UniqueParameters(*ref).size(), ref->parameters().size() - 1);  // w is registered twice
  FSDPOptions opts{.sharding_strategy = strategy, .use_orig_params = use_orig_params};
  if (IsHybrid(ToHandleShardingStrategy(strategy))) {
    opts.device_mesh = mesh::DeviceMesh::Create(world, {2, w / 2}, {"replicate", "shard"});
  } else {
    opts.process_group = world;
  }
  wrap_fsdp(model->block.ptr(), opts);
  FullyShardedDataParallel root = wrap_fsdp(model.ptr(), opts);
  ASSERT_EQ(root.handles().size(), 2u) << label;
  const FlatParameter& fp = root.handle()->flat_param();
  EXPECT_EQ(fp.fqns, (std::vector<std::string>{"embed.w", "head.weight", "head.bias"})) << label;
  ASSERT_EQ(fp.shared_param_infos.size(), 1u) << label;
  EXPECT_EQ(fp.shared_param_infos[0].module_name, "unembed") << label;
  EXPECT_EQ(fp.shared_param_infos[0].prim_module_name, "embed") << label;
  if (use_orig_params) {
    EXPECT_EQ(root.parameters().size(), test_models::UniqueParameters(*ref).size()) << label;
  }

  const at::Tensor w0 = ref->embed->w.detach().clone();
  parity::Train({.world = w, .rank = me, .steps = kSteps}, ref,
                {.params = root.parameters(), .micro_batch = [&](const at::Tensor& x, const at::Tensor& y, bool) {
                   torch::nn::functional::mse_loss(model(x), y).backward();
                 }});
  // Sliced vs whole-batch gradient sums through kSteps AdamW steps (parity::ParamTolerance's
  // float32 argument). FullParams names a tied parameter by its first registration only.
  parity::ExpectParamsMatch(testing::FullParams(root), *ref, parity::ParamTolerance(kSteps, /*bf16_params=*/false),
                            label);
  EXPECT_FALSE(at::allclose(ref->embed->w, w0)) << "the tied weight should have trained";
}

TEST(Fsdp1TiedParity, TiedWeightsInOneUnitEqualSingleRank) {
  for (ShardingStrategy s : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD,
                             ShardingStrategy::HYBRID_SHARD}) {
    for (bool orig : {false, true}) {
      const int w = IsHybrid(ToHandleShardingStrategy(s)) ? 4 : 3;
      fsdp::testing::RunOnRanks(Backend::kThreaded, w,
                                [s, orig](const comm::ProcessGroupPtr& pg) { RunTiedParity(s, orig, pg); });
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fsdp1, ParityTest, ::testing::ValuesIn(Cases()), parity::CaseName<Config>);

}  // namespace
}  // namespace fsdp::fsdp1
