// `train --nproc N` (train/train_main.cc): the program starts N ranks of itself with the torchrun
// environment, as torchrun --standalone does; a rank's failure stops the others and the exit
// status is 1. argv[1]: the `train` binary (Bazel's $(rootpath :train)).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <string>

namespace {

// `command` through the shell, its stdout and stderr appended to `output`; pclose's status.
int RunCommand(const std::string& command, std::string* output) {
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0;) output->append(buffer, n);
  return ::pclose(pipe);
}

std::string g_train;  // argv[1]

constexpr char kTiny[] =
    " --config train/configs/debugmodel.toml --model.dim=64 --model.n_layers=2 --model.n_heads=4"
    " --training.seq_len=64 --training.steps=2 --validator.enable=false";

TEST(TrainNproc, StartsTheRanksItself) {
  std::string out;
  const int status = RunCommand(g_train + kTiny + " --nproc 2", &out);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 0) << out;
  EXPECT_NE(out.find("on 2 ranks: dp_replicate 1 x dp_shard 2 x tp 1"), std::string::npos) << out;
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
