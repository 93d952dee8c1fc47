// Optimizer state dicts: torch::optim round trips through the FQN-keyed format and a file,
// their errors, and FSDP2 resharding (saved at one world size, continued at another, equal
// to uninterrupted training on one rank).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "fsdp/fsdp1/flat_param.h"
#include "fsdp/fsdp1/state_dict.h"
#include "fsdp/fsdp1/test_models.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/fsdp2/test_models.h"
#include "optim_state/fsdp1_optim_state.h"
#include "optim_state/fsdp2_optim_state.h"
#include "optim_state/optim_state_dict.h"
#include "testing/allocation_counter.h"
#include "testing/expect_error.h"
#include "testing/float_tolerance.h"
#include "testing/multi_rank.h"
#include "testing/test_dir.h"

namespace fsdp::optim_state {
namespace {

using fsdp::testing::Backend;
using fsdp2::testing::InitDeterministic;
using fsdp2::testing::Net;
using fsdp2::testing::NetOptions;
using fsdp2::testing::TrainSteps;
using fsdp2::testing::UniqueParameters;

NamedParams Named(torch::nn::Module& m) {
  NamedParams out;
  for (const auto& item : m.named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

void ExpectSameState(const OptimStateDict& a, const OptimStateDict& b) {
  EXPECT_EQ(a.optimizer, b.optimizer);
  ASSERT_EQ(a.state.size(), b.state.size());
  for (const auto& [fqn, values] : a.state) {
    ASSERT_TRUE(b.state.count(fqn)) << fqn;
    const auto& other = b.state.at(fqn);
    ASSERT_EQ(values.size(), other.size()) << fqn;
    for (const auto& [name, value] : values) {
      ASSERT_TRUE(other.count(name)) << fqn << " " << name;
      if (const auto* t = std::get_if<at::Tensor>(&value)) {
        EXPECT_TRUE(at::equal(*t, std::get<at::Tensor>(other.at(name)))) << fqn << " " << name;
      } else if (const auto* i = std::get_if<int64_t>(&value)) {
        EXPECT_EQ(*i, std::get<int64_t>(other.at(name))) << fqn << " " << name;
      } else {
        EXPECT_EQ(std::get<double>(value), std::get<double>(other.at(name))) << fqn << " " << name;
      }
    }
  }
  ASSERT_EQ(a.param_groups.size(), b.param_groups.size());
  for (size_t g = 0; g < a.param_groups.size(); ++g) {
    EXPECT_EQ(a.param_groups[g].params, b.param_groups[g].params);
    EXPECT_EQ(a.param_groups[g].options.size(), b.param_groups[g].options.size());
    for (const auto& [key, value] : a.param_groups[g].options) {
      ASSERT_TRUE(b.param_groups[g].options.count(key)) << key;
      EXPECT_TRUE(value == b.param_groups[g].options.at(key)) << key;
    }
  }
}

TEST(OptimStateDict, AdamWAndSgdRoundTripThroughTheFormatAndAFile) {
  Net model;
  InitDeterministic(*model);
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2).amsgrad(true).weight_decay(0.05));
  TrainSteps(model, adamw, 0, 2, 1, 0);
  const OptimStateDict saved = GetOptimStateDict(adamw, Named(*model));
  EXPECT_EQ(saved.optimizer, "AdamW");
  EXPECT_EQ(saved.state.size(), model->parameters().size());
  const auto& in_w = saved.state.at("in.weight");
  EXPECT_EQ(Classify(in_w.at("exp_avg")), StateKind::kPositiveDimTensor);
  EXPECT_EQ(Classify(in_w.at("step")), StateKind::kNonTensor);
  EXPECT_EQ(std::get<int64_t>(in_w.at("step")), 2);
  EXPECT_EQ(Classify(StateValue(at::scalar_tensor(3.0))), StateKind::kZeroDimTensor);

  const std::string path = fsdp::testing::NewTestPath("adamw_state");
  SaveOptimStateDict(saved, path);
  const OptimStateDict loaded = LoadOptimStateDict(path);
  std::remove(path.c_str());
  ExpectSameState(saved, loaded);
  EXPECT_DOUBLE_EQ(loaded.param_groups[0].options.at("weight_decay").toDouble(), 0.05);

  // Into a fresh optimizer: the next step equals the original optimizer's next step.
  Net twin;
  {
    at::NoGradGuard no_grad;
    for (const auto& item : model->named_parameters()) twin->named_parameters()[item.key()].copy_(item.value());
  }
  torch::optim::AdamW fresh(twin->parameters(), torch::optim::AdamWOptions(0.5));
  SetOptimStateDict(fresh, Named(*twin), loaded);
  EXPECT_DOUBLE_EQ(static_cast<torch::optim::AdamWOptions&>(fresh.param_groups()[0].options()).lr(), 1e-2);
  TrainSteps(model, adamw, 2, 1, 1, 0);
  TrainSteps(twin, fresh, 2, 1, 1, 0);
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(at::equal(item.value(), twin->named_parameters()[item.key()])) << item.key();
  }

