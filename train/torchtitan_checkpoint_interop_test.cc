// torchtitan's checkpoints and ours, both ways (train/torchtitan_checkpoint.h), through the
// runs of train/torchtitan_runs.h. Skipped, with the reason, without the peer venv or its
// torchtitan.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_dict_file.h"
#include "fsdp/fsdp2/state_dict.h"
#include "optim_state/fsdp2_optim_state.h"
#include "testing/peer_python.h"
#include "train/torchtitan_runs.h"

namespace fsdp::train::torchtitan_runs {
namespace {

// torchtitan's checkpoints and ours, both ways (train/torchtitan_checkpoint.h). torchtitan's run
// at FSDP 4 with its default fused qkv saves step 10 with its CheckpointManager; our trainer at
// FSDP 2 x TP 2 starts from that folder (initial_load_path, initial_load_model_only = false:
// model, optimizer, schedule, step; the data position from the step). The loaded weights and
// Adam moments equal, bitwise, torchtitan's own state mapped by its own code (the reference's
// state_step_10: the losses alone would not see q/k rows in the wrong order, since attention
// logits are tiny at this scale), and steps 11-20 match torchtitan's within the tolerance of
// the parity test (torchtitan_parity_test.cc), the learning rate exactly. Our own
// step-10 checkpoint, loaded by torchtitan_reference.py --load-ours with dcp.load into an
// unsharded torchtitan Llama3Model, gives the loss of our step 11 (one forward in another
// reduction order: within the same tolerance).
TEST(TorchtitanCheckpoint, TorchtitansLoadsIntoOursAndOursIntoTorchtitans) {
  constexpr Case kSaver = {"fsdp4_fused_qkv_checkpoint", 4, 1, 1, 2, "none", /*torchtitan_checkpoint=*/true};
  constexpr Case kLoader = {"fsdp2_tp2", 4, 1, 2, 4, "none"};
  const Reference& theirs = TorchtitanRun(kSaver);
  if (!theirs.skip_reason.empty()) GTEST_SKIP() << theirs.skip_reason;
  const Tolerances tol = TolerancesOf(theirs, TorchtitanRun(kOneRank));

  std::vector<std::string> args = OursArgs(kLoader, theirs.dir + "/hf_init");
  args.push_back(absl::StrCat("--checkpoint.initial_load_path=", theirs.dir, "/checkpoint/step-", kSaveStep));
  args.push_back("--checkpoint.initial_load_in_hf=false");
  args.push_back("--checkpoint.initial_load_model_only=false");
  // The loaded state is torchtitan's, bitwise, as its own hook and adapter map it to our names and rows.
  const std::string state = absl::StrCat(theirs.dir, "/state_step_", kSaveStep, "/");
  const auto expect_loaded = [&](Trainer& trainer, int rank) {
    const fsdp2::FullStateDict model = fsdp2::GetFullStateDict(*trainer.model());
    const optim_state::OptimStateDict optim = optim_state::GetFullOptimStateDict(*trainer.model(), trainer.optimizer());
    if (rank != 0) return;
    size_t compared = 0;
    for (const auto& [file, what] : {std::pair{"model", ""}, {"exp_avg", "exp_avg"}, {"exp_avg_sq", "exp_avg_sq"}}) {
      const checkpoint::TensorDict want = checkpoint::LoadSafetensors(state + file + ".safetensors");
      for (const auto& item : want) {
        const at::Tensor got =
            *what == '\0' ? *model.find(item.key()) : std::get<at::Tensor>(optim.state.at(item.key()).at(what));
        EXPECT_TRUE(at::equal(got, item.value())) << file << " " << item.key();
        ++compared;
      }
    }
    EXPECT_EQ(compared, 3 * model.size());
    EXPECT_EQ(std::get<int64_t>(optim.state.at("lm_head.weight").at("step")), kSaveStep);
    EXPECT_EQ(trainer.step(), kSaveStep);
  };
  const std::vector<StepResult> resumed = OursRun(kLoader, args, kSteps - kSaveStep, expect_loaded);
  ASSERT_EQ(resumed.size(), static_cast<size_t>(kSteps - kSaveStep));
  for (size_t i = 0; i < resumed.size(); ++i) {
    const int64_t s = kSaveStep + static_cast<int64_t>(i);
    SCOPED_TRACE(absl::StrCat("step ", s + 1));
    EXPECT_EQ(resumed[i].step, s + 1);
    EXPECT_NEAR(resumed[i].lr, theirs.lrs[s], 1e-15);
    EXPECT_LE(std::abs(resumed[i].loss - theirs.losses[s]), tol.loss * std::abs(theirs.losses[s]))
        << "ours " << resumed[i].loss << ", torchtitan " << theirs.losses[s];
    EXPECT_LE(std::abs(resumed[i].grad_norm - theirs.grad_norms[s]), tol.norm * std::abs(theirs.grad_norms[s]))
        << "ours " << resumed[i].grad_norm << ", torchtitan " << theirs.grad_norms[s];
  }

  const std::string ours_dir = theirs.dir + "_ours";
  args = OursArgs(kLoader, theirs.dir + "/hf_init");
  args.insert(args.end(), {"--checkpoint.enable=true", "--dump_folder=" + ours_dir,
                           absl::StrCat("--checkpoint.interval=", kSaveStep)});
  const std::vector<StepResult> ours = OursRun(kLoader, args, kSaveStep + 1);
  const std::string spec = ours_dir + ".json", out = ours_dir + "/loaded.pt";
  std::ofstream(spec) << SpecJson(kSaver);
  std::string output, why_not;
  const int status = fsdp::testing::RunCommand(
      absl::StrCat(fsdp::testing::PeerPython(&why_not), " train/testdata/torchtitan_reference.py --load-ours ", spec,
                   " ", ours_dir, "/checkpoint/step-", kSaveStep, " ", out),
      &output);
  ASSERT_EQ(status, 0) << output;
  const checkpoint::TensorDict loaded = checkpoint::LoadTensorDict(out);
  const at::Tensor* loss = loaded.find("loss");
  ASSERT_NE(loss, nullptr);
  const double python = loss->item<double>();
  EXPECT_LE(std::abs(ours[kSaveStep].loss - python), tol.loss * std::abs(python))
      << "our step " << kSaveStep + 1 << " " << ours[kSaveStep].loss << ", torchtitan's model from our checkpoint "
      << python;
  std::printf("torchtitan -> ours: steps %ld-%ld within tolerance %.3g; ours -> torchtitan: loss %.9g vs ours %.9g\n",
              static_cast<long>(kSaveStep + 1), static_cast<long>(kSteps), tol.loss, python, ours[kSaveStep].loss);
}

}  // namespace
}  // namespace fsdp::train::torchtitan_runs
