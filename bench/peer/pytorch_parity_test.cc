// Our FSDP2 vs PyTorch's own FSDP2 (the venv's torch, a separate Python process group over
// gloo) on the same model, initial weights and data: after 10 AdamW steps every parameter and
// its AdamW state (exp_avg, exp_avg_sq, step) agree within f32 tolerance, at 2 and 4 ranks.
// Skipped, with the reason, when ./x setup could not provide a Python torch
// (FSDP_PEER_PYTHON unset).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "fsdp/per_param/fully_shard.h"
#include "fsdp/per_param/state_dict.h"
#include "fsdp/per_param/test_models.h"
#include "optim_state/fsdp2_optim_state.h"
#include "testing/multi_rank.h"

namespace fsdp {
namespace {

using per_param::FullStateDict;
using per_param::testing::Batch;
using per_param::testing::InitDeterministic;
using per_param::testing::Net;

constexpr int kSteps = 10;
constexpr double kLr = 1e-2;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir ? dir : "/tmp", "/", name, "_", getpid(), ".pt");
}

double MaxDiffOverScale(const at::Tensor& ours, const at::Tensor& theirs) {
  const double scale = std::max(1.0, theirs.abs().max().item<double>());
  return (ours.to(at::kDouble) - theirs.to(at::kDouble)).abs().max().item<double>() / scale;
}

TEST(PyTorchFsdp2Parity, ParametersAndAdamWStateMatchAfterTenSteps) {
  const char* python = std::getenv("FSDP_PEER_PYTHON");
  if (python == nullptr || *python == '\0') {
    GTEST_SKIP() << "FSDP_PEER_PYTHON is not set: ./x setup sets it once PyTorch (with its "
                    "dependencies) is installed in the peer venv";
  }
  for (int world : {2, 4}) {
    Net init;
    InitDeterministic(*init);
    FullStateDict input;
    for (const auto& item : init->named_parameters()) input.insert("param/" + item.key(), item.value().detach());
    for (int step = 0; step < kSteps; ++step) {  // the batches TrainSteps uses
      input.insert(absl::StrCat("x/", step), Batch(step, 12, 3, 1));
      input.insert(absl::StrCat("y/", step), Batch(step, 12, 1, 2));
    }
    input.insert("steps", at::full({1}, static_cast<double>(kSteps)));
    input.insert("lr", at::full({1}, kLr));
    const std::string in_path = TempPath("peer_in"), out_path = TempPath("peer_out");
    per_param::SaveFullStateDict(input, in_path);
    const std::string command = absl::StrCat(python, " bench/peer/fsdp2_peer.py --world ", world, " --input ",
                                             in_path, " --output ", out_path);
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
    const FullStateDict theirs = per_param::LoadFullStateDictFile(out_path);
    std::remove(in_path.c_str());
    std::remove(out_path.c_str());

    fsdp::testing::RunOnRanks(fsdp::testing::Backend::kGlooThreads, world, [&](const comm::ProcessGroupPtr& pg) {
      auto mesh = mesh::DeviceMesh::Create(pg, {world});
      Net model;
      InitDeterministic(*model);
      for (auto& b : model->layers) per_param::fully_shard(b.ptr(), {.mesh = mesh});
      per_param::fully_shard(model.ptr(), {.mesh = mesh});
      torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(kLr));
      per_param::testing::TrainSteps(model, opt, 0, kSteps, world, pg->rank());
      const FullStateDict params = per_param::GetFullStateDict(*model);
      const optim_state::OptimStateDict optim = optim_state::GetFullOptimStateDict(*model, opt);
      if (pg->rank() != 0) return;
      int compared = 0;
      for (const auto& item : params) {
        const std::string& fqn = item.key();
        EXPECT_LE(MaxDiffOverScale(item.value(), theirs["param/" + fqn]), 1e-5) << fqn << " W=" << world;
        const auto& state = optim.state.at(fqn);
        for (const char* name : {"exp_avg", "exp_avg_sq"}) {
          EXPECT_LE(MaxDiffOverScale(std::get<at::Tensor>(state.at(name)), theirs[absl::StrCat(name, "/", fqn)]), 1e-5)
              << name << " " << fqn << " W=" << world;
        }
        EXPECT_EQ(static_cast<double>(std::get<int64_t>(state.at("step"))), theirs["step/" + fqn].item<double>());
        ++compared;
      }
      EXPECT_EQ(compared, 13);
    });
  }
}

}  // namespace
}  // namespace fsdp
