// FSDP1 parity: N AdamW steps of a wrapped model on W ranks (each its slice of the batch)
// equal N steps of the same model on one rank on the whole batch, for every sharding
// strategy, use_orig_params, nested / root-only / auto wrapping, no_sync accumulation,
// backward / forward prefetch, mixed precision and gradient clipping; the nccl_processes cases
// train on GPU cuda:rank (model, inputs and reference) and skip, with the reason, where that
// cannot run.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/fsdp1/fsdp_test_models.h"
#include "mesh/device_mesh.h"
#include "testing/float_tolerance.h"
#include "testing/multi_rank.h"

namespace fsdp::fsdp1 {
namespace {

using fsdp::testing::Backend;
using fsdp::testing::RankDevice;
using testing::Batch;
using testing::InitDeterministic;
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
constexpr int64_t kBatch = 12;  // divisible by 1..4
constexpr double kMaxNorm = 0.05;

std::string StrategyName(ShardingStrategy s) { return ToString(s); }

// `device`: where the model, its inputs and the reference live (the rank's GPU for NCCL).
void RunParity(const Config& cfg, const comm::ProcessGroupPtr& world, c10::Device device = c10::Device(c10::kCPU)) {
  const int w = world->size(), me = world->rank();
  Net ref(2, 7, cfg.block0_twice), model(2, 7, cfg.block0_twice);
  InitDeterministic(*ref);
  InitDeterministic(*model);
  if (!device.is_cpu()) {
    ref->to(device);
    model->to(device);
  }
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
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(1e-2));

  const int64_t local = kBatch / w;
  for (int step = 0; step < kSteps; ++step) {
    for (int mb = 0; mb < cfg.micro_batches; ++mb) {
      const at::Tensor x = Batch(step * 10 + mb, kBatch, 3, 1).to(device);
      const at::Tensor y = Batch(step * 10 + mb, kBatch, 1, 2).to(device);
      torch::nn::functional::mse_loss(ref(x), y).backward();
      const at::Tensor lx = x.narrow(0, me * local, local), ly = y.narrow(0, me * local, local);
      auto loss = [&] { return torch::nn::functional::mse_loss(model(lx).to(at::kFloat), ly); };
      if (mb + 1 < cfg.micro_batches) {
        NoSyncGuard no_sync = root.no_sync();
        loss().backward();
      } else {
        loss().backward();
      }
    }
    if (cfg.clip_norm_type) {
      const double want = torch::nn::utils::clip_grad_norm_(ref->parameters(), kMaxNorm, *cfg.clip_norm_type);
      const double got = root.clip_grad_norm(kMaxNorm, *cfg.clip_norm_type).item<double>();
      // The norm sums the squares of some hundreds of float32 gradient elements in another order (per
      // shard, then across ranks) than the reference: rounding errors of random sign, ~sqrt(n) u
      // (u = 2^-24), plus the gradients' own sliced-batch rounding; 1e-5 leaves room for both and is
      // far below a missing or doubled shard (a whole fraction of the norm).
      EXPECT_NEAR(got, want, 1e-5 * std::max(1.0, want)) << cfg.name << " step " << step;
      EXPECT_GT(want, kMaxNorm) << cfg.name << ": the test should clip";
    }
    ref_opt.step();
    ref_opt.zero_grad();
    opt.step();
    opt.zero_grad();
  }
  // f32 (CPU kernels, or cuBLAS and NCCL on CUDA): two legitimate summation orders of the gradients,
  // through kSteps AdamW steps at lr 1e-2 (AdamWParityTolerance's argument). bf16 parameters against
  // the f32 reference: each gradient is off by some bf16 unit roundoffs (2^-8, relative), which AdamW's
  // lr * m / sqrt(v) turns into up to a whole step where a gradient element is near zero; 3e-2 is
  // kSteps * lr, the most a parameter can move, so the bf16 cases catch divergence, not a single step.
  testing::ExpectParamsMatch(root, *ref, cfg.bf16 ? 3e-2 : fsdp::testing::AdamWParityTolerance(kSteps, /*lr=*/1e-2),
                             cfg.name);
}

struct ParityCase {
  Backend backend;
  int world;
  Config cfg;
};

class ParityTest : public ::testing::TestWithParam<ParityCase> {};

TEST_P(ParityTest, TrainingEqualsSingleRank) {
  const ParityCase c = GetParam();
  FSDP_SKIP_IF_BACKEND_UNAVAILABLE(c.backend, c.world);
  fsdp::testing::RunOnRanks(c.backend, c.world, [c](const comm::ProcessGroupPtr& pg) {
    RunParity(c.cfg, pg, RankDevice(c.backend, pg->rank()));
  });
}

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

std::vector<at::Tensor> DistinctParams(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : m.parameters()) {
    if (std::none_of(out.begin(), out.end(), [&](const at::Tensor& q) { return q.is_same(p); })) out.push_back(p);
  }
  return out;
}

void RunTiedParity(ShardingStrategy strategy, bool use_orig_params, const comm::ProcessGroupPtr& world) {
  const std::string label = StrategyName(strategy) + (use_orig_params ? "_orig" : "");
  const int w = world->size(), me = world->rank();
  TiedNet ref, model;
  InitDeterministic(*ref);
  InitDeterministic(*model);
  ASSERT_TRUE(model->unembed->w.is_same(model->embed->w));
  ASSERT_EQ(DistinctParams(*ref).size(), ref->parameters().size() - 1);  // w is registered twice
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
    EXPECT_EQ(root.parameters().size(), DistinctParams(*ref).size()) << label;
  }

  const at::Tensor w0 = ref->embed->w.detach().clone();
  torch::optim::AdamW ref_opt(DistinctParams(*ref), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(1e-2));
  const int64_t local = kBatch / w;
  for (int step = 0; step < kSteps; ++step) {
    const at::Tensor x = Batch(step, kBatch, 3, 1), y = Batch(step, kBatch, 1, 2);
    torch::nn::functional::mse_loss(ref(x), y).backward();
    torch::nn::functional::mse_loss(model(x.narrow(0, me * local, local)), y.narrow(0, me * local, local)).backward();
    ref_opt.step();
    ref_opt.zero_grad();
    opt.step();
    opt.zero_grad();
  }
  // FullParams names a tied parameter by its first registration only.
  const std::map<std::string, at::Tensor> full = testing::FullParams(root);
  EXPECT_EQ(full.size(), DistinctParams(*ref).size()) << label;
  const auto ref_params = ref->named_parameters();
  for (const auto& [name, got] : full) {
    const at::Tensor* want = ref_params.find(name);
    if (want == nullptr) {
      ADD_FAILURE() << label << ": no reference parameter " << name;
      continue;
    }
    // Sliced vs whole-batch gradient sums through kSteps AdamW steps at lr 1e-2.
    const double tol = fsdp::testing::AdamWParityTolerance(kSteps, /*lr=*/1e-2);
    EXPECT_TRUE(at::allclose(got, *want, tol, tol))
        << label << " " << name << " max diff " << (got - *want).abs().max().item<double>();
  }
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

std::string CaseName(const ::testing::TestParamInfo<ParityCase>& info) {
  return info.param.cfg.name + "_" + fsdp::testing::BackendName(info.param.backend) + "_w" +
         std::to_string(info.param.world);
}

INSTANTIATE_TEST_SUITE_P(Fsdp1, ParityTest, ::testing::ValuesIn(Cases()), CaseName);

}  // namespace
}  // namespace fsdp::fsdp1
