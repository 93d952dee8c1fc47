// FSDP2 state dicts: sharded and full round trips (bitwise), 1 rank -> 3 ranks through a
// file, rank-0-only gather and broadcast, and load errors.
#include "fsdp/fsdp2/state_dict.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/test_models.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"
#include "testing/test_dir.h"

namespace fsdp::fsdp2 {
namespace {

using fsdp::testing::Backend;
using testing::InitDeterministic;
using testing::Net;
using testing::NetOptions;
using testing::TrainSteps;
using testing::UniqueParameters;

// Net with tied weights, each block and the root fully_shard'ed on `mesh`.
Net ShardedNet(const mesh::DeviceMeshPtr& mesh, uint64_t seed = 11) {
  Net model(NetOptions{.tie = true});
  InitDeterministic(*model, seed);
  for (auto& b : model->layers) fully_shard(b.ptr(), {.mesh = mesh});
  fully_shard(model.ptr(), {.mesh = mesh});
  return model;
}

// This rank's rows of `full` by torch.chunk: the reference for what FSDP must hold.
at::Tensor ExpectedShard(const at::Tensor& full, int64_t world, int64_t rank) {
  const auto chunks = at::chunk(full, world, 0);
  if (rank < static_cast<int64_t>(chunks.size())) return chunks[rank];
  std::vector<int64_t> size = full.sizes().vec();
  size[0] = 0;
  return at::empty(size, full.options());
}

TEST(ShardedStateDict, RoundTripIsBitwiseAndKeyedByOriginalNames) {
  for (bool hsdp : {false, true}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [hsdp](const comm::ProcessGroupPtr& pg) {
      auto mesh =
          hsdp ? mesh::DeviceMesh::Create(pg, {2, 2}, {"replicate", "shard"}) : mesh::DeviceMesh::Create(pg, {4});
      Net model = ShardedNet(mesh);
      torch::optim::AdamW opt(UniqueParameters(*model), torch::optim::AdamWOptions(1e-2));
      TrainSteps(model, opt, 0, 2, 4, pg->rank());

      const ShardedStateDict sd = GetShardedStateDict(*model);
      std::vector<std::string> keys;
      for (const auto& item : model->named_parameters()) keys.push_back(item.key());
      EXPECT_EQ(sd.dtensors.keys(), keys);  // tied weights under both names, no wrapper prefix
      EXPECT_TRUE(sd.tensors.is_empty());
      const Net unsharded(NetOptions{.tie = true});
      ShardedStateDict snapshot;
      for (const auto& item : sd.dtensors) {
        const dtensor::DTensor& d = item.value();
        EXPECT_EQ(d.sizes(), unsharded->named_parameters()[item.key()].sizes().vec()) << item.key();
        EXPECT_EQ(d.placements().back().is_shard(0), true) << item.key();
        snapshot.dtensors.insert(item.key(), dtensor::DTensor::FromSpec(d.to_local().clone(), d.spec()));
      }

      TrainSteps(model, opt, 2, 2, 4, pg->rank());
      const at::Tensor mix = snapshot.dtensors["mix.weight"].to_local();  // empty on the 4th rank
      if (mix.numel() > 0) {
        EXPECT_FALSE(at::equal(model->mix->weight, mix));
      }
      LoadShardedStateDict(*model, snapshot);
      const ShardedStateDict loaded = GetShardedStateDict(*model);
      for (const auto& item : snapshot.dtensors) {
        EXPECT_TRUE(at::equal(loaded.dtensors[item.key()].to_local(), item.value().to_local())) << item.key();
      }
      EXPECT_TRUE(at::equal(model->mix->weight, mix));
      EXPECT_TRUE(model->mix->weight.is_same(model->tied->weight));
    });
  }
}

TEST(ShardedStateDict, ReplicatedDTensorsAreRedistributedOnLoad) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {3});
    Net source(NetOptions{.tie = true});
    InitDeterministic(*source, 5);
    Net model = ShardedNet(mesh, 11);
    ShardedStateDict replicated;
    for (const auto& item : source->named_parameters()) {
      replicated.dtensors.insert(
          item.key(),
          dtensor::distribute_tensor(item.value().detach(), mesh, {dtensor::Placement::Replicate()}, std::nullopt));
    }
    LoadShardedStateDict(*model, replicated);
    for (const auto& item : GetFullStateDict(*model)) {
      EXPECT_TRUE(at::equal(item.value(), source->named_parameters()[item.key()])) << item.key();
    }
  });
}