  // Rekeying by parameter ID (position in the groups) and back.
  const auto by_id = StateById(saved);
  EXPECT_EQ(by_id.size(), saved.state.size());
  EXPECT_TRUE(at::equal(std::get<at::Tensor>(by_id.at(1).at("exp_avg")),
                        std::get<at::Tensor>(saved.state.at(saved.param_groups[0].params[1]).at("exp_avg"))));
  ExpectSameState(saved, FromStateById(saved.optimizer, saved.param_groups, by_id));
  EXPECT_ERROR_CONTAINS(FromStateById("AdamW", saved.param_groups, {{99, {}}}), "parameter ID 99 is not in [0, 13)");

  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  TrainSteps(model, sgd, 0, 2, 1, 0);
  const OptimStateDict momentum = GetOptimStateDict(sgd, Named(*model));
  EXPECT_EQ(momentum.state.at("head.bias").count("momentum_buffer"), 1u);
  torch::optim::SGD sgd2(model->parameters(), torch::optim::SGDOptions(0.3));
  SetOptimStateDict(sgd2, Named(*model), momentum);
  ExpectSameState(momentum, GetOptimStateDict(sgd2, Named(*model)));
}

TEST(OptimStateDict, BadInputIsReportedWithTheOffendingValue) {
  Net model;
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
  TrainSteps(model, adamw, 0, 1, 1, 0);
  const OptimStateDict good = GetOptimStateDict(adamw, Named(*model));
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  EXPECT_ERROR_CONTAINS(SetOptimStateDict(sgd, Named(*model), good),
                        "the optimizer state is for AdamW but the optimizer is SGD");
  OptimStateDict unknown = good;
  unknown.state["nope.weight"] = unknown.state.at("in.weight");
  EXPECT_ERROR_CONTAINS(SetOptimStateDict(adamw, Named(*model), unknown),
                        "has state for 'nope.weight', which is not a parameter of the optimizer");
  OptimStateDict misshapen = good;
  misshapen.state.at("in.weight").at("exp_avg") = at::zeros({2, 2});
  EXPECT_ERROR_CONTAINS(SetOptimStateDict(adamw, Named(*model), misshapen),
                        "optimizer state 'exp_avg' of 'in.weight' has shape [2, 2] but the parameter has shape [5, 3]");
  OptimStateDict missing = good;
  missing.state.at("head.bias").erase("exp_avg_sq");
  EXPECT_ERROR_CONTAINS(SetOptimStateDict(adamw, Named(*model), missing),
                        "optimizer state of 'head.bias' has no 'exp_avg_sq'");
  EXPECT_ERROR_CONTAINS(GetOptimStateDict(adamw, {}),
                        "optimizer param group 0 parameter 0 (shape [6]) is not among the named parameters");
  const std::string path = fsdp::testing::NewTestPath("not_a_state");
  {
    std::ofstream out(path, std::ios::binary);
    out << "garbage, not a pickle";
  }
  EXPECT_ERROR_CONTAINS(LoadOptimStateDict(path), "");
  std::remove(path.c_str());
}

// Training 6 steps is the reference; the FSDP run stops after 3 at world size `from`, saves
// model and optimizer state (rank 0 only), and continues at world size `to`.
void ReshardAndContinue(int from, int to) {
  Net ref;
  InitDeterministic(*ref);
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  TrainSteps(ref, ref_opt, 0, 6, 1, 0);

  const std::string model_path = fsdp::testing::NewTestPath(absl::StrCat("model_", from, "_", to));
  const std::string optim_path = fsdp::testing::NewTestPath(absl::StrCat("optim_", from, "_", to));
  fsdp::testing::RunOnRanks(Backend::kThreaded, from, [&](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {from});
    Net model;
    InitDeterministic(*model);
    for (auto& b : model->layers) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
    fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
    torch::optim::AdamW opt(UniqueParameters(*model), torch::optim::AdamWOptions(1e-2));
    TrainSteps(model, opt, 0, 3, from, pg->rank());
    const auto full_model = fsdp2::GetFullStateDict(*model, {.rank0_only = true});
    const OptimStateDict full_optim = GetFullOptimStateDict(*model, opt, /*rank0_only=*/true);
    if (pg->rank() != 0) {
      EXPECT_TRUE(full_optim.state.empty());
      return;
    }
    EXPECT_EQ(std::get<at::Tensor>(full_optim.state.at("in.weight").at("exp_avg")).sizes(), (c10::IntArrayRef{5, 3}));
    fsdp2::SaveFullStateDict(full_model, model_path);
    SaveOptimStateDict(full_optim, optim_path);
  });
  fsdp::testing::RunOnRanks(Backend::kThreaded, to, [&](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {to});
    Net model;
    InitDeterministic(*model, /*seed=*/99);
    for (auto& b : model->layers) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
    fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
    torch::optim::AdamW opt(UniqueParameters(*model), torch::optim::AdamWOptions(0.5));
    fsdp2::LoadFullStateDict(*model, fsdp2::LoadFullStateDictFile(model_path));
    LoadFullOptimStateDict(*model, opt, LoadOptimStateDict(optim_path));
    TrainSteps(model, opt, 3, 3, to, pg->rank());
    const auto full = fsdp2::GetFullStateDict(*model);
    for (const auto& item : ref->named_parameters()) {
      const double scale = std::max(1.0, item.value().abs().max().item<double>());
      // Sliced vs whole-batch gradient sums through the 6 AdamW steps (3 + 3) at lr 1e-2.
      EXPECT_LE((full[item.key()] - item.value()).abs().max().item<double>(),
                fsdp::testing::AdamWParityTolerance(6, /*lr=*/1e-2) * scale)
          << item.key() << " " << from << " -> " << to << " rank " << pg->rank();
    }
  });
  std::remove(model_path.c_str());
  std::remove(optim_path.c_str());
}

