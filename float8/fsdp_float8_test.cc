// FSDP2's float8 all-gather: the same bits as all-gathering the high-precision weight and
// casting it after (torchao's reference on the CPU, where Gloo has no float8 all-gather), half
// of bfloat16's all-gather bytes, no high-precision unsharded weight, the scale precompute's
// one all-reduce; FSDP, uneven shards, HSDP; the errors.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/comm_trace.h"
#include "float8/float8_linear.h"
#include "float8/fsdp_float8.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "mesh/device_mesh.h"
#include "tensor_parallel/parallel_style.h"
#include "tensor_parallel/parallelize_module.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::float8 {
namespace {

using fsdp::testing::Backend;
using fsdp::testing::RunOnRanks;
using Linear = Hooked<torch::nn::LinearImpl>;

// Three float8-convertible layers without biases: every all-gathered byte is a float8 weight's.
struct MlpImpl : torch::nn::Module {
  // The same weights on every rank: threaded ranks share the global generator, so each
  // draws from its own.
  MlpImpl() {
    a = register_module("a", Linear(torch::nn::LinearOptions(32, 64).bias(false)));
    b = register_module("b", Linear(torch::nn::LinearOptions(64, 48).bias(false)));
    c = register_module("c", Linear(torch::nn::LinearOptions(48, 16).bias(false)));
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.copy_(at::randn(p.sizes(), gen) * 0.2);
  }
  at::Tensor forward(const at::Tensor& x) { return c(at::relu(b(at::relu(a(x))))); }
  Linear a{nullptr}, b{nullptr}, c{nullptr};
};
using Mlp = Hooked<MlpImpl>;

struct TrainSetup {
  bool float8_all_gather = false;
  bool precompute = false;
  bool reshard_after_forward = true;
  std::optional<c10::ScalarType> param_dtype;
  bool convert = true;
};

struct TrainRun {
  std::vector<at::Tensor> losses;
  std::vector<at::Tensor> params;  // this rank's shards after the steps
};

constexpr int kSteps = 3;

// kSteps of SGD on fixed per-rank data; the model converted and fully_shard'ed per `setup`.
TrainRun Train(const mesh::DeviceMeshPtr& mesh, const TrainSetup& setup, int rank) {
  Mlp model;
  if (setup.convert) {
    Float8LinearConfig config;
    config.enable_fsdp_float8_all_gather = setup.float8_all_gather;
    convert_to_float8_training(*model, config);
  }
  fsdp2::FullyShardOptions opts{.mesh = mesh, .reshard_after_forward = setup.reshard_after_forward};
  if (setup.param_dtype) opts.mp_policy.param_dtype = setup.param_dtype;
  fsdp2::fully_shard(model->a.ptr(), opts);
  fsdp2::fully_shard(model->b.ptr(), opts);
  fsdp2::fully_shard(model->c.ptr(), opts);
  fsdp2::fully_shard(model.ptr(), opts);
  torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.05));
  at::Generator data = at::make_generator<at::CPUGeneratorImpl>(100 + rank);
  TrainRun run;
  for (int step = 0; step < kSteps; ++step) {
    const at::Tensor x = at::randn({8, 32}, data) * 3;
    const at::Tensor loss = model(x).pow(2).mean();
    loss.backward();
    optim.step();
    optim.zero_grad();
    if (setup.precompute) precompute_float8_dynamic_scale_for_fsdp(*model);
    run.losses.push_back(loss.detach().to(at::kFloat));
  }
  for (const auto& p : model->parameters()) run.params.push_back(p.detach().clone());
  return run;
}

void ExpectSameBits(const TrainRun& ours, const TrainRun& reference) {
  ASSERT_EQ(ours.losses.size(), reference.losses.size());
  for (size_t i = 0; i < ours.losses.size(); ++i) {
    EXPECT_TRUE(at::equal(ours.losses[i], reference.losses[i]))
        << "step " << i << ": " << ours.losses[i].item<float>() << " vs " << reference.losses[i].item<float>();
  }
  ASSERT_EQ(ours.params.size(), reference.params.size());
  for (size_t i = 0; i < ours.params.size(); ++i) EXPECT_TRUE(at::equal(ours.params[i], reference.params[i])) << i;
}

