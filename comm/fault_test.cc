// FaultyProcessGroup: each injected fault surfaces as an error on every rank within the
// collective timeout (or as detectably wrong data for kCorrupt), and a rank process that
// dies mid-step makes the others fail within the timeout with an error naming its rank.
#include "comm/faulty_process_group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::comm {
namespace {

using fsdp::testing::Backend;
using Clock = std::chrono::steady_clock;

fsdp::testing::RunOptions ShortTimeout() {
  fsdp::testing::RunOptions options;
  options.collective_timeout = std::chrono::milliseconds(400);
  options.deadline = std::chrono::milliseconds(20000);
  return options;
}

// Runs one all_reduce of ones on every rank, rank 0 through a FaultyProcessGroup with
// `fault`; returns each rank's error message ("" if none) and checks it came in time.
std::vector<std::string> AllReduceWithFaultOnRankZero(Fault fault) {
  std::vector<std::string> errors(2);
  fsdp::testing::RunOnRanks(
      Backend::kThreaded, 2,
      [&](const ProcessGroupPtr& pg) {
        ProcessGroupPtr group =
            pg->rank() == 0 ? std::make_shared<FaultyProcessGroup>(pg, std::vector<Fault>{fault}) : pg;
        at::Tensor t = at::ones({4});
        const auto start = Clock::now();
        try {
          group->all_reduce(t)->wait();
        } catch (const c10::Error& e) {
          errors[pg->rank()] = e.what_without_backtrace();
        }
        EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(3000)) << "rank " << pg->rank();
      },
      ShortTimeout());
  return errors;
}

// Point-to-point: a failed send errors on its rank and leaves the peer's recv to time out; a
// corrupted recv holds wrong data; a send cannot be corrupted.
TEST(FaultyProcessGroup, SendsAndRecvsFailAndCorruptLikeCollectives) {
  std::vector<std::string> errors(2);
  fsdp::testing::RunOnRanks(
      Backend::kThreaded, 2,
      [&](const ProcessGroupPtr& pg) {
        const bool sender = pg->rank() == 0;
        auto faulty = std::make_shared<FaultyProcessGroup>(
            pg, std::vector<Fault>{sender ? Fault{.kind = Fault::Kind::kFail, .index = 2, .op = "send"}
                                          : Fault{.kind = Fault::Kind::kCorrupt, .index = 1, .op = "recv"}});
        at::Tensor t = at::full({3}, 2.0f);
        (sender ? faulty->send(t, 1) : faulty->recv(t, 0))->wait();  // call 0: no fault
        if (sender) {
          faulty->send(t, 1)->wait();  // rank 1's recv of it is corrupted
        } else {
          faulty->recv(t, 0)->wait();
          EXPECT_EQ(t[0].item<float>(), 3.0f) << "first element + 1";
          EXPECT_EQ(t[1].item<float>(), 2.0f);
        }
        try {
          (sender ? faulty->send(t, 1, 5) : faulty->recv(t, 0, 5))->wait();  // the sender's fails
        } catch (const c10::Error& e) {
          errors[pg->rank()] = e.what_without_backtrace();
        }
        if (sender) {
          EXPECT_ERROR_CONTAINS(std::make_shared<FaultyProcessGroup>(
                                    pg, std::vector<Fault>{{.kind = Fault::Kind::kCorrupt, .op = "send"}})
                                    ->send(t, 1),
                                "a kCorrupt fault hit send Float[3]");
        }
      },
      ShortTimeout());
  EXPECT_TRUE(absl::StrContains(errors[0], "injected fault")) << errors[0];
  EXPECT_TRUE(absl::StrContains(errors[1], "timed out")) << errors[1];
}

TEST(FaultyProcessGroup, AFailedCollectiveErrorsHereAndTimesOutOnThePeers) {
  const auto errors = AllReduceWithFaultOnRankZero({.kind = Fault::Kind::kFail, .index = 0});
  EXPECT_TRUE(absl::StrContains(errors[0], "all_reduce Float[4] on faulty(threaded) rank 0/2 failed: injected fault"))
      << errors[0];
  EXPECT_TRUE(absl::StrContains(errors[1], "timed out after 400 ms")) << errors[1];
  EXPECT_TRUE(absl::StrContains(errors[1], "rank(s) [0] never joined it")) << errors[1];
}

