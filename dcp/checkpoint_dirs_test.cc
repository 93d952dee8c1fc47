// Periodic checkpoints: extra state (a training loop's step) saved and loaded beside the model,
// the per-rank write hook, and finding the latest complete checkpoint while skipping the ones
// a dead rank left without `.metadata`.
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "dcp/checkpoint_dirs.h"
#include "dcp/dcp_test_trainees.h"
#include "dcp/state_items.h"

namespace fsdp::dcp {
namespace {

TEST(DcpExtraState, SavedOnceAndLoadedInPlaceAtAnotherWorldSize) {
  const std::string dir = NewDir("extra");
  std::vector<std::vector<std::string>> written(3);
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(3), pg, 11);
    Train(t, 0, 1);
    SaveOptions options;
    options.extra_state = {{"train.step", at::tensor({int64_t{17}})}, {"train.rng", at::arange(4, at::kFloat)}};
    options.on_rank_file_written = [&, rank = pg->rank()](const std::string& file) {
      written[rank].push_back(file);
      struct stat st;
      EXPECT_EQ(::stat(file.c_str(), &st), 0) << file << " is not on disk when the hook runs";
      EXPECT_NE(::stat((dir + "/.metadata").c_str(), &st), 0) << "metadata before every rank wrote";
    };
    AsyncSave(*t.module, t.opt.get(), dir, options).wait();
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(written[r], std::vector<std::string>{absl::StrCat(dir, "/__", r, "_0.distcp")});
  // Written once (one chunk per key), under Python's nested-dict object path.
  const checkpoint::DcpMetadata md = checkpoint::ReadMetadata(dir);
  const checkpoint::DcpEntry* step = md.Find("train.step");
  ASSERT_NE(step, nullptr);
  EXPECT_EQ(step->chunks.size(), 1u);
  EXPECT_EQ(step->object_path, (std::vector<checkpoint::DcpPathElement>{std::string("train"), std::string("step")}));

  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 99);
    at::Tensor loaded_step = at::zeros({1}, at::kLong), rng = at::zeros({4}, at::kDouble);  // dtype cast
    LoadOptions options;
    options.extra_state = {{"train.step", loaded_step}, {"train.rng", rng}};
    Load(*t.module, t.opt.get(), dir, options);
    EXPECT_EQ(loaded_step.item<int64_t>(), 17);
    EXPECT_TRUE(at::equal(rng, at::arange(4, at::kDouble)));
    // A missing key or another shape is an error naming it, and nothing changes.
    at::Tensor untouched = at::full({1}, -1, at::kLong);
    options.extra_state = {{"train.step", untouched}, {"train.epoch", at::zeros({1}, at::kLong)}};
    EXPECT_ERROR_CONTAINS(Load(*t.module, t.opt.get(), dir, options),
                          "dcp::Load: the checkpoint '" + dir + "' has no entry 'train.epoch'");
    EXPECT_EQ(untouched.item<int64_t>(), -1);
    options.extra_state = {{"train.step", at::zeros({2}, at::kLong)}};
    EXPECT_ERROR_CONTAINS(Load(*t.module, t.opt.get(), dir, options),
                          "'train.step' in the checkpoint '" + dir +
                              "' has size [1], but extra_state 'train.step' has "
                              "size [2]");
  });
}

TEST(DcpExtraState, BadKeysAreNamed) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "is not a dotted name"},
      {"a..b", "is not a dotted name"},
      {"model.step", "would collide with the model's or optimizer's entries"},
      {"optim", "would collide"},
  };
  for (const auto& [key, message] : cases) {
    EXPECT_ERROR_CONTAINS(internal::CheckExtraState({{key, at::zeros({1})}}, "dcp::Save"),
                          "dcp::Save: extra_state key '" + key + "' " + message);
  }
  EXPECT_ERROR_CONTAINS(internal::CheckExtraState({{"a", at::zeros({1})}, {"a", at::zeros({1})}}, "dcp::Save"),
                        "extra_state key 'a' appears twice");
  EXPECT_ERROR_CONTAINS(internal::CheckExtraState({{"a", at::Tensor()}}, "dcp::Save"),
                        "extra_state 'a' is an undefined tensor");
}

// A rank whose hook throws (as one that dies there) leaves the checkpoint without
// `.metadata`; the scan skips it and finds the previous complete one.
TEST(ScanCheckpoints, TheLatestCompleteOneWinsAndIncompleteOnesAreReported) {
  const std::string root = NewDir("periodic");
  EXPECT_EQ(ScanCheckpoints(root).latest_step, -1);  // no root yet: nothing
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 11);
    for (int64_t step : {5, 10}) Save(*t.module, t.opt.get(), StepCheckpointDir(root, step));
    SaveOptions dies;
    dies.on_rank_file_written = [rank = pg->rank()](const std::string&) {
      TORCH_CHECK(rank != 1, "rank 1 died while saving");
    };
    EXPECT_ERROR_CONTAINS(Save(*t.module, t.opt.get(), StepCheckpointDir(root, 15), dies), "rank 1 died while saving");
  });
  std::filesystem::create_directories(root + "/step_20");  // a save that wrote nothing yet
  std::filesystem::create_directories(root + "/step_x");   // not ours: ignored
  std::filesystem::create_directories(root + "/step_25");
  std::ofstream(root + "/step_25/.metadata") << "not a pickle";

  const CheckpointScan scan = ScanCheckpoints(root);
  EXPECT_EQ(scan.latest_step, 10);
  EXPECT_EQ(scan.latest_dir, root + "/step_10");
  ASSERT_EQ(scan.incomplete.size(), 3u);
  EXPECT_EQ(scan.incomplete[0].dir, root + "/step_15");
  EXPECT_EQ(scan.incomplete[0].reason, "no .metadata (the save did not finish)");
  EXPECT_EQ(scan.incomplete[1].step, 20);
  EXPECT_TRUE(absl::StartsWith(scan.incomplete[2].reason, "invalid .metadata: ")) << scan.incomplete[2].reason;
  // The latest complete checkpoint loads.
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(2), pg, 99);
    Load(*t.module, t.opt.get(), scan.latest_dir);
  });
  EXPECT_ERROR_CONTAINS(StepCheckpointDir(root, -1), "StepCheckpointDir: step must be >= 0, got -1");
}

}  // namespace
}  // namespace fsdp::dcp
