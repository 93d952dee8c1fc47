// FSDP1 optimizer state with use_orig_params: the optimizer holds the original parameters'
// sharded views, so each rank has state only for the parts in its shard. Full state dicts
// gather those parts (PyTorch's _allgather_orig_param_states), loading keeps this rank's part
// (_shard_orig_param_state); checkpoints move to another world size, to use_orig_params
// false and to FSDP2, and training continues exactly like uninterrupted training on one rank
// (the independent reference: plain AdamW on an unwrapped model).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "fsdp/common/test_models.h"
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"
#include "fsdp/fsdp1/state_dict.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "mesh/device_mesh.h"
#include "optim_state/fsdp1_optim_state.h"
#include "optim_state/fsdp2_optim_state.h"
#include "optim_state/optim_state_dict.h"
#include "testing/float_tolerance.h"
#include "testing/multi_rank.h"
#include "testing/test_dir.h"

namespace fsdp::optim_state {
namespace {

using fsdp::testing::Backend;
using test_models::InitDeterministic;
using test_models::Net;
using test_models::TrainSteps;

constexpr double kLr = 1e-2;

// Blocks wrapped, then the root; AdamW over root.parameters() (the originals with
// use_orig_params).
struct Fsdp1Run {
  Net model;
  fsdp1::FullyShardedDataParallel root;
  std::unique_ptr<torch::optim::AdamW> opt;
  Fsdp1Run(const comm::ProcessGroupPtr& pg, uint64_t seed, bool use_orig_params) {
    InitDeterministic(*model, seed);
    fsdp1::FSDPOptions options{.process_group = pg, .use_orig_params = use_orig_params};
    for (auto& b : model->layers) fsdp1::wrap_fsdp(b.ptr(), options);
    root = fsdp1::wrap_fsdp(model.ptr(), options);
    opt = std::make_unique<torch::optim::AdamW>(root.parameters(), torch::optim::AdamWOptions(kLr));
  }
};

void ExpectStateNear(const OptimStateDict& got, torch::optim::AdamW& ref_opt, Net& ref, const std::string& label) {
  NamedParams named;
  for (const auto& item : ref->named_parameters()) named.emplace_back(item.key(), item.value());
  const OptimStateDict want = GetOptimStateDict(ref_opt, named);
  ASSERT_EQ(got.state.size(), want.state.size()) << label;
  for (const auto& [fqn, values] : want.state) {
    ASSERT_TRUE(got.state.count(fqn)) << label << " " << fqn;
    const StateMap& mine = got.state.at(fqn);
    ASSERT_EQ(mine.size(), values.size()) << label << " " << fqn;
    for (const auto& [name, value] : values) {
      if (const auto* t = std::get_if<at::Tensor>(&value)) {
        const at::Tensor& g = std::get<at::Tensor>(mine.at(name));
        ASSERT_EQ(g.sizes(), t->sizes()) << label << " " << fqn << " " << name;
        // exp_avg and exp_avg_sq are running means of the gradients (of order 1 or below) and their
        // squares, linear in them, so they inherit the gradients' summation-order rounding, a few float32
        // ulps (2^-23) per step: 1e-6 is 8 ulps at scale 1, far below a lost or doubled gradient.
        EXPECT_LE((g - *t).abs().max().item<double>(), 1e-6) << label << " " << fqn << " " << name;
      } else {
        EXPECT_EQ(std::get<int64_t>(mine.at(name)), std::get<int64_t>(value)) << label << " " << fqn << " " << name;
      }
    }
  }
  EXPECT_EQ(got.param_groups.size(), 1u) << label;
  EXPECT_EQ(got.param_groups[0].params.size(), ref->parameters().size()) << label;
}

void ExpectParamsNear(fsdp2::FullStateDict& result, Net& ref, const std::string& label) {
  for (const auto& item : ref->named_parameters()) {
    const double scale = std::max(1.0, item.value().abs().max().item<double>());
    // Sliced vs whole-batch gradient sums through at most 8 AdamW steps (3 + 5) at kLr.
    EXPECT_LE((result[item.key()] - item.value()).abs().max().item<double>(),
              fsdp::testing::AdamWParityTolerance(8, kLr) * scale)
        << item.key() << " " << label;
  }
}

// Saved at W=2 with use_orig_params, continued at W=3 with use_orig_params true and false,
// under FSDP2 at W=3, and at W=2 from the sharded (local) state: all equal 8 steps on one rank.
TEST(Fsdp1OrigParamsOptimState, FullStateReshardsToEveryFlavorAndMatchesOneRank) {
  Net ref;
  InitDeterministic(*ref);
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(kLr));
  TrainSteps(ref, ref_opt, 0, 3, 1, 0);
  const std::string model_path = fsdp::testing::NewTestPath("orig_model"),
                    optim_path = fsdp::testing::NewTestPath("orig_optim");
  std::vector<OptimStateDict> sharded(2);
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Fsdp1Run run(pg, 11, /*use_orig_params=*/true);
    TrainSteps(run.model, *run.opt, 0, 3, 2, pg->rank());
    // Each rank's optimizer holds state only for the originals its shard touches: head.bias
    // (one element) lives on one rank, whose optimizer alone has state for it.
    const at::Tensor& bias = run.model->head->bias;
    EXPECT_EQ(run.opt->state().count(bias.unsafeGetTensorImpl()), bias.numel() > 0 ? 1u : 0u);
    at::Tensor holders = at::full({1}, bias.numel(), at::kLong);
    pg->all_reduce(holders, comm::ReduceOp::Sum())->wait();
    EXPECT_EQ(holders.item<int64_t>(), 1);
    const OptimStateDict all = GetFullOptimStateDict(run.root, *run.opt);
    ExpectStateNear(all, ref_opt, ref, absl::StrCat("gathered on rank ", pg->rank()));
    const auto model_sd = fsdp1::GetFullStateDict(run.root, /*rank0_only=*/true);
    const OptimStateDict optim_sd = GetFullOptimStateDict(run.root, *run.opt, /*rank0_only=*/true);
    sharded[pg->rank()] = GetShardedOptimStateDict(run.root, *run.opt);
    if (pg->rank() != 0) {
      EXPECT_TRUE(optim_sd.state.empty());
      return;
    }
    fsdp1::SaveFullStateDict(model_sd, model_path);
    SaveOptimStateDict(optim_sd, optim_path);
  });
  TrainSteps(ref, ref_opt, 3, 5, 1, 0);

  for (bool use_orig_params : {true, false}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
      Fsdp1Run run(pg, 99, use_orig_params);
      fsdp1::LoadFullStateDict(run.root, fsdp1::LoadFullStateDictFile(model_path));
      LoadFullOptimStateDict(run.root, *run.opt, LoadOptimStateDict(optim_path));
      TrainSteps(run.model, *run.opt, 3, 5, 3, pg->rank());
      auto result = fsdp1::GetFullStateDict(run.root);
      ExpectParamsNear(result, ref, absl::StrCat("fsdp1 w3 use_orig_params=", use_orig_params));
      ExpectStateNear(GetFullOptimStateDict(run.root, *run.opt), ref_opt, ref,
                      absl::StrCat("state after w3 use_orig_params=", use_orig_params));
    });
  }
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {3});
    Net model;
    InitDeterministic(*model, 99);
    for (auto& b : model->layers) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
    fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(kLr));
    fsdp2::LoadFullStateDict(*model, fsdp2::LoadFullStateDictFile(model_path));
    LoadFullOptimStateDict(*model, opt, LoadOptimStateDict(optim_path));
    TrainSteps(model, opt, 3, 5, 3, pg->rank());
    auto result = fsdp2::GetFullStateDict(*model);
    ExpectParamsNear(result, ref, "fsdp2 w3");
  });
  // The sharded state: each rank's own parts, back into the same wrapping at the same size.
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Fsdp1Run run(pg, 99, /*use_orig_params=*/true);
    fsdp1::LoadFullStateDict(run.root, fsdp1::LoadFullStateDictFile(model_path));
    LoadShardedOptimStateDict(run.root, *run.opt, sharded[pg->rank()]);
    TrainSteps(run.model, *run.opt, 3, 5, 2, pg->rank());
    auto result = fsdp1::GetFullStateDict(run.root);
    ExpectParamsNear(result, ref, "sharded w2");
  });
  std::remove(model_path.c_str());
  std::remove(optim_path.c_str());
}