// Casting each shard with the weight's tensorwise scale before the all-gather gives the bits
// casting the gathered weight after it gives (torchao's Float8Linear without the float8
// all-gather), so losses and parameters are equal, not just close: exactly what torchao's
// float8 all-gather is on NCCL.
TEST(Float8AllGather, SameBitsAsCastingAfterTheAllGather) {
  for (const bool reshard : {true, false}) {
    for (const bool precompute : {false, true}) {
      for (const int world : {2, 3}) {  // 3: uneven shards (64 / 48 / 16 rows over 3 ranks)
        SCOPED_TRACE("reshard_after_forward=" + std::to_string(reshard) + " precompute=" + std::to_string(precompute) +
                     " world=" + std::to_string(world));
        RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
          auto mesh = mesh::DeviceMesh::Create(pg, {world});
          const TrainRun reference = Train(mesh, {.reshard_after_forward = reshard}, pg->rank());
          const TrainRun ours =
              Train(mesh, {.float8_all_gather = true, .precompute = precompute, .reshard_after_forward = reshard},
                    pg->rank());
          ExpectSameBits(ours, reference);
        });
      }
    }
  }
}

TEST(Float8AllGather, HsdpSameBitsAsCastingAfterTheAllGather) {
  for (const bool precompute : {false, true}) {
    RunOnRanks(Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
      auto mesh = mesh::DeviceMesh::Create(pg, {2, 2}, {"replicate", "shard"});
      const TrainRun reference = Train(mesh, {}, pg->rank());
      ExpectSameBits(Train(mesh, {.float8_all_gather = true, .precompute = precompute}, pg->rank()), reference);
    });
  }
}

int64_t Count(const comm::CommTrace& trace, const std::string& op) {
  int64_t n = 0;
  for (const auto& r : trace.records()) n += r.op == op;
  return n;
}

// All-gather bytes per step: half of all-gathering the bfloat16 weights (a quarter of float32);
// the amax all-reduces: one per weight per unshard, or one per step with the precompute.
TEST(Float8AllGather, HalvesTheBfloat16AllGatherBytes) {
  RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto bytes = [&](const TrainSetup& setup, int64_t* all_reduces) {
      auto trace = std::make_shared<comm::CommTrace>(pg);
      Train(mesh::DeviceMesh::Create(trace, {2}), setup, pg->rank());
      *all_reduces = Count(*trace, "all_reduce");
      return trace->total_output_bytes("all_gather_into_tensor");
    };
    int64_t reduces_bf16 = 0, reduces_fp32 = 0, reduces_fp8 = 0, reduces_precomputed = 0;
    const int64_t bf16 = bytes({.param_dtype = at::kBFloat16}, &reduces_bf16);
    const int64_t fp32 = bytes({}, &reduces_fp32);
    const int64_t fp8 = bytes({.float8_all_gather = true}, &reduces_fp8);
    const int64_t fp8_precomputed = bytes({.float8_all_gather = true, .precompute = true}, &reduces_precomputed);
    const int64_t weights = 32 * 64 + 64 * 48 + 48 * 16;
    // Each step all-gathers every weight twice (forward, and backward after the reshard),
    // except the root's, which has none of its own.
    EXPECT_EQ(fp8, kSteps * 2 * weights);
    EXPECT_EQ(2 * fp8, bf16);
    EXPECT_EQ(4 * fp8, fp32);
    EXPECT_EQ(fp8_precomputed, fp8);
    EXPECT_EQ(reduces_bf16, 0);
    EXPECT_EQ(reduces_fp8, kSteps * 2 * 3);          // one per weight per unshard
    EXPECT_EQ(reduces_precomputed, kSteps + 2 * 3);  // one per step; the first step's unshards compute theirs
  });
}

