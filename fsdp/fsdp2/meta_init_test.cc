// Deferred (meta-device) init of fully_shard'ed models: InitMetaParameters gives the values a
// single-rank init with the same seed gives, bitwise, at world sizes 1-3 and on an HSDP mesh
// (tied weights, buffers, ignored parameters included); loading from rank 0 fills the shards
// too; a model whose shards were never filled refuses to run, naming the tensor.
#include "fsdp/fsdp2/meta_init.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <string>
#include <vector>

#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/fsdp2/test_models.h"
#include "fsdp/meta/meta.h"
#include "testing/allocation_counter.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::fsdp2 {
namespace {

using fsdp::testing::Backend;
using testing::Net;
using testing::NetOptions;
using testing::TrainSteps;
using testing::UniqueParameters;

constexpr uint64_t kSeed = 5;

ModuleInitFn SeededInit(uint64_t seed) { return fsdp::test_models::SeededModuleInit(seed); }

template <class Model>
Model ReferenceModel(Model model) {
  fsdp::test_models::InitEveryModule(*model, SeededInit(kSeed));
  return model;
}

// Every parameter and buffer of `model`, by name.
FullStateDict StateOf(const torch::nn::Module& model) {
  FullStateDict out;
  for (const auto& item : model.named_parameters()) out.insert(item.key(), item.value().detach().clone());
  for (const auto& item : model.named_buffers()) out.insert(item.key(), item.value().detach().clone());
  return out;
}

void ExpectBitwiseEqual(const FullStateDict& got, const FullStateDict& want, const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (const auto& item : want) {
    const at::Tensor* g = got.find(item.key());
    ASSERT_NE(g, nullptr) << where << ": " << item.key();
    EXPECT_TRUE(at::equal(*g, item.value())) << where << ": " << item.key() << "\n" << *g << "\n" << item.value();
  }
}

// Net (tied weights) built on the meta device, each block and the root fully_shard'ed.
Net MetaShardedNet(const mesh::DeviceMeshPtr& mesh) {
  Net model(NetOptions{.tie = true});
  ToMeta(*model);
  for (auto& b : model->layers) fully_shard(b.ptr(), {.mesh = mesh});
  fully_shard(model.ptr(), {.mesh = mesh});
  return model;
}

TEST(MetaInit, ToMetaKeepsIdentityAndFreesStorage) {
  torch::nn::Linear fc(4, 3);
  const at::Tensor weight = fc->weight;
  ToMeta(*fc);
  EXPECT_TRUE(fc->weight.is_same(weight));
  EXPECT_TRUE(weight.is_meta());
  EXPECT_EQ(weight.sizes().vec(), (std::vector<int64_t>{3, 4}));
  EXPECT_TRUE(weight.requires_grad());
  EXPECT_EQ(FindMetaTensor(*fc).value_or(""), "weight");
  auto built = MakeOnMeta<torch::nn::Linear>(5, 2);
  EXPECT_TRUE(built->bias.is_meta());
}

TEST(MetaInit, MatchesSingleRankInitBitwiseAtAnyWorldSize) {
  const FullStateDict want = StateOf(*ReferenceModel(Net(NetOptions{.tie = true})));
  for (int world : {1, 2, 3, 4}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
      // World 4 as HSDP (2 replicas x 2 shards); the others 1-D.
      auto mesh = world == 4 ? mesh::DeviceMesh::Create(pg, {2, 2}, {"replicate", "shard"})
                             : mesh::DeviceMesh::Create(pg, {world});
      Net model = MetaShardedNet(mesh);
      InitMetaParameters(*model, SeededInit(kSeed));
      EXPECT_FALSE(FindMetaTensor(*model).has_value());
      ExpectBitwiseEqual(GetFullStateDict(*model), want, "world " + std::to_string(world));
      // It trains (the root's lazy init accepts it).
      torch::optim::SGD opt(UniqueParameters(*model), torch::optim::SGDOptions(0.1));
      TrainSteps(model, opt, 0, 1, world, pg->rank());
    });
  }
}

// A buffer and an ignored parameter built on the meta device are materialized whole.
struct ScaledImpl : torch::nn::Module {
  ScaledImpl() : fc(register_module("fc", torch::nn::Linear(4, 6))) { scale = register_buffer("scale", at::ones({6})); }
  at::Tensor forward(const at::Tensor& x) { return fc(x) * scale; }
  torch::nn::Linear fc;
  at::Tensor scale;
};
using Scaled = fsdp::Hooked<ScaledImpl>;

