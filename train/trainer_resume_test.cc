// The trainer resumed from its checkpoints (train/checkpoint_state.h, dcp/checkpoint_manager.h):
// at the same mesh bitwise, at other meshes, pipeline degrees and schedules (one or several
// stages per rank) as the uninterrupted run.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/process_group.h"
#include "fsdp/fsdp2/state_dict.h"
#include "testing/multi_rank.h"
#include "testing/test_dir.h"
#include "train/config.h"
#include "train/trainer.h"
#include "train/trainer_test_support.h"

namespace fsdp::train {
namespace {

using test_support::kSteps;
using test_support::MaxRelDiff;
using test_support::MeshTolerances;
using test_support::SmallJob;
using test_support::Train;

// Checkpointed runs (train/checkpoint_state.h, dcp/checkpoint_manager.h): `world` ranks of
// SmallJob(overrides) with checkpoints under `dump` every 2 steps; loads the newest (or
// --checkpoint.load_step) first, then steps until `until`, saving when due. Rank 0's results
// of the steps it ran.
std::vector<StepResult> ResumeAndTrain(int world, std::vector<std::string> overrides, const std::string& dump,
                                       int64_t until, int64_t expect_loaded) {
  for (const std::string o : {"--checkpoint.enable=true", "--checkpoint.interval=2", "--checkpoint.keep_latest_k=0",
                              "--checkpoint.last_save_model_only=false"}) {
    overrides.push_back(o);
  }
  overrides.push_back("--dump_folder=" + dump);
  const JobConfig config = SmallJob(overrides);
  std::vector<StepResult> results;
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
    Trainer trainer(config, pg);
    EXPECT_EQ(trainer.LoadCheckpoint(), expect_loaded);
    while (trainer.step() < until) {
      const StepResult r = trainer.Step();
      trainer.SaveCheckpoint();
      if (pg->rank() == 0) results.push_back(r);
    }
  });
  return results;
}

void CopyCheckpoint(const std::string& from_dump, const std::string& to_dump, int64_t step) {
  const std::string name = "checkpoint/step-" + std::to_string(step);
  std::filesystem::create_directories(to_dump + "/checkpoint");
  std::filesystem::copy(from_dump + "/" + name, to_dump + "/" + name, std::filesystem::copy_options::recursive);
}

// `first` then `second` (runs resumed from step 2 and then 4) against the uninterrupted run's
// steps 3..kSteps: the same steps, learning rates and token counts, the losses and gradient
// norms within two meshes' tolerances (each mesh lies within MeshTolerances() of one rank's).
void ExpectContinuesUninterrupted(const std::vector<StepResult>& first, const std::vector<StepResult>& second,
                                  const std::vector<StepResult>& uninterrupted) {
  std::vector<StepResult> resumed = first;
  resumed.insert(resumed.end(), second.begin(), second.end());
  ASSERT_EQ(resumed.size(), static_cast<size_t>(kSteps - 2));
  const std::vector<StepResult> want(uninterrupted.begin() + 2, uninterrupted.end());
  for (size_t i = 0; i < resumed.size(); ++i) {
    EXPECT_EQ(resumed[i].step, want[i].step);
    EXPECT_EQ(resumed[i].lr, want[i].lr) << "step " << want[i].step;
    EXPECT_EQ(resumed[i].global_tokens, want[i].global_tokens) << "step " << want[i].step;
  }
  EXPECT_LE(MaxRelDiff(resumed, want, &StepResult::loss), 2 * MeshTolerances().loss);
  EXPECT_LE(MaxRelDiff(resumed, want, &StepResult::grad_norm), 2 * MeshTolerances().norm);
}