// While unsharded, a float8-gathered weight is a placeholder (one element, zero strides): the
// float8 bytes are the only unsharded copy.
TEST(Float8AllGather, NoHighPrecisionUnshardedWeight) {
  RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    Mlp model;
    Float8LinearConfig config;
    config.enable_fsdp_float8_all_gather = true;
    ASSERT_EQ(convert_to_float8_training(*model, config), 3);
    const auto mesh = mesh::DeviceMesh::Create(pg, {2});
    fsdp2::FSDPModule b = fsdp2::fully_shard(model->b.ptr(), {.mesh = mesh});
    fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
    b.unshard();
    const at::Tensor& weight = model->b->weight;
    EXPECT_EQ(weight.sizes(), (c10::IntArrayRef{48, 64}));
    EXPECT_EQ(weight.storage().nbytes(), sizeof(float));
    EXPECT_TRUE(std::isnan(weight.reshape(-1)[0].item<float>()));
    const auto gathered = AsFloat8Linear(*model->b)->weight_all_gather()->Gathered(weight);
    ASSERT_TRUE(gathered.has_value());
    EXPECT_EQ(gathered->data.scalar_type(), at::kFloat8_e4m3fn);
    EXPECT_EQ(gathered->data.sizes(), (c10::IntArrayRef{48, 64}));
    EXPECT_ERROR_CONTAINS(precompute_float8_dynamic_scale_for_fsdp(*model), "weight 'b.weight' is unsharded");
    b.reshard();
    EXPECT_FALSE(AsFloat8Linear(*model->b)->weight_all_gather()->Gathered(model->b->weight).has_value());
    EXPECT_EQ(model->b->weight.sizes(), (c10::IntArrayRef{24, 64}));
    // 'a' and 'c' are managed by the root's fully_shard; all three have their scale now.
    precompute_float8_dynamic_scale_for_fsdp(*model);
    const at::Tensor scale = AsFloat8Linear(*model->b)->weight_all_gather()->precomputed_scale();
    // The scale of the whole weight: 448 / max |W| over both shards.
    at::Tensor amax = model->b->weight.abs().max();
    pg->all_reduce(amax, comm::ReduceOp::Max())->wait();
    EXPECT_EQ(scale.item<float>(), static_cast<float>(448.0 / amax.item<double>()));
  });
}

// FSDP x TP (dp 2 x tp 2, a colwise, b rowwise, c replicated over tp): with every scale
// precomputed (before the first step too), the float8 all-gather casts each shard with the
// weight's global scale, which is the scale the float8 linear's own cast of the tensor-
// parallel shard computes without it: the same bits.
TEST(Float8AllGather, FsdpTimesTensorParallelSameBitsWithPrecomputedScales) {
  RunOnRanks(Backend::kThreaded, 4, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2, 2}, {"dp", "tp"});
    auto run = [&](bool all_gather) {
      Mlp model;
      Float8LinearConfig config;
      config.enable_fsdp_float8_all_gather = all_gather;
      convert_to_float8_training(*model, config);
      tensor_parallel::parallelize_module(
          *model, (*mesh)["tp"],
          {{"a", tensor_parallel::ColwiseParallel()}, {"b", tensor_parallel::RowwiseParallel()}});
      fsdp2::fully_shard(model->a.ptr(), {.mesh = (*mesh)["dp"]});
      fsdp2::fully_shard(model->b.ptr(), {.mesh = (*mesh)["dp"]});
      fsdp2::fully_shard(model->c.ptr(), {.mesh = (*mesh)["dp"]});
      fsdp2::fully_shard(model.ptr(), {.mesh = (*mesh)["dp"]});
      if (all_gather) precompute_float8_dynamic_scale_for_fsdp(*model);
      torch::optim::SGD optim(model->parameters(), torch::optim::SGDOptions(0.05));
      at::Generator data = at::make_generator<at::CPUGeneratorImpl>(100 + mesh->coordinate()[0]);
      TrainRun out;
      for (int step = 0; step < kSteps; ++step) {
        const at::Tensor loss = model(at::randn({8, 32}, data) * 3).pow(2).mean();
        loss.backward();
        optim.step();
        optim.zero_grad();
        if (all_gather) precompute_float8_dynamic_scale_for_fsdp(*model);
        out.losses.push_back(loss.detach());
      }
      for (const auto& p : model->parameters()) out.params.push_back(p.detach().clone());
      return out;
    };
    ExpectSameBits(run(true), run(false));
  });
}