TEST(MetaInit, BuffersAndIgnoredParametersAreMaterializedWhole) {
  const FullStateDict want = StateOf(*ReferenceModel(Scaled()));
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Scaled model;
    ToMeta(*model);
    fully_shard(model.ptr(), {.mesh = mesh::DeviceMesh::Create(pg, {2}), .ignored_params = {model->fc->bias}});
    EXPECT_ERROR_CONTAINS(model(at::ones({1, 4})), "parameter 'fc.weight' was on the meta device");
    InitMetaParameters(*model, SeededInit(kSeed));
    EXPECT_FALSE(model->scale.is_meta());
    EXPECT_FALSE(model->fc->bias.is_meta());
    EXPECT_TRUE(at::equal(model->scale, want["scale"]));
    EXPECT_TRUE(at::equal(model->fc->bias, want["fc.bias"]));
    ExpectBitwiseEqual(GetFullStateDict(*model), want, "scaled");
    EXPECT_EQ(model(at::ones({1, 4})).sizes().vec(), (std::vector<int64_t>{1, 6}));
  });
}

TEST(MetaInit, RunningBeforeTheShardsAreFilledIsAnErrorNamingTheTensor) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    Net model = MetaShardedNet(mesh::DeviceMesh::Create(pg, {2}));
    // The root's own parameters come first in named_parameters() order.
    EXPECT_ERROR_CONTAINS(model(at::ones({2, 3})), "parameter 'extra' was on the meta device at fully_shard");
    // The refusal changes nothing: fill the shards, and the model runs.
    InitMetaParameters(*model, SeededInit(kSeed));
    EXPECT_EQ(model(at::ones({2, 3})).sizes().vec(), (std::vector<int64_t>{2, 1}));
  });
  // A buffer left on the meta device (nothing FSDP manages).
  Scaled plain;
  ReplaceData(plain->scale, at::empty({6}, at::TensorOptions().device(c10::kMeta)));
  fsdp::testing::RunOnRanks(Backend::kThreaded, 1, [&](const comm::ProcessGroupPtr& pg) {
    fully_shard(plain.ptr(), {.mesh = mesh::DeviceMesh::Create(pg, {1})});
    EXPECT_ERROR_CONTAINS(plain(at::ones({1, 4})), "'scale' is still on the meta device");
  });
}

TEST(MetaInit, InitFunctionErrorsPropagateAndLeaveTheShardsUnfilled) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    Net model = MetaShardedNet(mesh::DeviceMesh::Create(pg, {2}));
    EXPECT_ERROR_CONTAINS(
        InitMetaParameters(*model, [](torch::nn::Module&) { TORCH_CHECK(false, "init failed here"); }),
        "init failed here");
    EXPECT_ERROR_CONTAINS(model(at::ones({2, 3})), "was on the meta device at fully_shard");
    EXPECT_ERROR_CONTAINS(InitMetaParameters(*model, nullptr), "init_fn is empty");
  });
}

TEST(MetaInit, BroadcastFromRank0FillsEveryRanksShards) {
  const FullStateDict want = StateOf(*ReferenceModel(Net(NetOptions{.tie = true})));
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
    Net model = MetaShardedNet(mesh::DeviceMesh::Create(pg, {3}));
    // Rank 0 holds the full state dict (e.g. LoadFullStateDictFile); the others nothing.
    LoadFullStateDict(*model, pg->rank() == 0 ? want : FullStateDict(), {.rank0_only = true});
    ExpectBitwiseEqual(GetFullStateDict(*model), want, "from rank 0");
    torch::optim::SGD opt(UniqueParameters(*model), torch::optim::SGDOptions(0.1));
    TrainSteps(model, opt, 0, 1, 3, pg->rank());
  });
}

// From rank 0, the other ranks receive only their rows: none of them ever allocates the
// whole weight (a 1-D mesh: rank 0 scatters instead of broadcasting).
TEST(MetaInit, RankZeroSendsEachRankOnlyItsRows) {
  using Wide = fsdp::Hooked<torch::nn::LinearImpl>;
  constexpr int64_t kWeightBytes = 64 * 64 * 4;
  Wide reference(64, 64);
  const FullStateDict want = StateOf(*reference);
  fsdp::testing::ScopedAllocationCounter::Install();  // before the rank threads allocate
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
    Wide model(64, 64);
    ToMeta(*model);
    fully_shard(model.ptr(), {.mesh = mesh::DeviceMesh::Create(pg, {4})});
    int64_t peak = 0;
    {
      fsdp::testing::ScopedAllocationCounter counter;
      LoadFullStateDict(*model, pg->rank() == 0 ? want : FullStateDict(), {.rank0_only = true});
      peak = counter.peak();
    }
    if (pg->rank() != 0) {
      EXPECT_LT(peak, kWeightBytes / 2) << "rank " << pg->rank();
    }
    ExpectBitwiseEqual(GetFullStateDict(*model), want, "scattered from rank 0");
  });
}

}  // namespace
}  // namespace fsdp::fsdp2