// Synchronous saves, and async_with_pinned_mem's (the copy into the staging buffers overlapping
// the next step's forward and backward, waited for before its optimizer step): a resumed run
// is the uninterrupted one bit for bit, and saving does not change the run.
TEST(TrainerResume, AtTheSameMeshBitwise) {
  std::vector<StepResult> sync_run;
  for (const std::string mode : {"disabled", "async_with_pinned_mem"}) {
    SCOPED_TRACE(mode);
    const std::string dump = fsdp::testing::NewTestPath("resume_same_" + mode);
    const std::string async_mode = "--checkpoint.async_mode=" + mode;
    const std::vector<StepResult> uninterrupted = ResumeAndTrain(2, {async_mode}, dump, kSteps, -1);
    ASSERT_EQ(uninterrupted.size(), static_cast<size_t>(kSteps));
    // Saved at 2, 4 and 6 (the last one whole: last_save_model_only = false).
    for (int64_t step : {2, 4, 6}) {
      EXPECT_TRUE(std::filesystem::exists(dump + "/checkpoint/step-" + std::to_string(step) + "/.metadata")) << step;
    }
    const std::vector<StepResult> resumed =
        ResumeAndTrain(2, {async_mode, "--checkpoint.load_step=2"}, dump, kSteps, 2);
    ASSERT_EQ(resumed.size(), static_cast<size_t>(kSteps - 2));
    for (size_t i = 0; i < resumed.size(); ++i) {
      const StepResult& want = uninterrupted[i + 2];
      EXPECT_EQ(resumed[i].step, want.step);
      EXPECT_EQ(resumed[i].loss, want.loss) << "step " << want.step;
      EXPECT_EQ(resumed[i].grad_norm, want.grad_norm) << "step " << want.step;
      EXPECT_EQ(resumed[i].lr, want.lr) << "step " << want.step;
      EXPECT_EQ(resumed[i].global_tokens, want.global_tokens) << "step " << want.step;
    }
    if (sync_run.empty()) {
      sync_run = uninterrupted;
    } else {
      for (size_t i = 0; i < uninterrupted.size(); ++i) {
        EXPECT_EQ(uninterrupted[i].loss, sync_run[i].loss) << "step " << sync_run[i].step;
        EXPECT_EQ(uninterrupted[i].grad_norm, sync_run[i].grad_norm) << "step " << sync_run[i].step;
      }
    }
    // The newest complete checkpoint by default: the run is over.
    EXPECT_TRUE(ResumeAndTrain(2, {async_mode}, dump, kSteps, 6).empty());
  }
}

// FSDP 4 -> pp 2 x dp 2 with 1F1B (at step 2) -> pp 4 with GPipe (at step 4): each pipeline
// rank saves and loads its stage's part under the whole model's names, so a checkpoint moves
// between pipeline degrees (and to none) as between meshes; every resumed step is the
// uninterrupted run's within two meshes' tolerances.
// A save that cannot be made (here: step-2's directory name taken by a file) stops the run on
// every rank naming it (torchtitan's behaviour), or with checkpoint.continue_on_save_failure
// leaves the run going and the next save complete.
TEST(TrainerResume, AFailedSaveStopsTheRunOrWithContinueDoesNot) {
  for (const bool go_on : {false, true}) {
    SCOPED_TRACE(go_on);
    const std::string dump = fsdp::testing::NewTestPath(go_on ? "failed_save_continue" : "failed_save_stop");
    std::filesystem::create_directories(dump + "/checkpoint");
    std::ofstream(dump + "/checkpoint/step-2") << "not a checkpoint";
    const JobConfig config = SmallJob(
        {"--checkpoint.enable=true", "--checkpoint.interval=2", "--checkpoint.last_save_model_only=false",
         "--dump_folder=" + dump, absl::StrCat("--checkpoint.continue_on_save_failure=", go_on ? "true" : "false")});
    std::vector<std::string> errors(2);
    std::vector<int64_t> reached(2);
    fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
      Trainer trainer(config, pg);
      try {
        while (trainer.step() < 4) {
          trainer.Step();
          trainer.SaveCheckpoint();
        }
      } catch (const c10::Error& e) {
        errors[pg->rank()] = e.what_without_backtrace();
      }
      reached[pg->rank()] = trainer.step();
    });
    for (int r = 0; r < 2; ++r) {
      if (go_on) {
        EXPECT_EQ(errors[r], "") << "rank " << r;
        EXPECT_EQ(reached[r], 4) << "rank " << r;
      } else {
        EXPECT_TRUE(absl::StrContains(errors[r], dump + "/checkpoint/step-2")) << "rank " << r << ": " << errors[r];
        EXPECT_EQ(reached[r], 2) << "rank " << r;
      }
    }
    EXPECT_EQ(std::filesystem::exists(dump + "/checkpoint/step-4/.metadata"), go_on);
  }
}

