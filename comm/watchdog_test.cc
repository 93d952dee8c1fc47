// Watchdog: deadlines enforced without waiters, one abort per communicator, every
// in-flight collective of it failed with a clear message, sticky errors, other
// communicators unaffected, finished collectives dropped, prompt shutdown.
#include "comm/watchdog.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "testing/expect_error.h"

namespace fsdp::comm {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using State = WatchPoll::State;

long long MsSince(Clock::time_point start) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
}

// Collects the log lines instead of stderr.
struct LogLines {
  std::mutex mu;
  std::vector<std::string> lines;
  std::function<void(const std::string&)> Sink() {
    return [this](const std::string& line) {
      std::lock_guard<std::mutex> lock(mu);
      lines.push_back(line);
    };
  }
  std::vector<std::string> Get() {
    std::lock_guard<std::mutex> lock(mu);
    return lines;
  }
};

WatchdogOptions Options(milliseconds interval, LogLines* log) {
  WatchdogOptions options;
  options.poll_interval = interval;
  if (log != nullptr) options.log = log->Sink();
  return options;
}

std::function<WatchPoll()> NeverCompletes() {
  return [] { return WatchPoll::Running(); };
}

// Polls until `pred` holds or `limit` passed.
template <typename Pred>
bool Eventually(Pred pred, milliseconds limit = milliseconds(5000)) {
  const auto end = Clock::now() + limit;
  while (!pred()) {
    if (Clock::now() >= end) return false;
    std::this_thread::sleep_for(milliseconds(1));
  }
  return true;
}

TEST(Watchdog, TimesOutStuckCollectiveAndFailsItsWholeCommunicator) {
  LogLines log;
  Watchdog watchdog(Options(milliseconds(5), &log));
  std::atomic<int> aborts_a{0}, aborts_b{0};
  auto a = watchdog.AddCommunicator("comm A", [&] { ++aborts_a; });
  auto b = watchdog.AddCommunicator("comm B", [&] { ++aborts_b; });

  const auto start = Clock::now();
  auto stuck = watchdog.Watch(a, "all_reduce #0 on rank 1/2", milliseconds(150), NeverCompletes());
  auto other = watchdog.Watch(a, "all_gather #1 on rank 1/2", milliseconds(60000), NeverCompletes());
  auto unrelated = watchdog.Watch(b, "broadcast #0 on rank 1/2", milliseconds(60000), NeverCompletes());
  EXPECT_EQ(a->num_in_flight(), 2u);

  // Nobody waits: the watchdog alone must notice. Deadline 150 ms, margin for a busy box.
  const WatchPoll s = stuck->Wait(milliseconds(10000));
  const long long elapsed = MsSince(start);
  ASSERT_EQ(s.state, State::kFailed);
  EXPECT_GE(elapsed, 150);
  EXPECT_LT(elapsed, 150 + 2000);
  EXPECT_TRUE(absl::StrContains(s.error, "all_reduce #0 on rank 1/2 timed out after 150 ms")) << s.error;
  EXPECT_TRUE(absl::StrContains(s.error, "communicator comm A aborted by the watchdog")) << s.error;

  const WatchPoll o = other->status();
  ASSERT_EQ(o.state, State::kFailed);
  EXPECT_TRUE(absl::StrContains(o.error,
                                "all_gather #1 on rank 1/2 failed: communicator comm A "
                                "aborted by the watchdog"))
      << o.error;
  EXPECT_TRUE(absl::StrContains(o.error, "all_reduce #0 on rank 1/2 timed out after 150 ms")) << o.error;
  EXPECT_TRUE(a->failed());
  EXPECT_EQ(a->num_in_flight(), 0u);

  // More ticks pass: still one abort, one log line; B untouched.
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_EQ(aborts_a.load(), 1);
  EXPECT_EQ(aborts_b.load(), 0);
  EXPECT_FALSE(b->failed());
  EXPECT_EQ(unrelated->status().state, State::kRunning);
  const std::vector<std::string> lines = log.Get();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_TRUE(absl::StrContains(lines[0], "all_reduce #0 on rank 1/2 timed out after 150 ms")) << lines[0];
  EXPECT_TRUE(absl::StrContains(lines[0], "2 in-flight collective(s) failed")) << lines[0];

  // Sticky: later collectives on A fail at once with the first error; B still works.
  EXPECT_ERROR_CONTAINS(watchdog.Watch(a, "barrier #2", milliseconds(1000), NeverCompletes()),
                        "barrier #2 failed: communicator comm A was aborted by the watchdog "
                        "earlier: all_reduce #0 on rank 1/2 timed out after 150 ms");
  EXPECT_ERROR_CONTAINS(a->ThrowIfFailed("reduce_scatter #3"), "timed out after 150 ms");
  EXPECT_NO_THROW(b->ThrowIfFailed("x"));
  auto later_b = watchdog.Watch(b, "barrier #1", milliseconds(60000), NeverCompletes());
  EXPECT_EQ(later_b->status().state, State::kRunning);
  EXPECT_TRUE(Eventually([&] { return watchdog.num_watched() == 2; }));
}

