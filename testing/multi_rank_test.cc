// The multi-rank runner's deadline, proven by injecting hangs: a rank blocked forever in a
// collective (FaultyProcessGroup kHang under a one-hour collective timeout) and a rank whose
// body never returns are reported by rank number soon after the deadline, instead of hanging
// the test. Threads: the binary exits with status 1 naming the stuck ranks (checked as a
// death test: the stuck thread cannot be stopped, so the process cannot go on). Processes:
// the stuck rank process is killed and its outcome names the deadline.
#include "testing/multi_rank.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "comm/faulty_process_group.h"

namespace fsdp::testing {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr milliseconds kDeadline{2000};
// Rank processes must start (re-executing the test binary, slow under sanitizers) and make
// their group within the deadline: it bounds the whole run.
constexpr milliseconds kProcessDeadline{10000};
// Far beyond the deadline: without the runner's deadline these tests would block this long.
constexpr comm::Timeout kHourTimeout{3600 * 1000};
// The runner's grace after aborting a Threaded world, plus starting the death-test child.
constexpr milliseconds kSlack{20000};

enum class Hang {
  kInCollective,  // the rank's all_reduce never completes (FaultyProcessGroup kHang)
  kInBody,        // the rank's body blocks forever outside any collective
};

RunOptions HangOptions(milliseconds deadline = kDeadline) {
  RunOptions options;
  options.deadline = deadline;
  options.collective_timeout = kHourTimeout;
  return options;
}

// A body where rank `stuck` hangs as `hang` says and every other rank returns (after an
// all_reduce with the stuck rank when it hangs in a collective: those wait for it too, until
// the runner gives up on the run).
RankBody HangingBody(int stuck, Hang hang) {
  return [stuck, hang](const comm::ProcessGroupPtr& pg) {
    if (hang == Hang::kInBody) {
      if (pg->rank() == stuck) std::promise<void>().get_future().wait();  // never set
      return;
    }
    std::vector<comm::Fault> faults;
    if (pg->rank() == stuck) faults.push_back({.kind = comm::Fault::Kind::kHang, .index = 0, .op = "all_reduce"});
    comm::FaultyProcessGroup group(pg, faults);
    at::Tensor t = at::ones({4});
    group.all_reduce(t)->wait();
  };
}

// Runs the hanging body on 2 threaded ranks in a death-test child; expects the child to exit
// with status 1 naming exactly `expected_stuck` within the deadline plus slack.
void ExpectThreadedRunReportsStuckRanks(Backend backend, int stuck, Hang hang, const std::string& expected_stuck) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // re-execute: the parent has threads
  const auto start = Clock::now();
  EXPECT_EXIT(RunOnRanks(backend, 2, HangingBody(stuck, hang), HangOptions()), ::testing::ExitedWithCode(1),
              "rank\\(s\\) \\[" + expected_stuck + "\\] still running after the deadline of 2000 ms");
  EXPECT_LT(Clock::now() - start, kDeadline + kSlack) << "the runner did not enforce its deadline";
}

TEST(MultiRankDeadline, AThreadedRankHungInACollectiveIsNamedAfterTheDeadline) {
  // Rank 1's all_reduce is released by the runner aborting the Threaded world; rank 0 sleeps
  // in the injected hang.
  ExpectThreadedRunReportsStuckRanks(Backend::kThreaded, 0, Hang::kInCollective, "0");
}

TEST(MultiRankDeadline, AThreadedRankWhoseBodyNeverReturnsIsNamedAfterTheDeadline) {
  ExpectThreadedRunReportsStuckRanks(Backend::kThreaded, 1, Hang::kInBody, "1");
}

TEST(MultiRankDeadline, GlooThreadRanksBlockedOnAHungPeerAreAllNamed) {
  // Gloo cannot be aborted: rank 1 waits for rank 0 until the (hour-long) timeout.
  ExpectThreadedRunReportsStuckRanks(Backend::kGlooThreads, 0, Hang::kInCollective, "0, 1");
}

// Process mode: the runner kills the stuck rank process at the deadline; the call returns.
void ExpectStuckRankProcessIsKilled(Hang hang) {
  const auto start = Clock::now();
  const std::vector<RankOutcome> outcomes =
      RunOnRanksCollect(Backend::kGlooProcesses, 2, HangingBody(1, hang), HangOptions(kProcessDeadline));
  EXPECT_LT(Clock::now() - start, kProcessDeadline + kSlack) << "the runner did not enforce its deadline";
  ASSERT_EQ(outcomes.size(), 2u);
  EXPECT_EQ(outcomes[1].rank, 1);
  EXPECT_FALSE(outcomes[1].ok);
  EXPECT_TRUE(
      absl::StrContains(outcomes[1].message, "still running after the deadline of 10000 ms (deadlock?); killed"))
      << outcomes[1].message;
  if (hang == Hang::kInBody) {
    EXPECT_TRUE(outcomes[0].ok) << outcomes[0].message;  // rank 0 returned on its own
  } else {
    EXPECT_FALSE(outcomes[0].ok);  // it waited for rank 1 in the all_reduce
    EXPECT_TRUE(absl::StrContains(outcomes[0].message, "still running after the deadline")) << outcomes[0].message;
  }
}

TEST(MultiRankDeadline, ARankProcessHungInACollectiveIsKilledAndNamed) {
  ExpectStuckRankProcessIsKilled(Hang::kInCollective);
}

TEST(MultiRankDeadline, ARankProcessWhoseBodyNeverReturnsIsKilledAndNamed) {
  ExpectStuckRankProcessIsKilled(Hang::kInBody);
}

// The control: the same runs without a hang finish well before the deadline.
TEST(MultiRankDeadline, RunsWithoutAHangFinishNormally) {
  for (Backend backend : {Backend::kThreaded, Backend::kGlooThreads}) {
    const std::vector<RankOutcome> outcomes = RunOnRanksCollect(
        backend, 2,
        [](const comm::ProcessGroupPtr& pg) {
          at::Tensor t = at::ones({4});
          pg->all_reduce(t)->wait();
          EXPECT_TRUE(at::equal(t, at::full({4}, 2.0f)));
        },
        HangOptions());
    for (const RankOutcome& o : outcomes)
      EXPECT_TRUE(o.ok) << BackendName(backend) << " rank " << o.rank << ": " << o.message;
  }
}

}  // namespace
}  // namespace fsdp::testing
