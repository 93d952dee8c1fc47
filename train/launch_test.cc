// `train --nproc N` (train/train_main.cc): the program starts N ranks of itself with the torchrun
// environment, as torchrun --standalone does; a rank's failure stops the others and the exit
// status is 1. argv[1]: the `train` binary (Bazel's $(rootpath :train)).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include "testing/free_port.h"
#include "testing/peer_python.h"

namespace {

using fsdp::testing::RunCommand;

std::string g_train;  // argv[1]

constexpr char kTiny[] =
    " --config train/configs/debugmodel.toml --model.dim=64 --model.n_layers=2 --model.n_heads=4"
    " --training.seq_len=64 --training.steps=2 --validator.enable=false";

TEST(TrainNproc, StartsTheRanksItself) {
  std::string out;
  // CUDA devices hidden, as a user asks for the CPU on a GPU host.
  const int status = RunCommand("CUDA_VISIBLE_DEVICES= " + g_train + kTiny + " --nproc 2", &out);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 0) << out;
  EXPECT_NE(out.find("on 2 ranks: dp_replicate 1 x dp_shard 2 x tp 1"), std::string::npos) << out;
  EXPECT_NE(out.find("; on the CPU over Gloo\n"), std::string::npos) << out;
  EXPECT_NE(out.find("step:  2  loss:"), std::string::npos) << out;
}

TEST(TrainNproc, ARankFailingStopsTheJobWithStatusOne) {
  std::string out;
  const int status = RunCommand(g_train + kTiny + " --nproc 2 --dataloader.dataset_path=/nonexistent/data", &out);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 1) << out;
  EXPECT_NE(out.find("cannot open /nonexistent/data.index"), std::string::npos) << out;
  EXPECT_NE(out.find("train --nproc: a rank failed; stopping the others"), std::string::npos) << out;
}

TEST(TrainNproc, ABadCountOrATorchrunEnvironmentIsOneError) {
  std::string out;
  EXPECT_NE(RunCommand(g_train + kTiny + " --nproc 0", &out), 0);
  EXPECT_NE(out.find("--nproc needs a number of processes from 1 to 1024, got \"0\""), std::string::npos) << out;
  out.clear();
  EXPECT_NE(RunCommand("RANK=0 WORLD_SIZE=1 " + g_train + kTiny + " --nproc 2", &out), 0);
  EXPECT_NE(out.find("--nproc starts the ranks itself"), std::string::npos) << out;
}

// The last "loss" of a metrics JSONL file (the shortest round trip of the double: equal text is
// equal bits).
std::string LastLoss(const std::string& jsonl) {
  std::ifstream in(jsonl);
  std::string line, loss;
  while (std::getline(in, line)) {
    const size_t at = line.find("\"loss_metrics/global_avg_loss\": ");
    if (at == std::string::npos) continue;
    const size_t from = at + std::strlen("\"loss_metrics/global_avg_loss\": ");
    loss = line.substr(from, line.find_first_of(",}", from) - from);
  }
  return loss;
}

// Under `torchrun --max-restarts 1` (the peer venv's), rank 0 is killed with SIGKILL once it
// logged step 5 on the first attempt (a wrapper script: the program has no fault hook); torchrun
// relaunches both ranks, the run loads the newest complete checkpoint by itself (step-4: saves
// are synchronous) and ends on the uninterrupted run's last loss, bitwise.
TEST(TrainTorchrun, MaxRestartsResumesFromTheNewestCompleteCheckpoint) {
  std::string why_not;
  const std::string python = fsdp::testing::PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << "needs torchrun from the peer venv: " << why_not;
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir =
      std::string(tmp != nullptr ? tmp : "/tmp") + "/torchrun_restart_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const std::string wrapper = dir + "/rank.sh";
  std::ofstream(wrapper) << R"(#!/bin/bash
# rank 0 of the first attempt: SIGKILL once step $KILL_AFTER_STEP is logged
if [ "$RANK" = 0 ] && [ "${TORCHELASTIC_RESTART_COUNT:-0}" = 0 ] && [ -n "$KILL_AFTER_STEP" ]; then
  "$@" > "$FIRST_ATTEMPT_LOG" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2> /dev/null && ! grep -q "step: *$KILL_AFTER_STEP  loss" "$FIRST_ATTEMPT_LOG"; do sleep 0.02; done
  kill -9 "$pid" 2> /dev/null
  wait "$pid"
  exit 137
fi
exec "$@"
)";
  std::filesystem::permissions(wrapper, std::filesystem::perms::owner_all);
  const auto run = [&](const std::string& name, bool kill) {
    const std::string dump = dir + "/" + name;
    std::string out;
    const int status = RunCommand(
        (kill ? "KILL_AFTER_STEP=5 FIRST_ATTEMPT_LOG=" + dump + ".first " : std::string()) + python +
            " -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 --monitor-interval 0.1 --master-port " +
            std::to_string(fsdp::testing::FreePort()) + " --no-python " + wrapper + " " + g_train + kTiny +
            " --training.steps=8 --checkpoint.enable=true --checkpoint.interval=2"
            " --checkpoint.last_save_model_only=false --metrics.enable_jsonl=true --dump_folder=" +
            dump,
        &out);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << name << ":\n" << out;
    return std::make_pair(out, LastLoss(dump + "/metrics.jsonl"));
  };
  const auto [clean_out, clean_loss] = run("uninterrupted", false);
  ASSERT_FALSE(clean_loss.empty()) << clean_out;
  const auto [killed_out, killed_loss] = run("killed", true);
  EXPECT_NE(killed_out.find("loaded the checkpoint of step 4 from " + dir + "/killed/checkpoint/step-4"),
            std::string::npos)
      << killed_out;
  EXPECT_EQ(killed_loss, clean_loss) << killed_out;
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s TRAIN_BINARY\n", argv[0]);
    return 2;
  }
  g_train = std::filesystem::absolute(argv[1]).string();
  return RUN_ALL_TESTS();
}
