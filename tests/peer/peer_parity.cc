#include "tests/peer/peer_parity.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <variant>

#include "absl/strings/str_cat.h"
#include "checkpoint/tensor_dict_file.h"
#include "fsdp/common/test_models.h"
#include "testing/float_tolerance.h"

namespace fsdp::peer {
namespace {

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir ? dir : "/tmp", "/", name, "_", getpid(), ".pt");
}

double MaxDiffOverScale(const at::Tensor& ours, const at::Tensor& theirs) {
  const double scale = std::max(1.0, theirs.abs().max().item<double>());
  return (ours.to(at::kDouble) - theirs.to(at::kDouble)).abs().max().item<double>() / scale;
}

}  // namespace

TensorDict RunPeer(const std::string& python, const std::string& script, int world, const torch::nn::Module& init,
                   const std::string& extra_args) {
  TensorDict input;
  for (const auto& item : init.named_parameters()) input.insert("param/" + item.key(), item.value().detach());
  for (int step = 0; step < kSteps; ++step) {
    input.insert(absl::StrCat("x/", step), test_models::Batch(step, 12, 3, 1));
    input.insert(absl::StrCat("y/", step), test_models::Batch(step, 12, 1, 2));
  }
  input.insert("steps", at::full({1}, static_cast<double>(kSteps)));
  input.insert("lr", at::full({1}, kLr));
  const std::string in_path = TempPath("peer_in"), out_path = TempPath("peer_out");
  checkpoint::SaveTensorDict(input, in_path);
  const std::string command = absl::StrCat(python, " tests/peer/", script, " --world ", world, " --input ", in_path,
                                           " --output ", out_path, " ", extra_args);
  // One retry when the peer process itself fails (a rare Gloo abort at exit was seen once
  // in many runs); its results, once written, are compared once.
  int rc = std::system(command.c_str());
  if (rc != 0) {
    std::fprintf(stderr, "peer exited with status %d; retrying once: %s\n", rc, command.c_str());
    rc = std::system(command.c_str());
  }
  std::remove(in_path.c_str());
  EXPECT_EQ(rc, 0) << command;
  if (rc != 0) return TensorDict();
  TensorDict out = checkpoint::LoadTensorDict(out_path);
  std::remove(out_path.c_str());
  return out;
}

void ExpectMatchesPeer(const TensorDict& params, const optim_state::OptimStateDict& optim, const TensorDict& theirs,
                       int expected_params, const std::string& label) {
  // Both sides train kSteps AdamW steps from the same start but reduce gradients in different
  // orders (c10d Gloo in Python vs ours): AdamWParityTolerance's argument, also for the moments.
  const double tol = fsdp::testing::AdamWParityTolerance(kSteps, kLr);
  int compared = 0;
  for (const auto& item : params) {
    const std::string& fqn = item.key();
    const at::Tensor* peer_param = theirs.find("param/" + fqn);
    if (peer_param == nullptr) {
      ADD_FAILURE() << label << ": the peer has no parameter " << fqn;
      continue;
    }
    EXPECT_LE(MaxDiffOverScale(item.value(), *peer_param), tol) << label << " " << fqn;
    const auto it = optim.state.find(fqn);
    if (it == optim.state.end()) {
      ADD_FAILURE() << label << ": no optimizer state for " << fqn;
      continue;
    }
    for (const char* name : {"exp_avg", "exp_avg_sq"}) {
      EXPECT_LE(MaxDiffOverScale(std::get<at::Tensor>(it->second.at(name)), theirs[absl::StrCat(name, "/", fqn)]), tol)
          << label << " " << name << " " << fqn;
    }
    EXPECT_EQ(static_cast<double>(std::get<int64_t>(it->second.at("step"))), theirs["step/" + fqn].item<double>())
        << label << " step " << fqn;
    ++compared;
  }
  EXPECT_EQ(compared, expected_params) << label;
}

}  // namespace fsdp::peer