TEST(FullStateDict, SavedOnOneRankLoadsIntoThreeRanksBitwise) {
  const std::string path = fsdp::testing::NewTestPath("full_state_dict_1_to_3");
  fsdp::testing::RunOnRanks(Backend::kThreaded, 1, [&](const comm::ProcessGroupPtr& pg) {
    Net model = ShardedNet(mesh::DeviceMesh::Create(pg, {1}));
    torch::optim::AdamW opt(UniqueParameters(*model), torch::optim::AdamWOptions(1e-2));
    TrainSteps(model, opt, 0, 3, 1, 0);
    const FullStateDict full = GetFullStateDict(*model, {.cpu_offload = true});
    for (const auto& item : model->named_parameters()) {  // one rank: the shard is everything
      EXPECT_TRUE(at::equal(full[item.key()], item.value())) << item.key();
    }
    SaveFullStateDict(full, path);
  });
  const FullStateDict saved = LoadFullStateDictFile(path);
  ASSERT_EQ(saved.size(), Net(NetOptions{.tie = true})->named_parameters().size());
  for (bool rank0_only : {false, true}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
      const int me = pg->rank();
      Net model = ShardedNet(mesh::DeviceMesh::Create(pg, {3}), /*seed=*/99);
      const FullStateDict mine = (rank0_only && me != 0) ? FullStateDict() : LoadFullStateDictFile(path);
      LoadFullStateDict(*model, mine, {.rank0_only = rank0_only});
      for (const auto& item : model->named_parameters()) {  // each parameter is this rank's shard
        EXPECT_TRUE(at::equal(item.value(), ExpectedShard(saved[item.key()], 3, me))) << item.key() << " rank " << me;
      }
      const FullStateDict round_trip = GetFullStateDict(*model);
      EXPECT_EQ(round_trip.keys(), saved.keys());
      for (const auto& item : saved) EXPECT_TRUE(at::equal(round_trip[item.key()], item.value())) << item.key();
    });
  }
  std::remove(path.c_str());
}

TEST(FullStateDict, RankZeroOnlyLeavesOtherRanksEmpty) {
  fsdp::testing::RunOnRanks(Backend::kGlooThreads, 3, [](const comm::ProcessGroupPtr& pg) {
    Net model = ShardedNet(mesh::DeviceMesh::Create(pg, {3}));
    Net reference(NetOptions{.tie = true});
    InitDeterministic(*reference);
    const FullStateDict full = GetFullStateDict(*model, {.rank0_only = true});
    if (pg->rank() != 0) {
      EXPECT_TRUE(full.is_empty());
      return;
    }
    EXPECT_EQ(full.size(), reference->named_parameters().size());
    for (const auto& item : reference->named_parameters()) EXPECT_TRUE(at::equal(full[item.key()], item.value()));
  });
}

