#include "device/stream.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <thread>
#include <vector>

#include "comm/process_group.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::device {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

constexpr Timeout kTimeout(10000);

StreamPtr SlowStream(const std::string& name, milliseconds delay = milliseconds(30)) {
  return NewAsyncCpuStream(name, kTimeout, std::chrono::duration_cast<microseconds>(delay));
}

TEST(AsyncCpuStream, RunsTasksInOrderOffTheHostThread) {
  auto stream = NewAsyncCpuStream("side", kTimeout, microseconds(0));
  std::vector<int> order;
  std::thread::id worker;
  stream->Launch([&] {
    order.push_back(1);
    worker = std::this_thread::get_id();
  });
  stream->Launch([&] { order.push_back(2); });
  stream->Synchronize();
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  EXPECT_NE(worker, std::this_thread::get_id());
}

// The ordering bug the async implementation exists to expose: work produced on a side
// stream and consumed on the compute stream without waiting for it.
double ProduceOnSideStreamThenConsume(bool wait) {
  auto pool = StreamPool::Create(c10::Device(c10::kCPU), {CpuStreamMode::kAsync, microseconds(30000), kTimeout});
  StreamPtr side = pool->NewStream("all_gather");
  at::Tensor data = at::zeros({4});
  side->Launch([data]() mutable { data.fill_(1.0); });
  EventPtr produced = side->RecordEvent();
  if (wait) pool->current().WaitEvent(produced);
  const double seen = data.sum().item<double>();
  side->Synchronize();
  return seen;
}

TEST(AsyncCpuStream, OmittedWaitReadsStaleDataAndTheWaitFixesIt) {
  EXPECT_EQ(ProduceOnSideStreamThenConsume(/*wait=*/true), 4.0);
  // Without the wait the host reads before the side stream wrote: the test that omits a
  // wait fails here instead of passing by luck on a synchronous implementation.
  EXPECT_EQ(ProduceOnSideStreamThenConsume(/*wait=*/false), 0.0);
}

TEST(AsyncCpuStream, WaitStreamOrdersWorkAcrossStreams) {
  auto producer = SlowStream("producer");
  auto consumer = NewAsyncCpuStream("consumer", kTimeout, microseconds(0));
  at::Tensor data = at::zeros({3});
  at::Tensor seen = at::full({1}, -1.0);
  producer->Launch([data]() mutable { data.fill_(2.0); });
  consumer->WaitStream(*producer);
  consumer->Launch([data, seen]() mutable { seen.fill_(data.sum().item<double>()); });
  consumer->Synchronize();
  EXPECT_EQ(seen.item<double>(), 6.0);
}

TEST(AsyncCpuStream, FirstErrorSkipsLaterWorkAndReachesEveryEvent) {
  auto stream = NewAsyncCpuStream("reduce_scatter", kTimeout, microseconds(0));
  std::atomic<bool> ran_after{false};
  stream->Launch([] { TORCH_CHECK(false, "copy-in exploded"); });
  stream->Launch([&] { ran_after = true; });
  EventPtr event = stream->RecordEvent();
  EXPECT_ERROR_CONTAINS(event->Synchronize(kTimeout), "copy-in exploded");
  EXPECT_ERROR_CONTAINS(stream->Synchronize(), "copy-in exploded");
  EXPECT_FALSE(ran_after);
  // A host wait on the failed event rethrows it too (how FSDP sees a failed side stream).
  auto pool = StreamPool::Create(c10::Device(c10::kCPU), {});
  EXPECT_ERROR_CONTAINS(pool->current().WaitEvent(event), "copy-in exploded");
}

TEST(AsyncCpuStream, WaitOnAnEventThatNeverCompletesTimesOut) {
  auto stream = NewAsyncCpuStream("all_gather", Timeout(200), microseconds(0));
  auto never = std::make_shared<Event>("forgotten");
  stream->WaitEvent(never);
  EXPECT_ERROR_CONTAINS(stream->RecordEvent()->Synchronize(kTimeout), "did not finish within 200 ms");
}

