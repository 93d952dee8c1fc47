// Optimizer state is matched by FQN, never by position: a full optimizer state dict saved
// under one wrapping, FSDP and world size loads under another (the blocks grouped into FSDP1
// units differently, FSDP1 <-> FSDP2, param groups listed in another order), and training
// continues exactly as one uninterrupted run. As PyTorch 2.15 FSDP1 loads a state saved under
// test_fsdp_optim_state.py's `wrap_alt`; errors name original parameter FQNs.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "fsdp/common/test_models.h"
#include "fsdp/fsdp1/flat_param.h"
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"
#include "fsdp/fsdp1/state_dict.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "mesh/device_mesh.h"
#include "optim_state/fsdp1_optim_state.h"
#include "optim_state/fsdp2_optim_state.h"
#include "optim_state/optim_state_dict.h"
#include "testing/expect_error.h"
#include "testing/float_tolerance.h"
#include "testing/multi_rank.h"

namespace fsdp::optim_state {
namespace {

using fsdp::testing::Backend;
using test_models::Net;
using test_models::NetOptions;

constexpr NetOptions kNet{.blocks = 3};

// How the model is sharded: FSDP1 with every block its own unit, FSDP1 with only block1 its
// own unit (block0 and block2 join the root's flat parameter, so the flat parameters hold
// other FQNs in another order), or FSDP2 per block.
enum class Wrap { kFsdp1EachBlock, kFsdp1Block1Only, kFsdp2 };

// Param groups: one group, or the blocks' parameters (lr 1e-2) and the rest (lr 2e-2), listed
// blocks-first or rest-first.
enum class Groups { kOne, kBlocksFirst, kRestFirst };

bool InBlock(const std::string& fqn) { return absl::StartsWith(fqn, "block"); }

// Each optimizer parameter with the original FQNs it stands for (several for a flat parameter).
using NamedByPath = std::vector<std::pair<std::vector<std::string>, at::Tensor>>;

// An AdamW over `named` in `groups`: lr 1e-2 for the blocks' group (or the one group), 2e-2
// for the rest; with `placeholder` every group starts at lr 0.5, so only a loaded state gives
// the right ones.
std::unique_ptr<torch::optim::AdamW> MakeOptimizer(const NamedByPath& named, Groups groups, bool placeholder) {
  std::vector<at::Tensor> blocks, rest;
  for (const auto& [fqns, p] : named) {
    const bool block = groups == Groups::kOne || InBlock(fqns.front());
    for (const auto& fqn : fqns) {
      TORCH_CHECK(groups == Groups::kOne || InBlock(fqn) == block, "a flat parameter spans both groups: ", fqn);
    }
    (block ? blocks : rest).push_back(p);
  }
  auto lr = [&](double real) { return std::make_unique<torch::optim::AdamWOptions>(placeholder ? 0.5 : real); };
  std::vector<torch::optim::OptimizerParamGroup> out;
  if (groups == Groups::kRestFirst) out.emplace_back(rest, lr(2e-2));
  out.emplace_back(blocks, lr(1e-2));
  if (groups == Groups::kBlocksFirst) out.emplace_back(rest, lr(2e-2));
  return std::make_unique<torch::optim::AdamW>(out, torch::optim::AdamWOptions(0.5));
}

// A wrapped model on one rank, with Get / Load of full model + optimizer state.
struct Wrapped {
  Net model{kNet};
  std::unique_ptr<fsdp1::FullyShardedDataParallel> root;  // FSDP1 only
  std::unique_ptr<torch::optim::AdamW> opt;

  Wrapped(Wrap wrap, Groups groups, const comm::ProcessGroupPtr& pg, uint64_t seed, bool placeholder) {
    test_models::InitDeterministic(*model, seed);
    NamedByPath named;
    if (wrap == Wrap::kFsdp2) {
      auto mesh = mesh::DeviceMesh::Create(pg, {pg->size()});
      for (auto& b : model->layers) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
      fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
      for (const auto& [fqn, p] : NamedOptimizerParams(*model)) named.push_back({{fqn}, p});
    } else {
      fsdp1::FSDPOptions options{.process_group = pg};
      for (size_t i = 0; i < model->layers.size(); ++i) {
        if (wrap == Wrap::kFsdp1EachBlock || i == 1) fsdp1::wrap_fsdp(model->layers[i].ptr(), options);
      }
      root = std::make_unique<fsdp1::FullyShardedDataParallel>(fsdp1::wrap_fsdp(model.ptr(), options));
      // The flat parameters (in the optimizer's order) with the FQNs each holds.
      for (const at::Tensor& p : root->parameters()) {
        named.push_back({{}, p});
        for (const fsdp1::FlatParamHandle* h : root->handles()) {
          if (!h->flat_param().param.is_same(p)) continue;
          std::string prefix;
          for (const auto& item : model->named_modules("", /*include_self=*/true)) {
            if (item.value().get() == &h->fully_sharded_module() && !item.key().empty()) prefix = item.key() + ".";
          }
          for (const auto& fqn : h->flat_param().fqns) named.back().first.push_back(prefix + fqn);
        }
      }
    }
    opt = MakeOptimizer(named, groups, placeholder);
  }

