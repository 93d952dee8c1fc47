// When a rank dies (README "When a rank dies"), with the shipped demo as a user runs it:
//  * the survivors of a killed rank print one line each and exit 1 long before the collective
//    timeout (no abort, no stack dump), naming the lost rank and the collective;
//  * under `torchrun --max-restarts 1` the relaunched job resumes from the latest complete
//    periodic checkpoint and ends bitwise equal to an uninterrupted run, also when the rank
//    died while writing a checkpoint (that one is reported and skipped);
//  * two torchrun launchers (`--nnodes 2`, as on two hosts, here on loopback) run one job.
// The rank is killed by the demo's FSDP_FAULT hook (examples/training_checkpoints.h).
// Usage (Bazel passes it): restart_test <path of fsdp2_demo>
#include <ATen/ATen.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "comm/work.h"
#include "fsdp/fsdp2/state_dict.h"
#include "testing/free_port.h"
#include "testing/multi_rank.h"
#include "testing/peer_python.h"
#include "testing/test_dir.h"

namespace {

std::string g_demo;  // argv[1]

std::string NewDir(const std::string& name) {
  const std::string dir = fsdp::testing::NewTestPath(name);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

using Clock = std::chrono::steady_clock;

struct RankExit {
  int status = 0;  // as waitpid
  Clock::time_point when;
  std::string err;
};

// The demo on `world` processes launched as `./x run` does (rank 0 serves the TCPStore),
// each with `fault` in FSDP_FAULT.
std::vector<RankExit> RunDemoProcesses(int world, const std::string& fault, const std::string& dir) {
  const int port = fsdp::testing::FreePort();
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      const std::string err = absl::StrCat(dir, "/err", r), out = absl::StrCat(dir, "/out", r);
      if (!freopen(err.c_str(), "w", stderr) || !freopen(out.c_str(), "w", stdout)) _exit(99);
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("FSDP_FAULT", fault.c_str(), 1);
      execl(g_demo.c_str(), g_demo.c_str(), static_cast<char*>(nullptr));
      _exit(98);
    }
    pids.push_back(pid);
  }
  std::vector<RankExit> exits(world);
  for (int left = world; left > 0; --left) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, 0);
    const auto now = Clock::now();
    for (int r = 0; r < world; ++r) {
      if (pids[r] == pid) exits[r] = {status, now, ""};
    }
  }
  for (int r = 0; r < world; ++r) exits[r].err = ReadFile(absl::StrCat(dir, "/err", r));
  return exits;
}

// A survivor's exit is bounded by the lost connection's detection plus rank 0's exit grace
// (comm/internal/tcp_store.cc), not by the collective timeout (comm::kDefaultTimeout, which
// the demo's groups use). The deadline is a fifth of that timeout: exiting within it shows
// the survivors stopped on the lost rank and not on the timeout, with room for a loaded
// machine's slow detection.
constexpr double kSurvivorExitDeadlineSeconds = std::chrono::duration<double>(fsdp::comm::kDefaultTimeout).count() / 5;

TEST(KilledRank, EverySurvivorPrintsOneLineAndExitsNonZeroBeforeTheTimeout) {
  const std::string dir = NewDir("killed");
  const std::vector<RankExit> exits = RunDemoProcesses(4, "kill_at_step:2:12", dir);
  ASSERT_TRUE(WIFSIGNALED(exits[2].status) && WTERMSIG(exits[2].status) == SIGKILL) << exits[2].err;
  std::string all;  // every rank's stderr, for the failure messages
  for (int r = 0; r < 4; ++r) absl::StrAppend(&all, "rank ", r, ":\n", exits[r].err);
  SCOPED_TRACE(all);
  for (int r : {0, 1, 3}) {
    const RankExit& e = exits[r];
    EXPECT_TRUE(WIFEXITED(e.status) && WEXITSTATUS(e.status) == 1) << "rank " << r << " status " << e.status << ":\n"
                                                                   << e.err;
    const double seconds = std::chrono::duration<double>(e.when - exits[2].when).count();
    EXPECT_LT(seconds, kSurvivorExitDeadlineSeconds) << "rank " << r << " took " << seconds << " s after the kill";
    std::vector<std::string> lines = absl::StrSplit(e.err, '\n', absl::SkipEmpty());
    ASSERT_EQ(lines.size(), 1u) << "rank " << r << " printed more than one line:\n" << e.err;
    EXPECT_TRUE(absl::StartsWith(lines[0], absl::StrCat("[rank ", r, "] error: "))) << lines[0];
    EXPECT_TRUE(absl::StrContains(lines[0], absl::StrCat(" on gloo rank ", r, "/4 failed after "))) << lines[0];
    EXPECT_TRUE(absl::StrContains(lines[0], "connection lost: rank(s) [2] of this group gone")) << lines[0];
    EXPECT_FALSE(absl::StrContains(lines[0], "timed out")) << lines[0];
  }
}