TEST(Fsdp2OptimState, SavedAtOneWorldSizeContinuesAtAnother) {
  ReshardAndContinue(2, 3);
  ReshardAndContinue(4, 1);
  ReshardAndContinue(1, 4);
}

// PyTorch's worked example: a.w (2x3) and b.w (4) flatten to 10 elements. The unsharded
// AdamW state (the reference), flattened by hand and chunked as torch.chunk does (W=2: 5 and
// 5; W=4: 3, 3, 3, 1 + 2 zeros), is each rank's flat state; gathering it back gives the
// reference state bitwise.
TEST(Fsdp1OptimState, WorkedExampleShardsAndConsolidatesLikeTheUnshardedOptimizer) {
  auto root = std::make_shared<torch::nn::Module>();
  auto a = root->register_module("a", std::make_shared<torch::nn::Module>());
  auto b = root->register_module("b", std::make_shared<torch::nn::Module>());
  at::Tensor aw = a->register_parameter("w", at::randn({2, 3}, at::make_generator<at::CPUGeneratorImpl>(1)));
  at::Tensor bw = b->register_parameter("w", at::randn({4}, at::make_generator<at::CPUGeneratorImpl>(2)));
  torch::optim::AdamW adamw({aw, bw}, torch::optim::AdamWOptions(0.1));
  for (int step = 0; step < 2; ++step) {
    (aw.square().sum() + (bw * 3).sin().sum()).backward();
    adamw.step();
    adamw.zero_grad();
  }
  const OptimStateDict ref = GetOptimStateDict(adamw, {{"a.w", aw}, {"b.w", bw}});
  for (int world : {2, 4}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
      // A copy of the tree per rank: the handle takes its parameters over.
      auto r = std::make_shared<torch::nn::Module>();
      auto ra = r->register_module("a", std::make_shared<torch::nn::Module>());
      auto rb = r->register_module("b", std::make_shared<torch::nn::Module>());
      at::Tensor raw = ra->register_parameter("w", aw.detach().clone());
      at::Tensor rbw = rb->register_parameter("w", bw.detach().clone());
      fsdp1::FlatParamHandleOptions options;
      options.process_group = pg;
      fsdp1::FlatParamHandle handle({raw, rbw}, *r, options);
      handle.Shard();
      const int64_t chunk = (10 + world - 1) / world;
      const StateMap flat = FlattenOptimState(handle, ref.state, pg->rank(), world);
      for (const char* name : {"exp_avg", "exp_avg_sq"}) {
        const at::Tensor cat = at::cat({std::get<at::Tensor>(ref.state.at("a.w").at(name)).reshape(-1),
                                        std::get<at::Tensor>(ref.state.at("b.w").at(name)).reshape(-1)});
        const int64_t start = std::min<int64_t>(10, pg->rank() * chunk), end = std::min<int64_t>(10, start + chunk);
        const at::Tensor expected = at::constant_pad_nd(cat.narrow(0, start, end - start), {0, chunk - (end - start)});
        EXPECT_TRUE(at::equal(std::get<at::Tensor>(flat.at(name)), expected))
            << name << " W=" << world << " rank " << pg->rank();
      }
      EXPECT_EQ(std::get<int64_t>(flat.at("step")), 2);
      const auto consolidated = UnflattenOptimState(handle, flat, pg);
      ASSERT_EQ(consolidated.size(), 2u);
      for (const char* fqn : {"a.w", "b.w"}) {
        for (const auto& [name, value] : ref.state.at(fqn)) {
          if (const auto* t = std::get_if<at::Tensor>(&value)) {
            EXPECT_TRUE(at::equal(std::get<at::Tensor>(consolidated.at(fqn).at(name)), *t)) << fqn << " " << name;
          } else {
            EXPECT_EQ(std::get<int64_t>(consolidated.at(fqn).at(name)), std::get<int64_t>(value)) << fqn << " " << name;
          }
        }
      }
      // PyTorch's errors.
      auto bad = ref.state;
      bad.at("b.w").erase("exp_avg_sq");
      EXPECT_ERROR_CONTAINS(FlattenOptimState(handle, bad, pg->rank(), world),
                            "Differing optimizer state names for the unflattened parameters: [a.w, b.w]");
      bad = ref.state;
      bad.at("b.w").at("step") = int64_t{3};
      EXPECT_ERROR_CONTAINS(
          FlattenOptimState(handle, bad, pg->rank(), world),
          "must have scalar state with the same value and dtype but got values {2, 3} for state step");
      bad = ref.state;
      bad.at("a.w").at("exp_avg") = at::zeros({3, 2});
      EXPECT_ERROR_CONTAINS(FlattenOptimState(handle, bad, pg->rank(), world),
                            "Tensor optimizer state does not have same shape as its parameter: [3, 2] [2, 3]");
      bad = ref.state;
      bad.at("a.w").at("step") = at::scalar_tensor(2.0);
      EXPECT_ERROR_CONTAINS(FlattenOptimState(handle, bad, pg->rank(), world),
                            "Differing optimizer state types for state step");
      bad = ref.state;
      bad.erase("b.w");  // no state for b.w: its moments are zero-filled, but step is missing
      EXPECT_ERROR_CONTAINS(FlattenOptimState(handle, bad, pg->rank(), world), "{2, None} for state step");
    });
  }
}