  void Train(int first, int steps, const comm::ProcessGroupPtr& pg) {
    test_models::TrainSteps(model, *opt, first, steps, pg->size(), pg->rank());
  }
  fsdp2::FullStateDict ModelState(bool rank0_only) {
    return root ? fsdp1::GetFullStateDict(*root, rank0_only)
                : fsdp2::GetFullStateDict(*model, {.rank0_only = rank0_only});
  }
  OptimStateDict OptimState(bool rank0_only) {
    return root ? GetFullOptimStateDict(*root, *opt, rank0_only) : GetFullOptimStateDict(*model, *opt, rank0_only);
  }
  void Load(const fsdp2::FullStateDict& model_sd, const OptimStateDict& optim_sd) {
    if (root) {
      fsdp1::LoadFullStateDict(*root, model_sd);
      LoadFullOptimStateDict(*root, *opt, optim_sd);
    } else {
      fsdp2::LoadFullStateDict(*model, model_sd);
      LoadFullOptimStateDict(*model, *opt, optim_sd);
    }
  }
};

struct Side {
  Wrap wrap;
  Groups groups;
  int world;
};

std::string Label(const Side& s) {
  const char* wrap[] = {"fsdp1_each_block", "fsdp1_block1_only", "fsdp2"};
  const char* groups[] = {"one_group", "blocks_first", "rest_first"};
  return absl::StrCat(wrap[static_cast<int>(s.wrap)], "/", groups[static_cast<int>(s.groups)], "/w", s.world);
}

// Train 3 steps under `from` (rank 0 keeps the full model and optimizer state), load it under
// `to` and train 5 more: equal to 8 uninterrupted steps of the unwrapped model with the same
// learning rate per FQN.
void SaveUnderOneLoadUnderAnother(const Side& from, const Side& to) {
  const std::string label = Label(from) + " -> " + Label(to);
  Net ref(kNet);
  test_models::InitDeterministic(*ref, 11);
  NamedByPath ref_named;
  for (const auto& item : ref->named_parameters()) ref_named.push_back({{item.key()}, item.value()});
  auto ref_opt = MakeOptimizer(ref_named, from.groups, /*placeholder=*/false);
  test_models::TrainSteps(ref, *ref_opt, 0, 8, 1, 0);

  fsdp2::FullStateDict model_sd;
  OptimStateDict optim_sd;
  fsdp::testing::RunOnRanks(Backend::kThreaded, from.world, [&](const comm::ProcessGroupPtr& pg) {
    Wrapped w(from.wrap, from.groups, pg, 11, /*placeholder=*/false);
    w.Train(0, 3, pg);
    auto m = w.ModelState(/*rank0_only=*/true);
    auto o = w.OptimState(/*rank0_only=*/true);
    if (pg->rank() == 0) {
      model_sd = std::move(m);
      optim_sd = std::move(o);
    }
  });
  fsdp::testing::RunOnRanks(Backend::kThreaded, to.world, [&](const comm::ProcessGroupPtr& pg) {
    Wrapped w(to.wrap, to.groups, pg, 99, /*placeholder=*/true);
    w.Load(model_sd, optim_sd);
    w.Train(3, 5, pg);
    fsdp2::FullStateDict result = w.ModelState(/*rank0_only=*/false);
    for (const auto& item : ref->named_parameters()) {
      const double scale = std::max(1.0, item.value().abs().max().item<double>());
      // Sliced vs whole-batch gradient sums through the 8 AdamW steps (3 + 5) at the larger lr, 2e-2.
      EXPECT_LE((result[item.key()] - item.value()).abs().max().item<double>(),
                fsdp::testing::AdamWParityTolerance(8, /*lr=*/2e-2) * scale)
          << item.key() << " " << label << " rank " << pg->rank();
    }
  });
}

// The case: FSDP1 blocks grouped into units differently (block0 and block2 in the
// root's unit vs each its own), at another world size, both ways.
TEST(ParamGroupMatching, Fsdp1LoadsUnderAnotherWrappingAndWorldSize) {
  SaveUnderOneLoadUnderAnother({Wrap::kFsdp1EachBlock, Groups::kOne, 4}, {Wrap::kFsdp1Block1Only, Groups::kOne, 2});
  SaveUnderOneLoadUnderAnother({Wrap::kFsdp1Block1Only, Groups::kOne, 3}, {Wrap::kFsdp1EachBlock, Groups::kOne, 4});
}

// Two param groups with their own lr, listed in the other order by the loading optimizer:
// each group's lr goes to the group holding its FQNs.
TEST(ParamGroupMatching, GroupsMatchByFqnAcrossFsdp1AndFsdp2) {
  SaveUnderOneLoadUnderAnother({Wrap::kFsdp1EachBlock, Groups::kBlocksFirst, 4},
                               {Wrap::kFsdp1EachBlock, Groups::kRestFirst, 2});
  SaveUnderOneLoadUnderAnother({Wrap::kFsdp1EachBlock, Groups::kBlocksFirst, 4}, {Wrap::kFsdp2, Groups::kRestFirst, 3});
  SaveUnderOneLoadUnderAnother({Wrap::kFsdp2, Groups::kRestFirst, 2}, {Wrap::kFsdp1EachBlock, Groups::kBlocksFirst, 4});
  SaveUnderOneLoadUnderAnother({Wrap::kFsdp2, Groups::kRestFirst, 2}, {Wrap::kFsdp2, Groups::kBlocksFirst, 1});
}

// A state saved at one rank (no FSDP collectives needed to build it).
OptimStateDict TwoGroupState() {
  OptimStateDict out;
  fsdp::testing::RunOnRanks(Backend::kThreaded, 1, [&](const comm::ProcessGroupPtr& pg) {
    Wrapped w(Wrap::kFsdp2, Groups::kBlocksFirst, pg, 11, /*placeholder=*/false);
    w.Train(0, 1, pg);
    out = w.OptimState(/*rank0_only=*/false);
  });
  return out;
}

// Errors only where a name is really missing, extra or grouped otherwise, each naming it
// (PyTorch 2.15 fails the split case too: "doesn't match the size of optimizer's group").
TEST(ParamGroupMatching, MissingExtraAndSplitNamesAreReportedByFqn) {
  const OptimStateDict saved = TwoGroupState();
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Wrapped fsdp1(Wrap::kFsdp1Block1Only, Groups::kOne, pg, 99, /*placeholder=*/true);
    EXPECT_ERROR_CONTAINS(LoadFullOptimStateDict(*fsdp1.root, *fsdp1.opt, saved),
                          "LoadFullOptimStateDict: the optimizer's param group 0 holds [");
    EXPECT_ERROR_CONTAINS(LoadFullOptimStateDict(*fsdp1.root, *fsdp1.opt, saved), "block0.fc1.weight, block0.fc1.bias");
    EXPECT_ERROR_CONTAINS(LoadFullOptimStateDict(*fsdp1.root, *fsdp1.opt, saved),
                          "] but the optimizer state splits them across its param groups");
    Wrapped fsdp2(Wrap::kFsdp2, Groups::kRestFirst, pg, 99, /*placeholder=*/true);
    OptimStateDict missing = saved;
    std::erase(missing.param_groups[1].params, "head.bias");
    EXPECT_ERROR_CONTAINS(LoadFullOptimStateDict(*fsdp2.model, *fsdp2.opt, missing),
                          "the optimizer's parameter 'head.bias' (param group 0) is in no param group of the "
                          "optimizer state");
    OptimStateDict extra = saved;
    extra.param_groups[0].params.push_back("block9.fc1.weight");
    EXPECT_ERROR_CONTAINS(LoadFullOptimStateDict(*fsdp2.model, *fsdp2.opt, extra),
                          "param group 0 of the optimizer state holds 'block9.fc1.weight', which is not a "
                          "parameter of the optimizer");
    EXPECT_ERROR_CONTAINS(LoadFullOptimStateDict(*fsdp1.root, *fsdp1.opt, extra),
                          "LoadFullOptimStateDict: param group 0 of the optimizer state holds 'block9.fc1.weight'");
  });
}

