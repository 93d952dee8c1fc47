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
    fsdp2::fully_shard(linear.ptr(), {.mesh = mesh::DeviceMesh::Create(pg, {2})});
    Save(*linear, nullptr, other);

    Trainee target = Build(W(2), pg, 99, NetOptions{.hidden = 9});
    const fsdp2::FullStateDict before = fsdp2::GetFullStateDict(*target.module);
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
    const fsdp2::FullStateDict after = fsdp2::GetFullStateDict(*target.module);
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

// A tensor record whose bytes were corrupted (its CRC-32 no longer matches) passes every
// check that needs no tensor bytes, so it is found while reading: every rank fails. Read in
// place, the error says the model is partly loaded; all or nothing, nothing changed.
TEST(DcpErrors, ACorruptedTensorRecordFailsEveryRank) {
  const std::string dir = NewDir("corrupted_record");
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    Train(t, 0, 1);
    Save(*t.module, t.opt.get(), dir);
  });
  // Flip a byte inside the stored bytes of rank 1's chunk of a weight's AdamW moment.
  const checkpoint::DcpMetadata md = checkpoint::ReadMetadata(dir);
  const checkpoint::DcpEntry* e = md.Find("optim.state.block1.fc2.weight.exp_avg");
  ASSERT_NE(e, nullptr);
  const checkpoint::DcpChunk& c = e->chunks.back();
  ASSERT_EQ(c.storage.relative_path, "__1_0.distcp");
  const std::string file = dir + "/__1_0.distcp";
  std::vector<char> bytes = checkpoint::ReadFile(file, "test");
  const checkpoint::LocatedTensor located = checkpoint::LocateCheckpointTensor(
      c.storage.length,
      [&](uint64_t offset, size_t size, char* out) {
        std::copy_n(bytes.begin() + c.storage.offset + offset, size, out);
      },
      "chunk");
  ASSERT_GT(located.record_size, 4u);
  bytes[c.storage.offset + located.record_offset + 2] ^= 0x40;
  checkpoint::WriteFileAtomically(file, bytes, "test");
  for (bool all_or_nothing : {false, true}) {
    SCOPED_TRACE(all_or_nothing ? "all or nothing" : "in place");
    fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
      Trainee t = Build(W(2), pg, 99);
      Train(t, 0, 1);
      const FullState before = GetFull(t);
      const std::string want = pg->rank() == 1 ? "has CRC-32 " : "dcp::Load: rank 1 failed: ";
      try {
        Load(*t.module, t.opt.get(), dir, {.all_or_nothing = all_or_nothing});
        ADD_FAILURE() << "a corrupted record loaded";
      } catch (const c10::Error& err) {
        const std::string what = err.what_without_backtrace();
        EXPECT_TRUE(absl::StrContains(what, want)) << what;
        EXPECT_TRUE(absl::StrContains(what, "(corrupted)")) << what;
        EXPECT_EQ(absl::StrContains(what, "partly loaded"), !all_or_nothing) << what;
      }
      if (all_or_nothing) ExpectSameState(GetFull(t), before, "after the failed load");
    });
  }
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