TEST(TrainerResume, AcrossPipelineDegrees) {
  const std::string fsdp = fsdp::testing::NewTestPath("resume_pp_fsdp4"),
                    pp2 = fsdp::testing::NewTestPath("resume_pp2"), pp4 = fsdp::testing::NewTestPath("resume_pp4");
  const std::vector<StepResult> uninterrupted = ResumeAndTrain(4, {}, fsdp, kSteps, -1);
  CopyCheckpoint(fsdp, pp2, 2);
  const std::vector<StepResult> on_pp2 =
      ResumeAndTrain(4, {"--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=4"}, pp2, 4, 2);
  CopyCheckpoint(pp2, pp4, 4);
  const std::vector<StepResult> on_pp4 =
      ResumeAndTrain(4,
                     {"--parallelism.pipeline_parallel_degree=4", "--parallelism.pipeline_parallel_schedule=GPipe",
                      "--training.local_batch_size=8", "--parallelism.pipeline_parallel_microbatch_size=2"},
                     pp4, kSteps, 4);
  ExpectContinuesUninterrupted(on_pp2, on_pp4, uninterrupted);
  // And back to no pipeline: FSDP 4 loads the pp 4 run's last checkpoint.
  EXPECT_TRUE(ResumeAndTrain(4, {}, pp4, kSteps, kSteps).empty());
}

// Several stages per rank: FSDP 4 -> pp 2 x dp 2 with Interleaved1F1B (four stages, two per
// rank, at step 2) -> pp 2 with ZBVZeroBubble (V placement, at step 4) -> FSDP 4. Each rank
// saves and loads its two parts under the whole model's names (Trainer's parts module); the
// resumed steps are the uninterrupted run's within two meshes' tolerances. And
// checkpoint.initial_load_path into a pipeline: the FSDP run's step-2 checkpoint, loaded into
// Interleaved1F1B parts, continues as the resumed run does.
TEST(TrainerResume, WithSeveralPipelineStagesPerRank) {
  const std::string fsdp = fsdp::testing::NewTestPath("resume_multistage_fsdp4"),
                    interleaved = fsdp::testing::NewTestPath("resume_interleaved"),
                    zbv = fsdp::testing::NewTestPath("resume_zbv"),
                    initial = fsdp::testing::NewTestPath("resume_initial_load");
  const std::vector<StepResult> uninterrupted = ResumeAndTrain(4, {}, fsdp, kSteps, -1);
  const std::vector<std::string> pp2 = {"--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=4"};
  const auto with = [&](const char* schedule) {
    std::vector<std::string> o = pp2;
    o.push_back(absl::StrCat("--parallelism.pipeline_parallel_schedule=", schedule));
    return o;
  };
  CopyCheckpoint(fsdp, interleaved, 2);
  const std::vector<StepResult> on_interleaved = ResumeAndTrain(4, with("Interleaved1F1B"), interleaved, 4, 2);
  CopyCheckpoint(interleaved, zbv, 4);
  const std::vector<StepResult> on_zbv = ResumeAndTrain(4, with("ZBVZeroBubble"), zbv, kSteps, 4);
  ExpectContinuesUninterrupted(on_interleaved, on_zbv, uninterrupted);
  EXPECT_TRUE(ResumeAndTrain(4, {}, zbv, kSteps, kSteps).empty());  // back to FSDP 4

  std::vector<std::string> load = with("Interleaved1F1B");
  load.push_back(absl::StrCat("--checkpoint.initial_load_path=", fsdp, "/checkpoint/step-2"));
  load.push_back("--checkpoint.initial_load_model_only=false");  // the optimizer, schedule and data too
  const std::vector<StepResult> loaded = ResumeAndTrain(4, load, initial, 4, -1);
  ASSERT_EQ(loaded.size(), on_interleaved.size());
  for (size_t i = 0; i < loaded.size(); ++i) {
    EXPECT_EQ(loaded[i].step, on_interleaved[i].step);
    EXPECT_EQ(loaded[i].loss, on_interleaved[i].loss) << "step " << loaded[i].step;
    EXPECT_EQ(loaded[i].grad_norm, on_interleaved[i].grad_norm) << "step " << loaded[i].step;
  }
}

// The full tensors of every part of each rank's model, by name (the parts' names are the whole
// model's); collective over each part's FSDP group, so every rank calls it.
void CollectFullParams(Trainer& trainer, std::mutex& mu, std::map<std::string, at::Tensor>& out) {
  for (auto part : trainer.model_parts()) {
    const fsdp2::FullStateDict full = fsdp2::GetFullStateDict(*part);
    const std::lock_guard<std::mutex> lock(mu);
    for (const auto& item : full) out[item.key()] = item.value();
  }
}