// rank0_only: the other ranks get an empty dict and never hold the full state: measured as
// the peak CPU bytes each rank allocates during the call (a big parameter dominates).
TEST(Fsdp2OptimState, RankZeroOnlyKeepsOtherRanksBelowOneFullState) {
  fsdp::testing::ScopedAllocationCounter::Install();  // before the rank threads allocate
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {3});
    Net model(NetOptions{.hidden = 3000});  // block fc1/fc2: 2 x 15000 floats each
    for (auto& b : model->layers) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
    fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
    torch::optim::AdamW opt(UniqueParameters(*model), torch::optim::AdamWOptions(1e-3));
    TrainSteps(model, opt, 0, 1, 3, pg->rank());
    int64_t full_bytes = 0;  // exp_avg + exp_avg_sq of every parameter, unsharded
    for (const auto& item : Net(NetOptions{.hidden = 3000})->named_parameters())
      full_bytes += 2 * item.value().nbytes();
    fsdp::testing::ScopedAllocationCounter counter;
    const OptimStateDict full = GetFullOptimStateDict(*model, opt, /*rank0_only=*/true);
    if (pg->rank() == 0) {
      EXPECT_EQ(full.state.size(), 13u);
      EXPECT_GE(counter.peak(), full_bytes);
    } else {
      EXPECT_TRUE(full.state.empty());
      EXPECT_LT(counter.peak(), full_bytes / 2) << "rank " << pg->rank();
    }
  });
}

