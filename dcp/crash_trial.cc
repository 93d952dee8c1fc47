// The run //dcp:crash_test kills: two ranks train dcp_test_trainees.h's FSDP2 Net and
// checkpoint after every step through dcp::CheckpointManager (keep_latest_k 2, so every save is
// followed by a purge), resuming from the newest complete checkpoint first.
//
//   crash_trial train FOLDER STEPS ASYNC   one rank of the run (a Gloo process group from the
//                                          torchrun environment: RANK, WORLD_SIZE = 2,
//                                          MASTER_ADDR, MASTER_PORT): resume, train to STEPS.
//                                          Prints, flushed: "loss <step> <%a>" per step (rank
//                                          0), "save <step>" / "saved <step>" around each Save
//                                          (with its purge), "written <step>" when this rank's
//                                          data file of that checkpoint is on disk (an async
//                                          save's background thread), and "done".
//   crash_trial check FOLDER               load the newest complete checkpoint (two threaded
//                                          ranks; none: prints "none"), check its train_state
//                                          step is its folder's, train one more step: prints
//                                          "resumed <step> <%a>"
#include <cstdio>
#include <cstdlib>
#include <string>

#include "comm/init_process_group.h"
#include "dcp/checkpoint_manager.h"
#include "dcp/dcp_test_trainees.h"
#include "dcp/dict_state_testing.h"

namespace fsdp::dcp {
namespace {

constexpr int kWorld = 2;

CheckpointManagerOptions Options(const std::string& folder, bool async) {
  return {.folder = folder, .interval = 1, .keep_latest_k = 2, .async = async, .last_save_model_only = false};
}

void Say(const char* what, int64_t step) {
  std::printf("%s %ld\n", what, static_cast<long>(step));
  std::fflush(stdout);
}

int RunTrain(const std::string& folder, int64_t steps, bool async) {
  const comm::ProcessGroupPtr pg = comm::InitProcessGroupFromEnv("cpu").group;
  TORCH_CHECK(pg->size() == kWorld, "crash_trial: WORLD_SIZE must be ", kWorld, ", got ", pg->size());
  Trainee t = Build(W(kWorld), pg, 11);
  DictState train({{"step", int64_t{0}}});
  CheckpointManagerOptions options = Options(folder, async);
  options.on_rank_file_written = [](int64_t step, const std::string&) { Say("written", step); };
  CheckpointManager manager(*t.module, t.opt.get(), {{"train_state", &train}}, options, pg);
  const int64_t first = std::max<int64_t>(manager.Load(), 0) + 1;
  for (int64_t step = first; step <= steps; ++step) {
    const double loss = Train(t, static_cast<int>(step), 1).at(0);
    if (pg->rank() == 0) {
      std::printf("loss %ld %a\n", static_cast<long>(step), loss);
      std::fflush(stdout);
    }
    train.state = {{"step", step}};
    Say("save", step);
    manager.Save(step);
    Say("saved", step);
  }
  manager.Wait();
  std::printf("done\n");
  return 0;
}

int RunCheck(const std::string& folder) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, kWorld, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(kWorld), pg, 99);  // other weights: the checkpoint must replace them
    DictState train({{"step", int64_t{-1}}});
    CheckpointManager manager(*t.module, t.opt.get(), {{"train_state", &train}}, Options(folder, false), pg);
    const int64_t loaded = manager.Load();
    if (loaded < 0) {
      if (pg->rank() == 0) std::printf("none\n");
      return;
    }
    TORCH_CHECK(train.state.at("step").toInt() == loaded, "crash_trial: ", manager.StepDirectory(loaded),
                " holds train_state step ", train.state.at("step").toInt());
    const double loss = Train(t, static_cast<int>(loaded + 1), 1).at(0);
    if (pg->rank() == 0) std::printf("resumed %ld %a\n", static_cast<long>(loaded), loss);
  });
  return 0;
}

}  // namespace
}  // namespace fsdp::dcp

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "train" && argc == 5) return fsdp::dcp::RunTrain(argv[2], std::atoll(argv[3]), std::atoi(argv[4]) != 0);
  if (mode == "check" && argc == 3) return fsdp::dcp::RunCheck(argv[2]);
  std::fprintf(stderr, "usage: %s train FOLDER STEPS ASYNC | check FOLDER\n", argv[0]);
  return 2;
}