TEST(Stream, KeepAliveHoldsStorageUntilEarlierWorkFinished) {
  auto stream = SlowStream("reduce_scatter");
  at::Tensor buffer = at::ones({16});
  c10::weak_intrusive_ptr<c10::StorageImpl> weak(buffer.storage().getWeakStorageImpl());
  stream->Launch([] {});  // slow: still queued when the host drops its reference
  stream->KeepAlive(buffer);
  buffer.reset();
  EXPECT_FALSE(weak.expired());
  stream->Synchronize();
  EXPECT_TRUE(weak.expired());
}

TEST(InlineStream, RecordsTheSharedCompletedEventWhenNothingIsPending) {
  auto pool = StreamPool::Create(c10::Device(c10::kCPU), {});
  StreamPtr stream = pool->NewStream("copy_in");
  stream->Launch([] {});
  EventPtr done = stream->RecordEvent();
  EXPECT_EQ(done, Event::Completed());
  EXPECT_TRUE(done->Query());
  done->Synchronize(Timeout(1));
  stream->WaitEvent(done);
  // Nobody may make it pending again: every stream records this one instance.
  EXPECT_ERROR_CONTAINS(done->AddPendingWork(nullptr), "shared completed event");
  EXPECT_ERROR_CONTAINS(done->Complete(), "shared completed event");
  EXPECT_TRUE(Event::Completed()->Query());
}

// Counts the copies made of it and its runs (moves are free).
struct CountingTask {
  int* copies;
  int* runs;
  CountingTask(int* c, int* r) : copies(c), runs(r) {}
  CountingTask(const CountingTask& other) : copies(other.copies), runs(other.runs) { ++*copies; }
  CountingTask(CountingTask&&) = default;
  void operator()() const { ++*runs; }
};

TEST(TaskRef, InlineStreamRunsTheCallableInPlace) {
  int copies = 0, runs = 0;
  auto stream = NewInlineStream("inline", kTimeout);
  stream->Launch(CountingTask(&copies, &runs));
  const CountingTask named(&copies, &runs);
  stream->Launch(named);
  EXPECT_EQ(runs, 2);
  EXPECT_EQ(copies, 0);  // no std::function in between
}

TEST(TaskRef, AsyncStreamMovesAnRvalueAndCopiesAnLvalue) {
  int copies = 0, runs = 0;
  auto stream = NewAsyncCpuStream("side", kTimeout, microseconds(0));
  stream->Launch(CountingTask(&copies, &runs));
  stream->Synchronize();
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(copies, 0);
  CountingTask named(&copies, &runs);
  stream->Launch(named);  // the caller's callable stays usable
  stream->Synchronize();
  named();
  EXPECT_EQ(runs, 3);
  EXPECT_EQ(copies, 1);
}

TEST(InlineStream, CollectiveStaysPendingAndItsEventCoversIt) {
  testing::RunOnRanks(testing::Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& group) {
    auto pool = StreamPool::Create(c10::Device(c10::kCPU), {});
    StreamPtr stream = pool->NewStream("all_gather");
    at::Tensor t = at::full({2}, static_cast<double>(group->rank() + 1));
    if (group->rank() == 1) std::this_thread::sleep_for(milliseconds(200));
    stream->LaunchCollective(pool->sequencer(), [&] { return group->all_reduce(t, comm::ReduceOp::Sum()); });
    EventPtr done = stream->RecordEvent();
    if (group->rank() == 0) {
      EXPECT_FALSE(done->Query());  // rank 1 has not joined yet
    }
    pool->current().WaitEvent(done);
    EXPECT_TRUE(at::equal(t, at::full({2}, 3.0)));
  });
}

// Two async streams of one rank issue collectives; rank 0's first stream is slow. Issued in
// worker order, rank 0 would pair its second collective with rank 1's first.
TEST(CollectiveSequencer, KeepsProgramOrderAcrossAsyncStreams) {
  testing::RunOnRanks(testing::Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& group) {
    CollectiveSequencer sequencer;
    auto first = group->rank() == 0 ? SlowStream("reduce_scatter", milliseconds(150))
                                    : NewAsyncCpuStream("reduce_scatter", kTimeout, microseconds(0));
    auto second = NewAsyncCpuStream("all_gather", kTimeout, microseconds(0));
    at::Tensor a = at::full({3}, static_cast<double>(group->rank() + 1));
    at::Tensor b = at::full({5}, 10.0 * (group->rank() + 1));
    first->LaunchCollective(sequencer, [&] { return group->all_reduce(a, comm::ReduceOp::Sum()); });
    second->LaunchCollective(sequencer, [&] { return group->all_reduce(b, comm::ReduceOp::Sum()); });
    first->Synchronize();
    second->Synchronize();
    EXPECT_TRUE(at::equal(a, at::full({3}, 3.0)));
    EXPECT_TRUE(at::equal(b, at::full({5}, 30.0)));
  });
}