// Checkpoints move between the FSDPs and world sizes: train 3 steps with one (rank 0 saves
// the full model and optimizer state to files), continue 5 steps with another; the result
// equals 8 uninterrupted steps on one rank.
enum class Flavor { kFsdp1, kFsdp2 };

struct Continuation {
  Flavor from;
  int from_world;
  Flavor to;
  int to_world;
};

template <class Fn>
void WithFsdp1(const comm::ProcessGroupPtr& pg, uint64_t seed, Fn&& fn) {
  fsdp1::testing::Net model;
  fsdp1::testing::InitDeterministic(*model, seed);
  fsdp1::FSDPOptions options{.process_group = pg};
  for (auto& b : model->layers) fsdp1::wrap_fsdp(b.ptr(), options);
  fsdp1::FullyShardedDataParallel root = fsdp1::wrap_fsdp(model.ptr(), options);
  torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(1e-2));
  fn(model, root, opt);
}

template <class Fn>
void WithFsdp2(const comm::ProcessGroupPtr& pg, uint64_t seed, Fn&& fn) {
  auto mesh = mesh::DeviceMesh::Create(pg, {pg->size()});
  Net model;
  InitDeterministic(*model, seed);
  for (auto& b : model->layers) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
  fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
  torch::optim::AdamW opt(UniqueParameters(*model), torch::optim::AdamWOptions(1e-2));
  fn(model, opt);
}