// Ranks that disagree on which flat parameters have state all fail, naming the original
// parameters of the flat parameter (as PyTorch's _check_missing_keys_on_rank names
// unflat_param_names), never an index.
TEST(ParamGroupMatching, MissingFlatStateErrorNamesTheOriginalParameters) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    Wrapped w(Wrap::kFsdp1EachBlock, Groups::kOne, pg, 11, /*placeholder=*/false);
    w.Train(0, 1, pg);
    for (const fsdp1::FlatParamHandle* h : w.root->handles()) {
      if (&h->fully_sharded_module() == w.model->layers[2].ptr().get() && pg->rank() == 1) {
        w.opt->state().erase(h->flat_param().param.unsafeGetTensorImpl());
      }
    }
    try {
      w.OptimState(/*rank0_only=*/false);
      ADD_FAILURE() << "no error on rank " << pg->rank();
    } catch (const c10::Error& e) {
      const std::string what = e.what();
      EXPECT_TRUE(absl::StrContains(what,
                                    "some ranks have optimizer state for '[block2.fc1.weight, "
                                    "block2.fc1.bias, block2.fc2.weight, block2.fc2.bias]' and others do not"))
          << what;
      EXPECT_FALSE(absl::StrContains(what, "flat parameter")) << what;
    }
  });
}

}  // namespace
}  // namespace fsdp::optim_state