TEST(CollectiveSequencer, AFailedIssueSkipsEveryLaterCollective) {
  CollectiveSequencer sequencer;
  const uint64_t t0 = sequencer.TakeTicket(), t1 = sequencer.TakeTicket();
  EXPECT_ERROR_CONTAINS(sequencer.IssueInTurn(
                            t0, []() -> comm::WorkPtr { TORCH_CHECK(false, "gloo: peer gone"); }, kTimeout),
                        "peer gone");
  bool issued = false;
  EXPECT_ERROR_CONTAINS(sequencer.IssueInTurn(
                            t1,
                            [&] {
                              issued = true;
                              return comm::MakeCompletedWork("x");
                            },
                            kTimeout),
                        "peer gone");
  EXPECT_FALSE(issued);
}

TEST(CollectiveSequencer, ATurnThatNeverComesTimesOut) {
  CollectiveSequencer sequencer;
  (void)sequencer.TakeTicket();  // taken, never issued
  const uint64_t t1 = sequencer.TakeTicket();
  EXPECT_ERROR_CONTAINS(sequencer.IssueInTurn(
                            t1, [] { return comm::MakeCompletedWork("x"); }, Timeout(100)),
                        "waited 100 ms for collective #0");
}

TEST(StreamOptions, ParsesAndRejectsFsdpCpuStreams) {
  ::setenv("FSDP_CPU_STREAMS", "async:250", 1);
  StreamOptions options = StreamOptionsFromEnv();
  EXPECT_EQ(options.cpu_mode, CpuStreamMode::kAsync);
  EXPECT_EQ(options.cpu_task_delay.count(), 250);
  ::setenv("FSDP_CPU_STREAMS", "inline", 1);
  EXPECT_EQ(StreamOptionsFromEnv().cpu_mode, CpuStreamMode::kInline);
  ::setenv("FSDP_CPU_STREAMS", "threads", 1);
  EXPECT_ERROR_CONTAINS(StreamOptionsFromEnv(),
                        "FSDP_CPU_STREAMS must be 'inline', 'async' or 'async:<microseconds>', got 'threads'");
  ::setenv("FSDP_CPU_STREAMS", "async:-3", 1);
  EXPECT_ERROR_CONTAINS(StreamOptionsFromEnv(), "got '-3'");
  ::unsetenv("FSDP_CPU_STREAMS");
  // Unset, the options the caller chose stand; set, the variable overrides them.
  const StreamOptions chosen{CpuStreamMode::kAsync, microseconds(7), Timeout(5)};
  EXPECT_EQ(ApplyStreamEnvOverride(chosen).cpu_mode, CpuStreamMode::kAsync);
  EXPECT_EQ(ApplyStreamEnvOverride(chosen).cpu_task_delay.count(), 7);
  EXPECT_EQ(ApplyStreamEnvOverride(chosen).timeout, Timeout(5));
  ::setenv("FSDP_CPU_STREAMS", "inline", 1);
  EXPECT_EQ(ApplyStreamEnvOverride(chosen).cpu_mode, CpuStreamMode::kInline);
  EXPECT_EQ(ApplyStreamEnvOverride(chosen).timeout, Timeout(5));
  ::unsetenv("FSDP_CPU_STREAMS");
  EXPECT_ERROR_CONTAINS(
      StreamPool::Create(c10::Device(c10::kCPU), {CpuStreamMode::kInline, microseconds(0), Timeout(0)}),
      "options.timeout must be positive, got 0 ms");
#ifndef FSDP_WITH_CUDA
  EXPECT_ERROR_CONTAINS(StreamPool::Create(c10::Device(c10::kCUDA, 0), {}), "rebuild with --config=cuda");
#endif
}

}  // namespace
}  // namespace fsdp::device