TEST(FaultyProcessGroup, AHungCollectiveTimesOutEverywhere) {
  const auto errors = AllReduceWithFaultOnRankZero({.kind = Fault::Kind::kHang, .index = 0});
  EXPECT_TRUE(absl::StrContains(errors[0], "timed out after 400 ms: injected hang")) << errors[0];
  EXPECT_TRUE(absl::StrContains(errors[1], "timed out after 400 ms")) << errors[1];
}

TEST(FaultyProcessGroup, DelaysPastTheTimeoutTimeOutShorterOnesSucceed) {
  auto errors =
      AllReduceWithFaultOnRankZero({.kind = Fault::Kind::kDelay, .index = 0, .delay = std::chrono::milliseconds(50)});
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  errors = AllReduceWithFaultOnRankZero({.kind = Fault::Kind::kDelay, .index = 0, .delay = std::chrono::seconds(5)});
  EXPECT_TRUE(absl::StrContains(errors[0], "timed out after 400 ms: injected delay")) << errors[0];
  EXPECT_EQ(errors[1], "") << "the collective itself ran";
}

TEST(FaultyProcessGroup, CorruptionChangesOnlyTheFaultedRanksOutput) {
  for (bool nan : {false, true}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [nan](const ProcessGroupPtr& pg) {
      auto faulty = std::make_shared<FaultyProcessGroup>(
          pg,
          std::vector<Fault>{
              {.kind = Fault::Kind::kCorrupt, .index = 1, .op = "all_gather_into_tensor", .corrupt_with_nan = nan}});
      at::Tensor out = at::empty({4});
      faulty->all_gather_into_tensor(out, at::full({2}, 3.0f))->wait();  // call 0: clean
      EXPECT_TRUE(at::equal(out, at::full({4}, 3.0f)));
      faulty->all_gather_into_tensor(out, at::full({2}, 3.0f))->wait();  // call 1: corrupted
      EXPECT_EQ(faulty->injected(), 1);
      if (nan) {
        EXPECT_TRUE(std::isnan(out[0].item<float>()));
      } else {
        EXPECT_EQ(out[0].item<float>(), 4.0f);
      }
      EXPECT_TRUE(at::equal(out.narrow(0, 1, 3), at::full({3}, 3.0f)));
    });
  }
}

TEST(FaultyProcessGroup, CountsPerOpAndOverAllOps) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 1, [](const ProcessGroupPtr& pg) {
    FaultyProcessGroup faulty(
        pg, {{.kind = Fault::Kind::kFail, .index = 1, .op = "broadcast"}, {.kind = Fault::Kind::kFail, .index = 3}});
    at::Tensor t = at::ones({2});
    faulty.broadcast(t, 0)->wait();                                           // broadcast #0, call #0
    faulty.all_reduce(t)->wait();                                             // call #1
    EXPECT_ERROR_CONTAINS(faulty.broadcast(t, 0)->wait(), "injected fault");  // broadcast #1
    EXPECT_ERROR_CONTAINS(faulty.all_reduce(t)->wait(), "injected fault");    // call #3
    faulty.all_reduce(t)->wait();
    EXPECT_EQ(faulty.injected(), 2);
  });
  EXPECT_ERROR_CONTAINS(FaultyProcessGroup(nullptr, {}), "FaultyProcessGroup: inner group is null");
}