struct TorchrunResult {
  std::string dir, log, final_loss;
  int status = 0;
};

constexpr int kCheckpointEvery = 5;

// torchrun --nproc-per-node 4 --max-restarts 1 on the demo, checkpointing every 5 of its 30
// steps under dir/steps.
TorchrunResult Torchrun(const std::string& python, const std::string& name, const std::string& fault) {
  TorchrunResult result;
  result.dir = NewDir(name);
  const std::string command =
      absl::StrCat("FSDP_FAULT=", fault, " ", python, " -m torch.distributed.run --nproc-per-node 4 --max-restarts 1 ",
                   "--monitor-interval 0.1 --master-port ", fsdp::testing::FreePort(), " --no-python ", g_demo,
                   " --checkpoint_dir=", result.dir, " --checkpoint_every=", kCheckpointEvery);
  result.status = fsdp::testing::RunCommand(command, &result.log);
  for (absl::string_view line : absl::StrSplit(result.log, '\n')) {
    const size_t at = line.find("(final loss ");
    if (at != absl::string_view::npos)
      result.final_loss = std::string(line.substr(at + 12, line.find(';', at) - at - 12));
  }
  return result;
}

void ExpectSameModel(const std::string& got_dir, const std::string& want_dir) {
  const auto got = fsdp::fsdp2::LoadFullStateDictFile(got_dir + "/full.pt");
  const auto want = fsdp::fsdp2::LoadFullStateDictFile(want_dir + "/full.pt");
  ASSERT_EQ(got.size(), want.size());
  for (const auto& item : want) {
    const at::Tensor* t = got.find(item.key());
    ASSERT_NE(t, nullptr) << item.key();
    EXPECT_TRUE(at::equal(*t, item.value())) << item.key() << " differs from the uninterrupted run";
  }
}

// The relaunch resumes from the latest complete checkpoint at or before `latest`: normally
// step-<latest>, but its async save may still be in flight when the rank dies on a loaded
// machine; then the log must say that step is skipped as incomplete, and so on down.
void ExpectResumedFromLatestComplete(const TorchrunResult& r, int latest) {
  for (int step = latest; step > 0; step -= kCheckpointEvery) {
    const std::string ckpt = absl::StrCat(r.dir, "/steps/step-", step);
    if (absl::StrContains(r.log, "skipping incomplete checkpoint " + ckpt + ":")) continue;
    EXPECT_TRUE(absl::StrContains(r.log, "resumed from " + ckpt + ":")) << "expected a resume from " << ckpt << "\n"
                                                                        << r.log;
    return;
  }
  ADD_FAILURE() << "no complete checkpoint at or before step " << latest << "\n" << r.log;
}

TEST(TorchrunRestart, TheResumeCheckAcceptsOnlyTheLatestCompleteCheckpoint) {
  TorchrunResult r;
  r.dir = "/d";
  r.log = "resumed from /d/steps/step-15: training continues at step 15\n";
  ExpectResumedFromLatestComplete(r, 15);
  r.log =
      "skipping incomplete checkpoint /d/steps/step-15: no .metadata (the save did not finish)\n"
      "resumed from /d/steps/step-10: training continues at step 10\n";
  ExpectResumedFromLatestComplete(r, 15);
  r.log = "resumed from /d/steps/step-10: training continues at step 10\n";  // step-15 was complete
  EXPECT_NONFATAL_FAILURE(ExpectResumedFromLatestComplete(r, 15), "expected a resume from /d/steps/step-15");
  r.log = "resumed from /d/steps/step-1: training continues at step 1\n";
  EXPECT_NONFATAL_FAILURE(ExpectResumedFromLatestComplete(r, 15), "expected a resume from /d/steps/step-15");
}