TEST(Watchdog, PollFailureAbortsAtOnceWithItsMessage) {
  LogLines log;
  Watchdog watchdog(Options(milliseconds(2), &log));
  std::atomic<int> aborts{0};
  auto comm = watchdog.AddCommunicator("nccl cuda:0", [&] { ++aborts; });
  std::atomic<bool> broken{false};
  auto first = watchdog.Watch(comm, "all_reduce #7", milliseconds(60000), [&] {
    return broken ? WatchPoll::Failed("NCCL async error: unhandled system error") : WatchPoll::Running();
  });
  auto second = watchdog.Watch(comm, "all_reduce #8", milliseconds(60000), NeverCompletes());
  std::this_thread::sleep_for(milliseconds(30));
  EXPECT_EQ(first->status().state, State::kRunning);
  EXPECT_EQ(aborts.load(), 0);

  const auto start = Clock::now();
  broken = true;
  const WatchPoll s = first->Wait(milliseconds(10000));
  EXPECT_LT(MsSince(start), 2000);  // far below the 60 s deadline
  ASSERT_EQ(s.state, State::kFailed);
  EXPECT_EQ(s.error,
            "all_reduce #7 failed: NCCL async error: unhandled system error; communicator "
            "nccl cuda:0 aborted by the watchdog");
  const WatchPoll t = second->status();
  ASSERT_EQ(t.state, State::kFailed);
  EXPECT_TRUE(absl::StrContains(t.error, "all_reduce #8 failed")) << t.error;
  EXPECT_TRUE(absl::StrContains(t.error, "unhandled system error")) << t.error;
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(aborts.load(), 1);
  EXPECT_EQ(log.Get().size(), 1u);
  EXPECT_EQ(comm->error(), s.error);
}

TEST(Watchdog, ThrowingPollCountsAsFailure) {
  LogLines log;
  Watchdog watchdog(Options(milliseconds(2), &log));
  std::atomic<int> aborts{0};
  auto comm = watchdog.AddCommunicator("c", [&] { ++aborts; });
  auto w = watchdog.Watch(comm, "op", milliseconds(60000),
                          []() -> WatchPoll { throw std::runtime_error("query exploded"); });
  const WatchPoll s = w->Wait(milliseconds(10000));
  ASSERT_EQ(s.state, State::kFailed);
  EXPECT_TRUE(absl::StrContains(s.error, "query exploded")) << s.error;
  EXPECT_EQ(aborts.load(), 1);
}

TEST(Watchdog, LogsOneLineToStderrByDefault) {
  ::testing::internal::CaptureStderr();
  {
    Watchdog watchdog(Options(milliseconds(2), nullptr));
    auto comm = watchdog.AddCommunicator("comm Z", [] {});
    auto w1 = watchdog.Watch(comm, "op #1", milliseconds(20), NeverCompletes());
    auto w2 = watchdog.Watch(comm, "op #2", milliseconds(20), NeverCompletes());
    EXPECT_EQ(w1->Wait(milliseconds(10000)).state, State::kFailed);
    EXPECT_EQ(w2->Wait(milliseconds(10000)).state, State::kFailed);
    std::this_thread::sleep_for(milliseconds(20));
  }
  const std::string err = ::testing::internal::GetCapturedStderr();
  size_t newlines = 0;
  for (char ch : err) newlines += ch == '\n';
  EXPECT_EQ(newlines, 1u) << err;
  EXPECT_TRUE(absl::StrContains(err, "[fsdp watchdog] op #")) << err;
  EXPECT_TRUE(absl::StrContains(err, "timed out after 20 ms")) << err;
  EXPECT_TRUE(absl::StrContains(err, "communicator comm Z aborted")) << err;
}