// A tensor-parallel model that no fully_shard manages: its full state dict is the global
// tensors (gathered over tp), and loading one takes each parameter's box; its sharded state
// dict holds each such parameter as a DTensor.
TEST(FullStateDict, TensorParallelWithoutFsdpGathersAndSlicesByTheSpec) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2}, {"tp"});
    Net reference(NetOptions{.hidden = 8});
    InitDeterministic(*reference);
    testing::TPNet model(*reference, mesh);
    const FullStateDict full = GetFullStateDict(*model);
    EXPECT_EQ(full.size(), reference->named_parameters().size());
    for (const auto& item : reference->named_parameters()) {
      ASSERT_NE(full.find(item.key()), nullptr) << item.key();
      EXPECT_TRUE(at::equal(full[item.key()], item.value())) << item.key();
    }
    Net other(NetOptions{.hidden = 8});
    InitDeterministic(*other, /*seed=*/5);
    testing::TPNet loaded(*other, mesh);
    LoadFullStateDict(*loaded, full);
    const FullStateDict again = GetFullStateDict(*loaded);
    for (const auto& item : reference->named_parameters()) {
      EXPECT_TRUE(at::equal(again[item.key()], item.value())) << item.key();
    }
    // The sharded state dict: a DTensor per tensor-parallel parameter, with its spec; it loads
    // back into another init bitwise.
    const ShardedStateDict sharded = GetShardedStateDict(*model);
    const dtensor::DTensor* fc1 = sharded.dtensors.find("block0.fc1.weight");
    ASSERT_NE(fc1, nullptr);
    EXPECT_EQ(fc1->sizes(), reference->named_parameters()["block0.fc1.weight"].sizes().vec());
    EXPECT_NE(sharded.tensors.find("in.weight"), nullptr);
    testing::TPNet reloaded(*other, mesh);
    LoadShardedStateDict(*reloaded, sharded);
    const FullStateDict third = GetFullStateDict(*reloaded);
    for (const auto& item : reference->named_parameters()) {
      EXPECT_TRUE(at::equal(third[item.key()], item.value())) << item.key();
    }
  });
}

TEST(StateDictErrors, LoadNamesMissingUnexpectedAndMisshapenKeys) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    Net model = ShardedNet(mesh);
    FullStateDict bad = GetFullStateDict(*model);
    bad.erase("head.bias");
    bad.insert("head.scale", at::ones({1}));
    bad["in.weight"] = at::zeros({4, 3});
    EXPECT_ERROR_CONTAINS(LoadFullStateDict(*model, bad), "Missing key(s) in state_dict: head.bias.");
    EXPECT_ERROR_CONTAINS(LoadFullStateDict(*model, bad), "Unexpected key(s) in state_dict: head.scale.");
    EXPECT_ERROR_CONTAINS(LoadFullStateDict(*model, bad),
                          "size mismatch for in.weight: copying a param with shape [4, 3] from checkpoint, the "
                          "shape in current model is [5, 3].");
    // Broadcast from rank 0: every rank fails, rank 0 with the reason.
    const FullStateDict mine = pg->rank() == 0 ? bad : FullStateDict();
    const std::string reason = pg->rank() == 0 ? "Missing key(s) in state_dict: head.bias." : "see rank 0's error";
    EXPECT_ERROR_CONTAINS(LoadFullStateDict(*model, mine, {.rank0_only = true}), reason);

    ShardedStateDict sharded = GetShardedStateDict(*model);
    ShardedStateDict plain;
    plain.tensors.insert("in.weight", at::zeros({5, 3}));
    EXPECT_ERROR_CONTAINS(LoadShardedStateDict(*model, plain), "in.weight is sharded by FSDP and needs a DTensor");
    auto other = mesh::DeviceMesh::Create(pg, {1, 2}, {"replicate", "shard"});
    sharded.dtensors["in.bias"] = dtensor::distribute_tensor(
        at::zeros({5}), other, {dtensor::Placement::Replicate(), dtensor::Placement::Replicate()});
    EXPECT_ERROR_CONTAINS(LoadShardedStateDict(*model, sharded), "in.bias: the checkpoint's mesh");
  });
}

TEST(StateDictErrors, WeightsTiedAcrossGroupsAreRejectedAtFullyShard) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    Net model;
    model->register_module("reader", testing::TiedLinear(model->layers[0]->fc1->weight));
    for (auto& b : model->layers) fully_shard(b.ptr(), {.mesh = mesh});
    EXPECT_ERROR_CONTAINS(fully_shard(model.ptr(), {.mesh = mesh}),
                          "parameter 'reader.weight' is the same tensor as 'block0.fc1.weight'");
  });
}

}  // namespace
}  // namespace fsdp::fsdp2
