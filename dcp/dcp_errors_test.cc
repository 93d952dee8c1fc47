// //dcp bad inputs (corrupt, truncated, foreign or missing checkpoints; a rank that cannot
// write) and one save / load across Gloo processes.
#include <sys/stat.h>

#include "dcp/dcp_test_trainees.h"

namespace fsdp::dcp {
namespace {

// ------------------------------------------------------------------------ bad inputs
TEST(DcpErrors, BadCheckpointsAreClearErrorsAndChangeNothing) {
  const std::string good = NewDir("good"), other = NewDir("other"), small = NewDir("small"), empty = NewDir("empty"),
                    model_only = NewDir("model_only");
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    Train(t, 0, 1);
    Save(*t.module, t.opt.get(), good);
    Save(*t.module, nullptr, model_only);
    Trainee one_block = Build(W(2), pg, 11, NetOptions{.blocks = 1, .hidden = 8});
    Save(*one_block.module, one_block.opt.get(), small);
    Hooked<torch::nn::LinearImpl> linear(4, 4);
    per_param::fully_shard(linear.ptr(), {.mesh = mesh::DeviceMesh::Create(pg, {2})});
    Save(*linear, nullptr, other);

    Trainee target = Build(W(2), pg, 99, NetOptions{.hidden = 9});
    const per_param::FullStateDict before = per_param::GetFullStateDict(*target.module);
    EXPECT_ERROR_CONTAINS(Load(*target.module, target.opt.get(), empty),
                          "dcp::Load: '" + empty + "' holds no complete checkpoint: ReadMetadata: cannot open '" +
                              empty + "/.metadata' for reading");
    EXPECT_ERROR_CONTAINS(Load(*target.module, target.opt.get(), good),
                          "dcp::Load: 'model.block0.fc1.weight' in the checkpoint '" + good +
                              "' has size [8, 5], but the model's 'block0.fc1.weight' has size [9, 5]");
    Trainee two = Build(W(2), pg, 99);
    EXPECT_ERROR_CONTAINS(Load(*two.module, two.opt.get(), small),
                          "dcp::Load: the checkpoint '" + small +
                              "' lacks 4 of the model's 14 keys: 'model.block1.fc1.weight', 'model.block1.fc1.bias'");
    EXPECT_ERROR_CONTAINS(
        Load(*two.module, two.opt.get(), other),
        "dcp::Load: the checkpoint '" + other + "' lacks 14 of the model's 14 keys: 'model.extra', 'model.in.weight'");
    EXPECT_ERROR_CONTAINS(Load(*two.module, two.opt.get(), model_only),
                          "dcp::Load: the checkpoint '" + model_only +
                              "' has no optimizer state (no entry 'optim.param_groups.0.params')");
    const per_param::FullStateDict after = per_param::GetFullStateDict(*target.module);
    for (const auto& item : before) EXPECT_TRUE(at::equal(*after.find(item.key()), item.value())) << item.key();
    EXPECT_EQ(two.opt->state().size(), 0u);  // nothing loaded

    // Partial loads take what is there; a model-only checkpoint loads without the optimizer.
    Load(*two.module, nullptr, small, {.allow_partial_load = true});
    Load(*two.module, nullptr, model_only);
  });
  // A chunk file gone: the rank that needs it names it, every rank fails.
  ASSERT_EQ(std::remove((good + "/__1_0.distcp").c_str()), 0);
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 99);
    EXPECT_ERROR_CONTAINS(Load(*t.module, t.opt.get(), good), "__1_0.distcp");
  });
}

// A rank that cannot write its file (its name is taken by a directory) fails the save on
// every rank, synchronously or from wait(), and no `.metadata` appears.
TEST(DcpErrors, AFailedWriteFailsEveryRankAndLeavesNoMetadata) {
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "AsyncSave" : "Save");
    const std::string dir = NewDir("unwritable");
    ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
    ASSERT_EQ(::mkdir((dir + "/__1_0.distcp").c_str(), 0755), 0);
    fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
      Trainee t = Build(W(2), pg, 11);
      const std::string want = pg->rank() == 1 ? "WriteRankData: cannot rename '" + dir + "/__1_0.distcp.tmp."
                                               : std::string(async ? "dcp::AsyncSave" : "dcp::Save") +
                                                     ": rank 1 failed: WriteRankData: cannot rename";
      if (async) {
        AsyncSaveHandle h = AsyncSave(*t.module, t.opt.get(), dir);
        EXPECT_ERROR_CONTAINS(h.wait(), want);
        EXPECT_ERROR_CONTAINS(h.wait(), want);  // the same outcome again
      } else {
        EXPECT_ERROR_CONTAINS(Save(*t.module, t.opt.get(), dir), want);
      }
    });
    struct stat st {};
    EXPECT_NE(::stat((dir + "/.metadata").c_str(), &st), 0) << "an incomplete checkpoint has metadata";
  }
  // A failed AsyncSave whose handle is dropped without wait() says so on stderr.
  const std::string dir = NewDir("unwritable_unwaited");
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((dir + "/__1_0.distcp").c_str(), 0755), 0);
  ::testing::internal::CaptureStderr();
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    AsyncSave(*t.module, t.opt.get(), dir);  // the handle dies here, unwaited
  });
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(absl::StrContains(err, "dcp::AsyncSave failed and its handle was destroyed without wait()")) << err;
}

// ----------------------------------------------------------------- Gloo processes
// Two processes save asynchronously (the writer threads agree over a Gloo subgroup), three
// load and finish the run.
TEST(DcpGlooProcesses, SaveOnTwoProcessesLoadOnThree) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp ? tmp : "/tmp", "/dcp_gloo_processes_ckpt");
  fsdp::testing::RunOnRanks(Backend::kGlooProcesses, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    Train(t, 0, kSteps);
    AsyncSaveHandle h = AsyncSave(*t.module, t.opt.get(), dir);
    h.wait();
  });
  fsdp::testing::RunOnRanks(Backend::kGlooProcesses, 3, [&](const comm::ProcessGroupPtr& pg) {
    const Reference ref = RunReference();
    Trainee t = Build(W(3), pg, 99);
    Load(*t.module, t.opt.get(), dir);
    const std::vector<double> losses = Train(t, kSteps, kSteps);
    for (int s = 0; s < kSteps; ++s) ExpectClose(losses[s], ref.losses[kSteps + s], absl::StrCat("loss ", s));
  });
}

}  // namespace
}  // namespace fsdp::dcp