TEST(Watchdog, CompletedCollectivesAreForgotten) {
  Watchdog watchdog(Options(milliseconds(2), nullptr));
  std::atomic<int> aborts{0};
  auto comm = watchdog.AddCommunicator("c", [&] { ++aborts; });
  auto token = std::make_shared<int>(0);  // every poll holds a copy: counts live polls
  std::atomic<bool> finished{false};
  std::vector<std::shared_ptr<Watchdog::Collective>> all;
  for (int i = 0; i < 1000; ++i) {
    all.push_back(watchdog.Watch(comm, absl::StrCat("op #", i), milliseconds(60000),
                                 [token, &finished] { return finished ? WatchPoll::Done() : WatchPoll::Running(); }));
  }
  EXPECT_EQ(token.use_count(), 1001);
  EXPECT_EQ(comm->num_in_flight(), 1000u);
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(watchdog.num_watched(), 1000u);
  finished = true;
  ASSERT_TRUE(Eventually([&] { return watchdog.num_watched() == 0; })) << watchdog.num_watched() << " still watched";
  EXPECT_EQ(token.use_count(), 1);  // the polls were destroyed, not just skipped
  EXPECT_EQ(comm->num_in_flight(), 0u);
  for (const auto& c : all) EXPECT_EQ(c->status().state, State::kDone);
  EXPECT_EQ(aborts.load(), 0);
  EXPECT_FALSE(comm->failed());

  // Many rounds: the set stays small.
  for (int round = 0; round < 50; ++round) {
    watchdog.Watch(comm, "quick", milliseconds(60000), [] { return WatchPoll::Done(); });
  }
  ASSERT_TRUE(Eventually([&] { return watchdog.num_watched() == 0; }));
  // A finished collective is not failed by a later failure of its communicator.
  EXPECT_TRUE(watchdog.Fail(comm, nullptr, "later trouble"));
  EXPECT_EQ(all[0]->status().state, State::kDone);
}

TEST(Watchdog, ShutdownWithInFlightWorkReturnsPromptly) {
  auto token = std::make_shared<int>(0);
  std::atomic<int> aborts{0};
  // A long poll interval: Shutdown must not wait for the next tick.
  auto watchdog = std::make_unique<Watchdog>(Options(milliseconds(20000), nullptr));
  auto comm = watchdog->AddCommunicator("c", [&] { ++aborts; });
  std::vector<std::shared_ptr<Watchdog::Collective>> in_flight;
  for (int i = 0; i < 10; ++i) {
    in_flight.push_back(watchdog->Watch(comm, "op", milliseconds(100000), [token] { return WatchPoll::Running(); }));
  }
  const auto start = Clock::now();
  watchdog->Shutdown();
  EXPECT_LT(MsSince(start), 1000);
  EXPECT_EQ(token.use_count(), 1);
  EXPECT_EQ(watchdog->num_watched(), 0u);
  EXPECT_EQ(aborts.load(), 0);
  EXPECT_EQ(in_flight[0]->status().state, State::kRunning);
  EXPECT_ERROR_CONTAINS(watchdog->Watch(comm, "late", milliseconds(1000), NeverCompletes()), "shut down");
  watchdog->Shutdown();  // idempotent
  const auto destroy_start = Clock::now();
  watchdog.reset();
  EXPECT_LT(MsSince(destroy_start), 1000);

  // The destructor alone also stops promptly.
  const auto start2 = Clock::now();
  {
    Watchdog other(Options(milliseconds(20000), nullptr));
    auto c = other.AddCommunicator("c", [] {});
    other.Watch(c, "op", milliseconds(100000), NeverCompletes());
  }
  EXPECT_LT(MsSince(start2), 1000);
}

TEST(Watchdog, NoFalseTimeoutForWorkCompletingJustBeforeItsDeadline) {
  // Ticks every 150 ms; the collective completes at 190 ms, deadline 200 ms. The first
  // tick after completion comes after the deadline: it must see "done", not time it out.
  Watchdog watchdog(Options(milliseconds(150), nullptr));
  std::atomic<int> aborts{0};
  auto comm = watchdog.AddCommunicator("c", [&] { ++aborts; });
  const auto start = Clock::now();
  const auto completes_at = start + milliseconds(190);
  auto w = watchdog.Watch(comm, "op", milliseconds(200), [completes_at] {
    return Clock::now() >= completes_at ? WatchPoll::Done() : WatchPoll::Running();
  });
  const WatchPoll s = w->Wait(milliseconds(10000));
  EXPECT_EQ(s.state, State::kDone) << s.error;
  EXPECT_GE(MsSince(start), 190);
  EXPECT_EQ(aborts.load(), 0);
  EXPECT_FALSE(comm->failed());
}

