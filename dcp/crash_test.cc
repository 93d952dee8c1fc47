// Crash consistency of dcp::CheckpointManager: a run of crash_trial.cc (two ranks, one process
// each) has one rank killed with SIGKILL at a random moment (startup, a step, a synchronous or
// background save, a purge) and, after a random moment more, the other (as torchrun's agent
// tears down the rest of the group), several times per trial, each relaunch resuming from
// what the last one left; then a fresh process loads the newest complete checkpoint. Every
// load must succeed (no folder that looks complete is damaged: the metadata is read with the
// validating reader, every chunk CRC-checked), hold the step its folder names, and the next
// step's loss must equal the uninterrupted run's bitwise.
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

#include "testing/free_port.h"
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

Child Spawn(const std::vector<std::string>& args, const std::string& out_path,
            const std::vector<std::string>& extra_env = {}) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
  for (const std::string& e : extra_env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  Child c{-1, out_path};
  const int rc = posix_spawn(&c.pid, argv[0], &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  EXPECT_EQ(rc, 0) << "posix_spawn " << args[0];
  return c;
}

// A wait status in words.
std::string Describe(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  return "wait status " + std::to_string(status);
}

int Wait(const Child& c) {
  int status = 0;
  EXPECT_EQ(waitpid(c.pid, &status, 0), c.pid);
  return status;
}

constexpr int kWorld = 2;

// One run of crash_trial's train mode: a process per rank, `out_prefix`.rank<r> its output.
std::vector<Child> SpawnRun(const std::vector<std::string>& args, const std::string& out_prefix) {
  const int port = fsdp::testing::FreePort();
  std::vector<Child> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.push_back(
        Spawn(args, out_prefix + ".rank" + std::to_string(r),
              {"RANK=" + std::to_string(r), "LOCAL_RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(kWorld),
               "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(port)}));
  }
  return ranks;
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

// Returns once `c` printed its `n`-th "save" line (it began that many saves), or after
// `patience` (it ended before, or is slow: the kill then lands wherever it is).
void WaitForSaves(const Child& c, int n, std::chrono::microseconds patience) {
  const auto give_up = std::chrono::steady_clock::now() + patience;
  while (std::chrono::steady_clock::now() < give_up) {
    std::istringstream lines(ReadAll(c.out_path));
    int saves = 0;
    for (std::string word; lines >> word;) saves += word == "save";
    if (saves >= n) return;
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
}

// Where a rank was when it was killed, from the lines it printed (crash_trial.cc).
enum class KilledIn { kSave, kBackgroundWrite, kElsewhere };

KilledIn WhereKilled(const std::string& out) {
  std::istringstream lines(out);
  std::map<int64_t, int> saves;  // step -> 1 in Save, 2 returned, 3 its data file written
  for (std::string word; lines >> word;) {
    int64_t step = 0;
    if (word == "save" || word == "saved" || word == "written") {
      lines >> step;
      int& phase = saves[step];
      phase = std::max(phase, word == "save" ? 1 : word == "saved" ? 2 : 3);
    }
  }
  if (saves.empty()) return KilledIn::kElsewhere;
  const int last = saves.rbegin()->second;
  return last == 1 ? KilledIn::kSave : last == 2 ? KilledIn::kBackgroundWrite : KilledIn::kElsewhere;
}

TEST(CheckpointManagerCrash, KilledAnywhereResumesFromACompleteCheckpointBitwise) {
  const std::string root = fsdp::testing::NewTestPath("crash");
  std::filesystem::create_directories(root);
  // The uninterrupted run, timed: the kills land anywhere within it.
  const auto start = std::chrono::steady_clock::now();
  const std::vector<Child> reference =
      SpawnRun({kTrial, "train", root + "/reference", std::to_string(kSteps), "1"}, root + "/ref.out");
  for (const Child& c : reference) ASSERT_EQ(Wait(c), 0) << ReadAll(c.out_path);
  const auto run_us =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count();
  const std::map<int64_t, std::string> expected = Losses(ReadAll(reference[0].out_path));
  ASSERT_EQ(expected.size(), static_cast<size_t>(kSteps));

  std::mt19937_64 rng(20261206);
  // Relaunches resume and so run shorter than the reference: most kills within its first 2/3.
  std::uniform_int_distribution<int64_t> delay_us(0, run_us * 2 / 3);
  // The other rank dies this much later (a launcher noticing the first death): meanwhile it may
  // finish a write, wait in a collective or fail on the dead peer's connection.
  std::uniform_int_distribution<int64_t> teardown_us(0, 20000);
  std::uniform_int_distribution<int64_t> within_step_us(0, run_us / kSteps);
  int killed = 0, finished = 0, retrained = 0, resumed = 0, compared = 0, fresh = 0;
  std::map<KilledIn, int> killed_in;
  for (int trial = 0; trial < kTrials; ++trial) {
    const std::string folder = root + "/trial" + std::to_string(trial);
    const std::string async = trial % 2 == 0 ? "1" : "0";
    for (int k = 0; k < kKillsPerTrial; ++k) {
      const std::vector<Child> run =
          SpawnRun({kTrial, "train", folder, std::to_string(kSteps), async}, folder + ".out");
      const int victim = static_cast<int>(rng() % kWorld);
      if (rng() % 4 == 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(delay_us(rng)));  // anywhere, startup included
      } else {
        // Aimed at the saves: once the victim began its n-th save, within about a step.
        WaitForSaves(run[victim], 1 + static_cast<int>(rng() % 4), std::chrono::microseconds(2 * run_us));
        std::this_thread::sleep_for(std::chrono::microseconds(within_step_us(rng)));
      }
      ::kill(run[victim].pid, SIGKILL);
      std::this_thread::sleep_for(std::chrono::microseconds(teardown_us(rng)));
      ::kill(run[1 - victim].pid, SIGKILL);
      std::vector<int> status(kWorld);
      for (int r = 0; r < kWorld; ++r) status[r] = Wait(run[r]);
      if (WIFSIGNALED(status[victim]) && WTERMSIG(status[victim]) == SIGKILL) {
        ++killed;
        ++killed_in[WhereKilled(ReadAll(run[victim].out_path))];
      } else {
        // It ended before the kill: it finished the run. The other rank then ended too, or was
        // still in its last moments (its last save's write, its exit) when the teardown kill
        // came, as a launcher's would; the next relaunch and the final check cover that.
        const int other = 1 - victim;
        ASSERT_TRUE(WIFEXITED(status[victim]) && WEXITSTATUS(status[victim]) == 0)
            << "trial " << trial << " rank " << victim << " (" << Describe(status[victim])
            << "): " << ReadAll(run[victim].out_path);
        ASSERT_TRUE((WIFEXITED(status[other]) && WEXITSTATUS(status[other]) == 0) ||
                    (WIFSIGNALED(status[other]) && WTERMSIG(status[other]) == SIGKILL))
            << "trial " << trial << " rank " << other << " (" << Describe(status[other])
            << "): " << ReadAll(run[other].out_path);
        ++finished;
      }
      // Whatever a relaunch trained, it trained as the uninterrupted run did.
      for (const auto& [step, loss] : Losses(ReadAll(run[0].out_path))) {
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
      "crash test: %d trials, %d runs with a rank killed (inside Save: its write and purge, or an async save's "
      "copy: %d; during an async save's background write: %d; elsewhere: %d), %d ended before their kill; %d "
      "steps retrained after a kill, all bitwise; %d final resumes loaded a complete checkpoint (%d then stepped, "
      "bitwise), %d found none; 0 from an incomplete checkpoint\n",
      kTrials, killed, killed_in[KilledIn::kSave], killed_in[KilledIn::kBackgroundWrite],
      killed_in[KilledIn::kElsewhere], finished, retrained, resumed, compared, fresh);
}

}  // namespace
}  // namespace fsdp::dcp