// Kills rank `victim` of 3 Gloo processes after one all_reduce; the others' next all_reduce
// must fail within the collective timeout with an error naming the victim's rank, and only
// it. `late_rank` (-1: none) calls its all_reduce only 1.5 s later, when the third rank,
// which exits right after its own error (as a program under comm::RunMain does), is gone
// too: it must tell that rank, which recorded its failure in the store first, from the lost
// one. The others stay alive 1.5 s after their error.
void ExpectPeersOfAKilledRankNameIt(int victim, int late_rank = -1) {
  fsdp::testing::RunOptions options;
  options.collective_timeout = std::chrono::milliseconds(3000);
  options.deadline = std::chrono::milliseconds(60000);
  const auto outcomes = fsdp::testing::RunOnRanksCollect(
      Backend::kGlooProcesses, 3,
      [victim, late_rank](const ProcessGroupPtr& pg) {
        at::Tensor t = at::ones({1024});
        pg->all_reduce(t)->wait();           // everyone alive
        if (pg->rank() == victim) _exit(3);  // dies mid-step, no goodbye
        const bool exits_at_once = late_rank >= 0 && pg->rank() != late_rank;
        if (pg->rank() == late_rank) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
        const auto start = Clock::now();
        try {
          pg->all_reduce(t)->wait();
        } catch (const c10::Error& e) {
          const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
          if (!exits_at_once) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
          // The parent reads the time from the message (a child's EXPECT would be lost).
          TORCH_CHECK(false, "noticed after ", ms, " ms: ", e.what_without_backtrace());
        }
        TORCH_CHECK(false, "all_reduce succeeded without rank ", victim);
      },
      options);
  ASSERT_EQ(outcomes.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    const std::string& message = outcomes[r].message;
    EXPECT_FALSE(outcomes[r].ok) << "rank " << r;
    if (r == victim) continue;  // exited with 3 mid-test
    EXPECT_TRUE(absl::StrContains(message, "all_reduce(SUM) Float[1024] on gloo rank")) << message;
    // Gloo names the lost peer by address; the liveness probe adds its rank, and no other.
    EXPECT_TRUE(absl::StrContains(message, absl::StrCat("connection lost: rank(s) [", victim, "] of this group gone")))
        << message;
    EXPECT_FALSE(absl::StrContains(message, "timed out")) << message;
    if (r == late_rank) {
      const int other = 3 - victim - late_rank;
      EXPECT_TRUE(absl::StrContains(message, absl::StrCat("rank(s) [", other, "] stopped after their own error (")))
          << message;
    }
    int64_t ms = -1;
    const size_t at = message.find("noticed after ");
    ASSERT_NE(at, std::string::npos) << message;
    ASSERT_TRUE(absl::SimpleAtoi(message.substr(at + 14, message.find(' ', at + 14) - at - 14), &ms)) << message;
    EXPECT_LT(ms, options.collective_timeout.count()) << "rank " << r << " noticed the death too late: " << message;
  }
}

TEST(RankDeath, PeersOfAKilledRankProcessFailWithinTheTimeoutNamingItsRank) { ExpectPeersOfAKilledRankNameIt(1); }

// A survivor's write to the dead rank's socket raises SIGPIPE; its default action ended a
// survivor of the test above ("killed by signal 13") before the error could be reported.
// Creating a Gloo group ignores SIGPIPE when nothing handles it (as Python does at start-up).
TEST(RankDeath, AGlooGroupTurnsSigpipeIntoAnErrorUnlessTheProgramHandlesIt) {
  ASSERT_NE(signal(SIGPIPE, SIG_DFL), SIG_ERR);
  fsdp::testing::RunOnRanks(Backend::kGlooThreads, 1, [](const ProcessGroupPtr&) {});
  struct sigaction now {};
  ASSERT_EQ(sigaction(SIGPIPE, nullptr, &now), 0);
  EXPECT_EQ(now.sa_handler, SIG_IGN);
}

// Rank 0 also serves the TCPStore: the peers' addresses were read when the group was created.
TEST(RankDeath, PeersOfAKilledRankZeroProcessNameItToo) { ExpectPeersOfAKilledRankNameIt(0); }

// A survivor that exited after its own error is not named as lost. (Rank 0 is the late one:
// it serves the store that holds the record; under torchrun the elastic agent serves it.)
TEST(RankDeath, ASurvivorThatExitedAfterItsOwnErrorIsNotNamedAsLost) {
  ExpectPeersOfAKilledRankNameIt(/*victim=*/2, /*late_rank=*/0);
}

}  // namespace
}  // namespace fsdp::comm
