// The run //dcp:crash_test kills: two threaded ranks train dcp_test_trainees.h's FSDP2 Net and
// checkpoint after every step through dcp::CheckpointManager (keep_latest_k 2, so every save is
// followed by a purge), resuming from the newest complete checkpoint first.
//
//   crash_trial train FOLDER STEPS ASYNC   resume, train to STEPS; prints "loss <step> <%a>"
//                                          per step (rank 0) and "done"
//   crash_trial check FOLDER               load the newest complete checkpoint (none: prints
//                                          "none"), check its train_state step is its folder's,
//                                          train one more step: prints "resumed <step> <%a>"
#include <cstdio>
#include <cstdlib>
#include <string>

#include "dcp/checkpoint_manager.h"
#include "dcp/dcp_test_trainees.h"
#include "dcp/dict_state_testing.h"

namespace fsdp::dcp {
namespace {

constexpr int kWorld = 2;

CheckpointManagerOptions Options(const std::string& folder, bool async) {
  return {.folder = folder, .interval = 1, .keep_latest_k = 2, .async = async, .last_save_model_only = false};
}

int RunTrain(const std::string& folder, int64_t steps, bool async) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, kWorld, [&](const comm::ProcessGroupPtr& pg) {
    Trainee t = Build(W(kWorld), pg, 11);
    DictState train({{"step", int64_t{0}}});
    CheckpointManager manager(*t.module, t.opt.get(), {{"train_state", &train}}, Options(folder, async), pg);
    const int64_t first = std::max<int64_t>(manager.Load(), 0) + 1;
    for (int64_t step = first; step <= steps; ++step) {
      const double loss = Train(t, static_cast<int>(step), 1).at(0);
      if (pg->rank() == 0) {
        std::printf("loss %ld %a\n", static_cast<long>(step), loss);
        std::fflush(stdout);
      }
      train.state = {{"step", step}};
      manager.Save(step);
    }
    manager.Wait();
  });
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