void CheckpointAcrossFsdps(const Continuation& c) {
  Net ref;
  InitDeterministic(*ref);
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  TrainSteps(ref, ref_opt, 0, 8, 1, 0);
  const std::string label = absl::StrCat(c.from == Flavor::kFsdp1 ? "fsdp1" : "fsdp2", "_w", c.from_world, "_to_",
                                         c.to == Flavor::kFsdp1 ? "fsdp1" : "fsdp2", "_w", c.to_world);
  const std::string model_path = fsdp::testing::NewTestPath("model_" + label),
                    optim_path = fsdp::testing::NewTestPath("optim_" + label);
  fsdp::testing::RunOnRanks(Backend::kThreaded, c.from_world, [&](const comm::ProcessGroupPtr& pg) {
    auto save = [&](const fsdp2::FullStateDict& model_sd, const OptimStateDict& optim_sd) {
      if (pg->rank() != 0) return;
      fsdp2::SaveFullStateDict(model_sd, model_path);
      SaveOptimStateDict(optim_sd, optim_path);
    };
    if (c.from == Flavor::kFsdp1) {
      WithFsdp1(pg, 11, [&](auto& model, fsdp1::FullyShardedDataParallel& root, torch::optim::AdamW& opt) {
        TrainSteps(model, opt, 0, 3, c.from_world, pg->rank());
        const auto model_sd = fsdp1::GetFullStateDict(root, /*rank0_only=*/true);
        save(model_sd, GetFullOptimStateDict(root, opt, /*rank0_only=*/true));
      });
    } else {
      WithFsdp2(pg, 11, [&](Net& model, torch::optim::AdamW& opt) {
        TrainSteps(model, opt, 0, 3, c.from_world, pg->rank());
        const auto model_sd = fsdp2::GetFullStateDict(*model, {.rank0_only = true});
        save(model_sd, GetFullOptimStateDict(*model, opt, /*rank0_only=*/true));
      });
    }
  });
  fsdp::testing::RunOnRanks(Backend::kThreaded, c.to_world, [&](const comm::ProcessGroupPtr& pg) {
    fsdp2::FullStateDict result;
    if (c.to == Flavor::kFsdp1) {
      WithFsdp1(pg, 99, [&](auto& model, fsdp1::FullyShardedDataParallel& root, torch::optim::AdamW& opt) {
        fsdp1::LoadFullStateDict(root, fsdp2::LoadFullStateDictFile(model_path));
        LoadFullOptimStateDict(root, opt, LoadOptimStateDict(optim_path));
        TrainSteps(model, opt, 3, 5, c.to_world, pg->rank());
        result = fsdp1::GetFullStateDict(root);
      });
    } else {
      WithFsdp2(pg, 99, [&](Net& model, torch::optim::AdamW& opt) {
        // Only rank 0 reads the files: the model state by rank0_only broadcast, the optimizer
        // state by BroadcastOptimStateDict (PyTorch's scatter from rank 0).
        const bool reader = pg->rank() == 0;
        fsdp2::LoadFullStateDict(*model, reader ? fsdp2::LoadFullStateDictFile(model_path) : fsdp2::FullStateDict(),
                                 {.rank0_only = true});
        LoadFullOptimStateDict(*model, opt,
                               BroadcastOptimStateDict(reader ? LoadOptimStateDict(optim_path) : OptimStateDict{}, pg));
        TrainSteps(model, opt, 3, 5, c.to_world, pg->rank());
        result = fsdp2::GetFullStateDict(*model);
      });
    }
    for (const auto& item : ref->named_parameters()) {
      const double scale = std::max(1.0, item.value().abs().max().item<double>());
      // Sliced vs whole-batch gradient sums through the 8 AdamW steps (3 + 5) at lr 1e-2.
      EXPECT_LE((result[item.key()] - item.value()).abs().max().item<double>(),
                fsdp::testing::AdamWParityTolerance(8, /*lr=*/1e-2) * scale)
          << item.key() << " " << label << " rank " << pg->rank();
    }
  });
  std::remove(model_path.c_str());
  std::remove(optim_path.c_str());
}

TEST(CrossFsdpOptimState, CheckpointsMoveBetweenFsdp1AndFsdp2AtAnyWorldSize) {
  CheckpointAcrossFsdps({Flavor::kFsdp1, 4, Flavor::kFsdp2, 3});
  CheckpointAcrossFsdps({Flavor::kFsdp2, 2, Flavor::kFsdp1, 4});
  CheckpointAcrossFsdps({Flavor::kFsdp1, 1, Flavor::kFsdp1, 4});
  CheckpointAcrossFsdps({Flavor::kFsdp1, 4, Flavor::kFsdp1, 1});
  CheckpointAcrossFsdps({Flavor::kFsdp1, 3, Flavor::kFsdp1, 2});
}

TEST(Fsdp2OptimState, RanksThatDisagreeOnStateAllFail) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    Net model;
    for (auto& b : model->layers) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
    fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
    torch::optim::AdamW opt(UniqueParameters(*model), torch::optim::AdamWOptions(1e-3));
    TrainSteps(model, opt, 0, 1, 2, pg->rank());
    auto& state = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(model->in->weight.unsafeGetTensorImpl()));
    if (pg->rank() == 1) state.step(7);
    EXPECT_ERROR_CONTAINS(GetFullOptimStateDict(*model, opt),
                          "scalar optimizer state 'step' of 'in.weight' differs across ranks (from 1 to 7");
    state.step(1);
    if (pg->rank() == 1) opt.state().erase(model->head->bias.unsafeGetTensorImpl());
    EXPECT_ERROR_CONTAINS(GetFullOptimStateDict(*model, opt),
                          "some ranks have optimizer state for 'head.bias' and others do not");
  });
}

}  // namespace
}  // namespace fsdp::optim_state