TEST(TorchrunRestart, ResumesFromTheLatestCompleteCheckpointWithTheSameBits) {
  std::string why_not;
  const std::string python = fsdp::testing::PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << "needs torchrun from the peer venv: " << why_not;

  const TorchrunResult clean = Torchrun(python, "uninterrupted", "");
  ASSERT_EQ(clean.status, 0) << clean.log;
  ASSERT_FALSE(clean.final_loss.empty()) << clean.log;
  EXPECT_FALSE(absl::StrContains(clean.log, "resumed from")) << clean.log;

  // Rank 2 dies as step 17 starts: the relaunch resumes from step-15 (or, if its async save
  // had not finished, reports it incomplete and resumes from step-10).
  const TorchrunResult killed = Torchrun(python, "killed", "kill_at_step:2:17");
  ASSERT_EQ(killed.status, 0) << killed.log;
  EXPECT_TRUE(absl::StrContains(killed.log, "SIGKILL as step 17")) << killed.log;
  ExpectResumedFromLatestComplete(killed, 15);
  EXPECT_EQ(killed.final_loss, clean.final_loss);
  ExpectSameModel(killed.dir, clean.dir);

  // Rank 1 dies after writing its file of step-20's checkpoint, before `.metadata`: step-20
  // is reported and skipped, step-15 loads (with the same fallback).
  const TorchrunResult in_save = Torchrun(python, "in_save", "kill_in_save:1:20");
  ASSERT_EQ(in_save.status, 0) << in_save.log;
  EXPECT_TRUE(absl::StrContains(in_save.log, "checkpoint of step 20")) << in_save.log;
  EXPECT_TRUE(absl::StrContains(in_save.log, "skipping incomplete checkpoint " + in_save.dir +
                                                 "/steps/step-20: no .metadata (the save did not finish)"))
      << in_save.log;
  ExpectResumedFromLatestComplete(in_save, 15);
  EXPECT_EQ(in_save.final_loss, clean.final_loss);
  ExpectSameModel(in_save.dir, clean.dir);
}

// Two launcher processes (`--nnodes 2 --nproc-per-node 2`), as two hosts would run them: node
// 0's elastic agent serves the store, every rank is its client, and the 4-rank demo trains to
// parity with one rank (its PASS line).
TEST(TorchrunTwoLaunchers, TheDemoTrainsToParityAcrossTwoNodes) {
  std::string why_not;
  const std::string python = fsdp::testing::PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << "needs torchrun from the peer venv: " << why_not;
  const std::string dir = NewDir("two_nodes");
  const int port = fsdp::testing::FreePort();
  const auto launcher = [&](int node) {
    return absl::StrCat("timeout 300 ", python, " -m torch.distributed.run --nnodes 2 --node-rank ", node,
                        " --nproc-per-node 2 --master-addr 127.0.0.1 --master-port ", port, " --no-python ", g_demo,
                        " > ", dir, "/node", node, ".log 2>&1");
  };
  std::string output;
  const int status = fsdp::testing::RunCommand(absl::StrCat("( ", launcher(0), "; echo $? > ", dir, "/node0.rc ) & ",
                                                            launcher(1), "; echo $? > ", dir, "/node1.rc; wait"),
                                               &output);
  ASSERT_EQ(status, 0) << output;
  const std::string node0 = ReadFile(dir + "/node0.log"), node1 = ReadFile(dir + "/node1.log");
  EXPECT_EQ(ReadFile(dir + "/node0.rc"), "0\n") << node0;
  EXPECT_EQ(ReadFile(dir + "/node1.rc"), "0\n") << node1;
  EXPECT_TRUE(absl::StrContains(node0, "FSDP2 demo: 3-block decoder (vocab 64, d 32, tied head), 4 ranks")) << node0;
  EXPECT_TRUE(absl::StrContains(node0, "\nPASS\n")) << node0;
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc < 2) {
    std::fprintf(stderr, "usage: restart_test <path of fsdp2_demo>\n");
    return 2;
  }
  g_demo = std::filesystem::absolute(argv[1]).string();
  return RUN_ALL_TESTS();
}