TEST(Watchdog, ExternalFailAbortsOnceAndFailsEveryCollective) {
  LogLines log;
  Watchdog watchdog(Options(milliseconds(5), &log));
  std::atomic<int> aborts{0};
  auto comm = watchdog.AddCommunicator("c", [&] { ++aborts; });
  auto w1 = watchdog.Watch(comm, "op #1", milliseconds(60000), NeverCompletes());
  auto w2 = watchdog.Watch(comm, "op #2", milliseconds(60000), NeverCompletes());
  EXPECT_TRUE(watchdog.Fail(comm, w1.get(), "op #1 timed out after 10 ms in Work::wait"));
  EXPECT_FALSE(watchdog.Fail(comm, w2.get(), "second"));  // first failure wins
  EXPECT_EQ(aborts.load(), 1);
  EXPECT_EQ(w1->status().error, "op #1 timed out after 10 ms in Work::wait");
  EXPECT_TRUE(absl::StrContains(w2->status().error,
                                "op #2 failed: communicator c aborted by "
                                "the watchdog after an earlier failure: op "
                                "#1 timed out"))
      << w2->status().error;
  ASSERT_TRUE(Eventually([&] { return watchdog.num_watched() == 0; }));
  EXPECT_EQ(aborts.load(), 1);
  EXPECT_EQ(log.Get().size(), 1u);
}

TEST(Watchdog, ConcurrentFailuresAbortExactlyOnce) {
  LogLines log;
  Watchdog watchdog(Options(milliseconds(1), &log));
  std::atomic<int> aborts{0};
  auto comm = watchdog.AddCommunicator("c", [&] {
    ++aborts;
    std::this_thread::sleep_for(milliseconds(5));  // widen the race window
  });
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  std::atomic<int> failed_registrations{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      while (!go) std::this_thread::yield();
      for (int i = 0; i < 50; ++i) {
        try {
          watchdog.Watch(comm, absl::StrCat("op ", t, ".", i), milliseconds(60000),
                         [] { return WatchPoll::Failed("boom"); });
        } catch (const c10::Error&) {
          ++failed_registrations;
        }
        if (i % 10 == 0) watchdog.Fail(comm, nullptr, absl::StrCat("thread ", t, " gave up"));
      }
    });
  }
  go = true;
  for (auto& th : threads) th.join();
  ASSERT_TRUE(Eventually([&] { return watchdog.num_watched() == 0; }));
  EXPECT_EQ(aborts.load(), 1);
  EXPECT_EQ(log.Get().size(), 1u);
  EXPECT_GT(failed_registrations.load(), 0);
  EXPECT_TRUE(comm->failed());
}

TEST(Watchdog, AbortThatThrowsStillFailsTheCommunicator) {
  LogLines log;
  Watchdog watchdog(Options(milliseconds(2), &log));
  auto comm = watchdog.AddCommunicator("c", [] { throw std::runtime_error("abort broke"); });
  auto w = watchdog.Watch(comm, "op", milliseconds(10), NeverCompletes());
  EXPECT_EQ(w->Wait(milliseconds(10000)).state, State::kFailed);
  ASSERT_TRUE(Eventually([&] { return log.Get().size() == 1; }));
  EXPECT_TRUE(absl::StrContains(log.Get()[0], "abort broke")) << log.Get()[0];
}

TEST(Watchdog, RejectsBadArguments) {
  EXPECT_ERROR_CONTAINS(Watchdog(Options(milliseconds(0), nullptr)), "poll_interval");
  Watchdog watchdog(Options(milliseconds(5), nullptr));
  auto comm = watchdog.AddCommunicator("c", [] {});
  EXPECT_ERROR_CONTAINS(watchdog.Watch(comm, "op", milliseconds(0), NeverCompletes()), "timeout must be positive");
  EXPECT_ERROR_CONTAINS(watchdog.Watch(nullptr, "op", milliseconds(10), NeverCompletes()), "null communicator");
}

}  // namespace
}  // namespace fsdp::comm
