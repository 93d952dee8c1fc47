// The trainer's device: the errors for devices it cannot train on, raised before anything is
// allocated; and on a GPU host (skipped elsewhere, with the reason) one rank on a CUDA device
// training as the CPU's one rank does, its log line measuring the device, and a pipeline of two
// stages on a CUDA device doing the same.
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "testing/expect_error.h"
#include "testing/multi_rank.h"
#include "train/trainer.h"
#include "train/trainer_test_support.h"

namespace fsdp::train {
namespace {

TEST(TrainerDevice, DevicesItCannotTrainOnAreErrorsNamingThem) {
  const JobConfig config = test_support::SmallJob({});
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 1, [&](const comm::ProcessGroupPtr& pg) {
    EXPECT_ERROR_CONTAINS(Trainer(config, pg, c10::Device(c10::kMeta)),
                          "Trainer: device must be the CPU or a CUDA device with an index, got meta");
    EXPECT_ERROR_CONTAINS(Trainer(config, pg, c10::Device(c10::kCUDA)), "a CUDA device with an index, got cuda");
  });
}

// One rank on cuda:0 against one rank on the CPU, step for step: the GPU's float32 kernels
// (cuBLAS without TF32, PyTorch's default; the memory-efficient attention kernel) sum the same
// terms in other orders, which is what MeshTolerances' spread measures; a wrong device for a
// batch, a reduction or the optimizer state fails outright. Then Train() logs each step with
// the CUDA caching allocator's peak and torchtitan's peak FLOP/s for the device's name.
TEST(TrainerDevice, OneRankOnACudaDeviceTrainsAsOnTheCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a CUDA device (a --config=cuda or FSDP_WITH_CUDA build on a GPU host)";
  const c10::Device cuda(c10::kCUDA, 0);
  const JobConfig config = test_support::SmallJob({"--training.local_batch_size=8"});
  std::vector<StepResult> got;
  std::ostringstream log;
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 1, [&](const comm::ProcessGroupPtr& pg) {
    Trainer trainer(config, pg, cuda);
    for (const at::Tensor& p : trainer.model()->parameters()) ASSERT_EQ(p.device(), cuda);
    for (int64_t s = 0; s < test_support::kSteps; ++s) got.push_back(trainer.Step());
    Trainer logged(config, pg, cuda);
    logged.Train(log);
  });
  const std::vector<StepResult>& reference = test_support::MeshTolerances().reference;
  ASSERT_EQ(got.size(), reference.size());
  for (int64_t s = 0; s < test_support::kSteps; ++s) {
    EXPECT_EQ(got[s].lr, reference[s].lr) << "step " << s + 1;
    EXPECT_EQ(got[s].global_tokens, reference[s].global_tokens) << "step " << s + 1;
  }
  EXPECT_LE(test_support::MaxRelDiff(got, reference, &StepResult::loss), test_support::MeshTolerances().loss);
  EXPECT_LE(test_support::MaxRelDiff(got, reference, &StepResult::grad_norm), test_support::MeshTolerances().norm);
  const std::string text = log.str();
  EXPECT_NE(text.find("step:  1  loss:"), std::string::npos) << text;
  EXPECT_NE(text.find("step:  6  loss:"), std::string::npos) << text;
  EXPECT_EQ(text.find("memory:  0.00GiB(0.00%)"), std::string::npos) << "the CUDA peak was not measured:\n" << text;
}

// Two pipeline stages on two threaded ranks that share cuda:0 (the threaded group moves CUDA
// tensors with copy_, as NCCL would between two GPUs) against one rank on the CPU, with the
// tolerance of the case above: the stages' receive buffers, the shape inference's messages,
// the loss sum over the pipeline group and the clipping's norm all live on the device; one
// left on the CPU fails outright.
TEST(TrainerDevice, TwoPipelineStagesOnACudaDeviceTrainAsOneRankOnTheCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a CUDA device (a --config=cuda or FSDP_WITH_CUDA build on a GPU host)";
  const c10::Device cuda(c10::kCUDA, 0);
  const JobConfig config =
      test_support::SmallJob({"--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=8"});
  std::vector<std::vector<StepResult>> per_rank(2);
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainer trainer(config, pg, cuda);
    for (const auto& part : trainer.model_parts()) {
      for (const at::Tensor& p : part->parameters()) ASSERT_EQ(p.device(), cuda);
    }
    for (int64_t s = 0; s < test_support::kSteps; ++s) per_rank[pg->rank()].push_back(trainer.Step());
  });
  const std::vector<StepResult>& reference = test_support::MeshTolerances().reference;
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(::testing::Message() << "rank " << r);
    ASSERT_EQ(per_rank[r].size(), reference.size());
    EXPECT_LE(test_support::MaxRelDiff(per_rank[r], reference, &StepResult::loss), test_support::MeshTolerances().loss);
    EXPECT_LE(test_support::MaxRelDiff(per_rank[r], reference, &StepResult::grad_norm),
              test_support::MeshTolerances().norm);
  }
}

}  // namespace
}  // namespace fsdp::train