// checkpoint.last_save_in_hf from a pipeline with two stages per rank (Interleaved1F1B, pp 2 x
// dp 2): the export holds the whole model, each tensor written by the ranks that hold it, so
// that an FSDP 4 job and another Interleaved1F1B job that start from it
// (checkpoint.initial_load_in_hf) hold the trained weights bitwise.
TEST(TrainerResume, PipelineExportsAndLoadsHuggingFaceCheckpoints) {
  const std::string dump = fsdp::testing::NewTestPath("pp_hf_export");
  const std::vector<std::string> interleaved = {"--parallelism.pipeline_parallel_degree=2",
                                                "--training.local_batch_size=4",
                                                "--parallelism.pipeline_parallel_schedule=Interleaved1F1B"};
  std::vector<std::string> first = interleaved;
  first.insert(first.end(), {"--training.steps=2", "--checkpoint.enable=true", "--checkpoint.last_save_in_hf=true",
                             "--dump_folder=" + dump});
  std::mutex mu;
  std::map<std::string, at::Tensor> trained, on_fsdp, on_pipeline;
  std::string exported;
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
    Trainer trainer(SmallJob(first), pg);
    std::ostringstream log;
    trainer.Train(log);
    CollectFullParams(trainer, mu, trained);
    if (pg->rank() == 0) exported = trainer.ExportDirectory();
  });
  ASSERT_TRUE(std::filesystem::exists(exported + "/model.safetensors.index.json"));
  const std::string load = "--checkpoint.initial_load_path=" + exported;
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
    Trainer trainer(SmallJob({load, "--checkpoint.initial_load_in_hf=true"}), pg);
    CollectFullParams(trainer, mu, on_fsdp);
  });
  std::vector<std::string> second = interleaved;
  second.insert(second.end(), {load, "--checkpoint.initial_load_in_hf=true"});
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
    Trainer trainer(SmallJob(second), pg);
    CollectFullParams(trainer, mu, on_pipeline);
  });
  ASSERT_FALSE(trained.empty());
  for (const auto* loaded : {&on_fsdp, &on_pipeline}) {
    ASSERT_EQ(loaded->size(), trained.size());
    for (const auto& [name, want] : trained) {
      ASSERT_TRUE(loaded->count(name)) << name;
      EXPECT_TRUE(at::equal(loaded->at(name), want)) << name;
    }
  }
}

// FSDP 4 -> FSDP 2 x TP 2 (at step 2) -> HSDP 2 x 2 (at step 4): the data stream, the schedule
// and the weights go on, so every resumed step is the uninterrupted FSDP 4 run's within two
// meshes' tolerances (each mesh lies within MeshTolerances() of the one-rank run).
TEST(TrainerResume, AtOtherMeshesAsTheUninterruptedRun) {
  const std::string fsdp = fsdp::testing::NewTestPath("resume_fsdp4"), tp = fsdp::testing::NewTestPath("resume_tp"),
                    hsdp = fsdp::testing::NewTestPath("resume_hsdp");
  const std::vector<StepResult> uninterrupted = ResumeAndTrain(4, {}, fsdp, kSteps, -1);
  CopyCheckpoint(fsdp, tp, 2);
  const std::vector<StepResult> on_tp =
      ResumeAndTrain(4, {"--parallelism.tensor_parallel_degree=2", "--training.local_batch_size=4"}, tp, 4, 2);
  CopyCheckpoint(tp, hsdp, 4);
  const std::vector<StepResult> on_hsdp =
      ResumeAndTrain(4, {"--parallelism.data_parallel_replicate_degree=2"}, hsdp, kSteps, 4);
  ExpectContinuesUninterrupted(on_tp, on_hsdp, uninterrupted);
  // The other ways: FSDP 4 -> HSDP 2 x 2 directly, and FSDP 2 x TP 2 back to FSDP 4.
  const std::string hsdp_direct = fsdp::testing::NewTestPath("resume_hsdp_direct"),
                    back = fsdp::testing::NewTestPath("resume_fsdp_back");
  CopyCheckpoint(fsdp, hsdp_direct, 2);
  const std::vector<StepResult> on_hsdp_direct =
      ResumeAndTrain(4, {"--parallelism.data_parallel_replicate_degree=2"}, hsdp_direct, 4, 2);
  CopyCheckpoint(tp, back, 4);
  const std::vector<StepResult> back_on_fsdp = ResumeAndTrain(4, {}, back, kSteps, 4);
  ExpectContinuesUninterrupted(on_hsdp_direct, back_on_fsdp, uninterrupted);
}

}  // namespace
}  // namespace fsdp::train