// State dicts see the high-precision sharded parameters, never the float8 all-gather: a
// converted, sharded model's full state dict is the unconverted model's, and it loads back.
TEST(Float8AllGather, StateDictsAreTheHighPrecisionParameters) {
  RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    const auto mesh = mesh::DeviceMesh::Create(pg, {2});
    auto sharded = [&](bool convert) {
      Mlp model;
      if (convert) {
        Float8LinearConfig config;
        config.enable_fsdp_float8_all_gather = true;
        convert_to_float8_training(*model, config);
      }
      fsdp2::fully_shard(model->a.ptr(), {.mesh = mesh});
      fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
      return model;
    };
    Mlp converted = sharded(true);
    converted(at::ones({2, 32})).sum().backward();  // one float8 all-gather before the state dict
    const fsdp2::FullStateDict full = fsdp2::GetFullStateDict(*converted);
    const fsdp2::FullStateDict plain = fsdp2::GetFullStateDict(*sharded(false));
    ASSERT_EQ(full.size(), 3u);
    for (const auto& item : plain) {
      const at::Tensor* got = full.find(item.key());
      ASSERT_NE(got, nullptr) << item.key();
      EXPECT_TRUE(at::equal(*got, item.value())) << item.key();
    }
    fsdp2::FullStateDict doubled;
    for (const auto& item : plain) doubled.insert(item.key(), item.value() * 2);
    fsdp2::LoadFullStateDict(*converted, doubled);
    const fsdp2::FullStateDict reloaded = fsdp2::GetFullStateDict(*converted);
    for (const auto& item : doubled) EXPECT_TRUE(at::equal(*reloaded.find(item.key()), item.value())) << item.key();
  });
}

TEST(Float8AllGather, PrecomputeNeedsFullyShard) {
  Mlp model;
  Float8LinearConfig config;
  config.enable_fsdp_float8_all_gather = true;
  convert_to_float8_training(*model, config);
  EXPECT_ERROR_CONTAINS(precompute_float8_dynamic_scale_for_fsdp(*model),
                        "weight 'a.weight' has the float8 all-gather but no fully_shard manages it");
}

// FSDP2 installs the float8 all-gather when it shards, so a conversion after fully_shard
// would silently all-gather in high precision: it is an error naming the Linear and the
// fully_shard'ed module, and converts nothing.
TEST(Float8AllGather, ConvertAfterFullyShardIsAnError) {
  RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    Mlp model;
    const auto mesh = mesh::DeviceMesh::Create(pg, {2});
    fsdp2::fully_shard(model->b.ptr(), {.mesh = mesh});
    Float8LinearConfig config;
    config.enable_fsdp_float8_all_gather = true;
    EXPECT_ERROR_CONTAINS(convert_to_float8_training(*model, config),
                          "Linear 'b' is already under fully_shard (of 'b'); convert before fully_shard");
    fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
    EXPECT_ERROR_CONTAINS(convert_to_float8_training(*model, config),
                          "Linear 'a' is already under fully_shard (of ''); convert before fully_shard");
    EXPECT_EQ(AsFloat8Linear(*model->a), nullptr);
    EXPECT_EQ(AsFloat8Linear(*model->c), nullptr);
  });
}

}  // namespace
}  // namespace fsdp::float8
