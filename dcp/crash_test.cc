// Crash consistency of dcp::CheckpointManager: the run of crash_trial.cc is killed with SIGKILL
// at random moments (startup, a step, a synchronous or background save, a purge), several
// times per trial, each relaunch resuming from what the last one left; then a fresh process
// loads the newest complete checkpoint. Every load must succeed (no folder that looks complete
// is damaged: the metadata is read with the validating reader, every chunk CRC-checked), hold
// the step its folder names, and the next step's loss must equal the uninterrupted run's
// bitwise.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "testing/test_dir.h"

extern char** environ;

namespace fsdp::dcp {
namespace {

constexpr char kTrial[] = "dcp/crash_trial";
constexpr int kTrials = 50;
constexpr int kKillsPerTrial = 3;
constexpr int kSteps = 12;

struct Child {
  pid_t pid = -1;
  std::string out_path;
};

Child Spawn(const std::vector<std::string>& args, const std::string& out_path) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  Child c{-1, out_path};
  const int rc = posix_spawn(&c.pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  EXPECT_EQ(rc, 0) << "posix_spawn " << args[0];
  return c;
}

int Wait(const Child& c) {
  int status = 0;
  EXPECT_EQ(waitpid(c.pid, &status, 0), c.pid);
  return status;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// "loss <step> <%a>" lines of a train run.
std::map<int64_t, std::string> Losses(const std::string& out) {
  std::map<int64_t, std::string> losses;
  std::istringstream lines(out);
  for (std::string word; lines >> word;) {
    if (word != "loss") continue;
    int64_t step = 0;
    std::string value;
    lines >> step >> value;
    losses[step] = value;
  }
  return losses;
}

TEST(CheckpointManagerCrash, KilledAnywhereResumesFromACompleteCheckpointBitwise) {
  const std::string root = fsdp::testing::NewTestPath("crash");
  std::filesystem::create_directories(root);
  // The uninterrupted run, timed: the kills land anywhere within it.
  const auto start = std::chrono::steady_clock::now();
  const Child reference = Spawn({kTrial, "train", root + "/reference", std::to_string(kSteps), "1"}, root + "/ref.out");
  ASSERT_EQ(Wait(reference), 0) << ReadAll(reference.out_path);
  const auto run_us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count();
  const std::map<int64_t, std::string> expected = Losses(ReadAll(reference.out_path));
  ASSERT_EQ(expected.size(), static_cast<size_t>(kSteps));

  std::mt19937_64 rng(20261206);
  // Relaunches resume and so run shorter than the reference: most kills within its first 2/3.
  std::uniform_int_distribution<int64_t> delay_us(0, run_us * 2 / 3);
  int killed = 0, finished = 0, retrained = 0, resumed = 0, compared = 0, fresh = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    const std::string folder = root + "/trial" + std::to_string(trial);
    const std::string async = trial % 2 == 0 ? "1" : "0";
    for (int k = 0; k < kKillsPerTrial; ++k) {
      const Child run = Spawn({kTrial, "train", folder, std::to_string(kSteps), async}, folder + ".out");
      std::this_thread::sleep_for(std::chrono::microseconds(delay_us(rng)));
      ::kill(run.pid, SIGKILL);
      const int status = Wait(run);
      if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) ++killed;
      if (WIFEXITED(status)) {
        ASSERT_EQ(WEXITSTATUS(status), 0) << "trial " << trial << ": " << ReadAll(run.out_path);
        ++finished;  // it ended before the kill
      }
      // Whatever a relaunch trained, it trained as the uninterrupted run did.
      for (const auto& [step, loss] : Losses(ReadAll(run.out_path))) {
        ASSERT_EQ(loss, expected.at(step)) << "trial " << trial << " kill " << k << " step " << step;
        if (k > 0) ++retrained;
      }
    }
    const Child check = Spawn({kTrial, "check", folder}, folder + ".check");
    const std::string out = (Wait(check), ReadAll(check.out_path));
    std::istringstream words(out);
    std::string what;
    words >> what;
    if (what == "none") {
      ++fresh;
      continue;
    }
    ASSERT_EQ(what, "resumed") << "trial " << trial << ": the check failed: " << out;
    int64_t step = 0;
    std::string loss;
    words >> step >> loss;
    ++resumed;
    if (step < kSteps) {
      EXPECT_EQ(loss, expected.at(step + 1)) << "trial " << trial << " resumed at " << step;
      ++compared;
    }
  }
  std::printf(
      "crash test: %d trials, %d runs killed, %d ended before their kill; %d steps retrained after a kill, "
      "all bitwise; %d final resumes loaded a complete checkpoint (%d then stepped, bitwise), %d found none; "
      "0 from an incomplete checkpoint\n",
      kTrials, killed, finished, retrained, resumed, compared, fresh);
}

}  // namespace
}  // namespace fsdp::dcp
