// The CPU streams: inline (the host thread) and async (a worker thread per stream).
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <deque>
#include <thread>

#include "device/internal/pools.h"
#include "device/stream.h"

namespace fsdp::device {
namespace {

// Work runs on the calling thread, so its errors are thrown by the call that ran it.
// Collectives stay pending (the backend runs them): later Launches on this stream wait for
// them first, events recorded meanwhile cover them.
class InlineStream final : public Stream {
 public:
  InlineStream(const std::string& name, Timeout timeout) : Stream(name, timeout) {}

  void Launch(TaskRef<void> fn) override {
    Drain();
    fn();
  }

  void LaunchCollective(CollectiveSequencer& sequencer, TaskRef<comm::WorkPtr> issue) override {
    const uint64_t ticket = sequencer.TakeTicket();
    internal::PruneFinished(pending_);
    pending_.push_back(sequencer.IssueInTurn(ticket, issue, timeout()));
  }

  EventPtr RecordEvent() override {
    internal::PruneFinished(pending_);
    if (pending_.empty()) return Event::Completed();
    auto event = std::make_shared<Event>(name(), /*completed=*/true);
    for (const auto& w : pending_) event->AddPendingWork(w);
    return event;
  }

  void WaitEvent(const EventPtr& event) override { event->Synchronize(timeout()); }

  void Synchronize() override { Drain(); }

 private:
  void Drain() {
    if (pending_.empty()) return;
    std::vector<comm::WorkPtr> pending;
    pending.swap(pending_);
    for (const auto& w : pending) w->wait();  // the group's own collective timeout
    pending.clear();
    if (pending_.empty()) pending_.swap(pending);  // keeps the capacity: no allocation per collective
  }

  std::vector<comm::WorkPtr> pending_;
};

// One worker thread runs the stream's tasks in order. The first task that throws fails the
// stream: later Launches are skipped, later collectives give up their turn with that error
// (so the rank's issue order stays consistent), later events carry the error.
class AsyncCpuStream final : public Stream {
 public:
  AsyncCpuStream(const std::string& name, Timeout timeout, std::chrono::microseconds delay)
      : Stream(name, timeout), delay_(delay), worker_([this] { Run(); }) {}

  ~AsyncCpuStream() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();  // every task carries a deadline (collective or event timeout)
  }

  void Launch(TaskRef<void> fn) override {
    Enqueue([this, fn = fn.Take()](const std::exception_ptr& failed) {
      if (failed) return;
      Delay();
      at::NoGradGuard no_grad;  // grad mode is thread-local: the host's does not carry over
      fn();
    });
  }

  void LaunchCollective(CollectiveSequencer& sequencer, TaskRef<comm::WorkPtr> issue) override {
    const uint64_t ticket = sequencer.TakeTicket();  // program order: taken on the host
    Enqueue([this, &sequencer, ticket, issue = issue.Take()](const std::exception_ptr& failed) {
      if (failed) {  // give up the turn, keeping the rank's order consistent
        sequencer.IssueInTurn(
            ticket, [&]() -> comm::WorkPtr { std::rethrow_exception(failed); }, timeout());
        return;
      }
      Delay();
      comm::WorkPtr work = sequencer.IssueInTurn(ticket, issue, timeout());
      work->wait();  // the group's own collective timeout
    });
  }

  EventPtr RecordEvent() override {
    auto event = std::make_shared<Event>(name());
    Enqueue([event](const std::exception_ptr& failed) { event->Complete(failed); });
    return event;
  }

  void WaitEvent(const EventPtr& event) override {
    Enqueue([this, event](const std::exception_ptr& failed) {
      if (!failed) event->Synchronize(timeout());
    });
  }

  void Synchronize() override { RecordEvent()->Synchronize(timeout()); }

 private:
  using QueuedTask = std::function<void(const std::exception_ptr& failed)>;

  void Enqueue(QueuedTask task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

  void Delay() const {
    if (delay_.count() > 0) std::this_thread::sleep_for(delay_);
  }

  void Run() {
    std::exception_ptr failed;  // only this thread touches it
    for (;;) {
      QueuedTask task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        task(failed);
      } catch (...) {
        if (!failed) failed = std::current_exception();
      }
    }
  }

  const std::chrono::microseconds delay_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<QueuedTask> queue_;
  bool stop_ = false;
  std::thread worker_;  // last: starts after the members it uses
};

class CpuStreamPool final : public StreamPool {
 public:
  explicit CpuStreamPool(const StreamOptions& options) : StreamPool(options), compute_("compute", options.timeout) {}

  Stream& current() override { return compute_; }

  StreamPtr NewStream(const std::string& name) override {
    if (options().cpu_mode == CpuStreamMode::kInline) return NewInlineStream(name, options().timeout);
    return NewAsyncCpuStream(name, options().timeout, options().cpu_task_delay);
  }

 private:
  InlineStream compute_;  // the host thread
};

}  // namespace

StreamPtr NewInlineStream(const std::string& name, Timeout timeout) {
  return std::make_shared<InlineStream>(name, timeout);
}

StreamPtr NewAsyncCpuStream(const std::string& name, Timeout timeout, std::chrono::microseconds task_delay) {
  TORCH_CHECK(task_delay.count() >= 0, "NewAsyncCpuStream: task_delay must be >= 0 us, got ", task_delay.count());
  return std::make_shared<AsyncCpuStream>(name, timeout, task_delay);
}

namespace internal {
std::shared_ptr<StreamPool> CreateCpuStreamPool(const StreamOptions& options) {
  return std::make_shared<CpuStreamPool>(options);
}
}  // namespace internal

}  // namespace fsdp::device