// A checkpoint of use_orig_params false (W=3) loads into use_orig_params true (W=2).
TEST(Fsdp1OrigParamsOptimState, FlatParamCheckpointLoadsIntoOriginalParams) {
  Net ref;
  InitDeterministic(*ref);
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(kLr));
  TrainSteps(ref, ref_opt, 0, 6, 1, 0);
  fsdp2::FullStateDict model_sd;
  OptimStateDict optim_sd;
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
    Fsdp1Run run(pg, 11, /*use_orig_params=*/false);
    TrainSteps(run.model, *run.opt, 0, 2, 3, pg->rank());
    auto m = fsdp1::GetFullStateDict(run.root, /*rank0_only=*/true);
    auto o = GetFullOptimStateDict(run.root, *run.opt, /*rank0_only=*/true);
    if (pg->rank() == 0) model_sd = m, optim_sd = o;
  });
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Fsdp1Run run(pg, 99, /*use_orig_params=*/true);
    fsdp1::LoadFullStateDict(run.root, model_sd);
    LoadFullOptimStateDict(run.root, *run.opt, optim_sd);
    TrainSteps(run.model, *run.opt, 2, 4, 2, pg->rank());
    auto result = fsdp1::GetFullStateDict(run.root);
    ExpectParamsNear(result, ref, "flat w3 -> orig w2");
  });
}

}  // namespace
}  // namespace fsdp::optim_state
