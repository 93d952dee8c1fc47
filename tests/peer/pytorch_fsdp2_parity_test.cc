// Our FSDP2 vs PyTorch's own FSDP2 (the venv's torch, a separate Python process group over
// gloo; tests/peer/fsdp2_peer.py) on the same model, initial weights and data: after 10 AdamW
// steps every parameter and its AdamW state (exp_avg, exp_avg_sq, step) agree within f32
// tolerance, at 2 and 4 ranks. Skipped, with the reason, when ./x setup could not provide a
// Python torch (FSDP_PEER_PYTHON unset or not importable).
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/fsdp2/test_models.h"
#include "optim_state/fsdp2_optim_state.h"
#include "testing/multi_rank.h"
#include "testing/peer_python.h"
#include "tests/peer/peer_parity.h"

namespace fsdp {
namespace {

using fsdp2::testing::InitDeterministic;
using fsdp2::testing::Net;

TEST(PyTorchFsdp2Parity, ParametersAndAdamWStateMatchAfterTenSteps) {
  std::string why_not;
  const std::string python = testing::PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << why_not;
  for (int world : {2, 4}) {
    Net init;
    InitDeterministic(*init);
    const peer::TensorDict theirs = peer::RunPeer(python, "fsdp2_peer.py", world, *init);
    ASSERT_FALSE(theirs.is_empty());
    fsdp::testing::RunOnRanks(fsdp::testing::Backend::kGlooThreads, world, [&](const comm::ProcessGroupPtr& pg) {
      auto mesh = mesh::DeviceMesh::Create(pg, {world});
      Net model;
      InitDeterministic(*model);
      for (auto& b : model->layers) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
      fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
      torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(peer::kLr));
      fsdp2::testing::TrainSteps(model, opt, 0, peer::kSteps, world, pg->rank());
      const fsdp2::FullStateDict params = fsdp2::GetFullStateDict(*model);
      const optim_state::OptimStateDict optim = optim_state::GetFullOptimStateDict(*model, opt);
      if (pg->rank() == 0) peer::ExpectMatchesPeer(params, optim, theirs, 13, absl::StrCat("FSDP2 W=", world));
    });
  }
}

}  // namespace
}  // namespace fsdp
