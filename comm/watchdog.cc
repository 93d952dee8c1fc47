#include "comm/watchdog.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fsdp::comm {

using Clock = std::chrono::steady_clock;

// ------------------------------------------------------------------ Communicator

std::string Watchdog::Communicator::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void Watchdog::Communicator::ThrowIfFailed(const std::string& what) const {
  if (!failed()) return;
  const std::string first = error();
  TORCH_CHECK_WITH(DistBackendError, false, what, " failed: communicator ", name_,
                   " was aborted by the watchdog earlier: ", first);
}

size_t Watchdog::Communicator::num_in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_;
}

// ------------------------------------------------------------------ Collective

Watchdog::Collective::Collective(std::shared_ptr<Communicator> comm, std::string description, Timeout timeout,
                                 std::function<WatchPoll()> poll)
    : comm_(std::move(comm)),
      description_(std::move(description)),
      timeout_(timeout),
      start_(Clock::now()),
      deadline_(start_ + timeout),
      poll_(std::move(poll)) {}

WatchPoll Watchdog::Collective::status() const {
  std::lock_guard<std::mutex> lock(comm_->mu_);
  if (done_) return WatchPoll::Done();
  if (!comm_->failed_.load(std::memory_order_relaxed)) return WatchPoll::Running();
  if (comm_->culprit_ == this) return WatchPoll::Failed(comm_->error_);
  return WatchPoll::Failed(absl::StrCat(description_, " failed: communicator ", comm_->name_,
                                        " aborted by the watchdog after an earlier failure: ", comm_->error_));
}

WatchPoll Watchdog::Collective::Wait(Timeout timeout) const {
  {
    std::unique_lock<std::mutex> lock(comm_->mu_);
    comm_->cv_.wait_for(lock, timeout, [&] { return done_ || comm_->failed_.load(std::memory_order_relaxed); });
  }
  return status();
}

// ------------------------------------------------------------------ Watchdog

Watchdog::Watchdog(WatchdogOptions options) : options_(std::move(options)) {
  TORCH_CHECK(options_.poll_interval.count() > 0, "Watchdog: poll_interval must be positive, got ",
              options_.poll_interval.count(), " ms");
  thread_ = std::thread([this] { Run(); });
}

Watchdog::~Watchdog() { Shutdown(); }

std::shared_ptr<Watchdog::Communicator> Watchdog::AddCommunicator(std::string name, std::function<void()> abort) {
  return std::shared_ptr<Communicator>(new Communicator(std::move(name), std::move(abort)));
}

std::shared_ptr<Watchdog::Collective> Watchdog::Watch(const std::shared_ptr<Communicator>& comm,
                                                      std::string description, Timeout timeout,
                                                      std::function<WatchPoll()> poll) {
  TORCH_CHECK(comm != nullptr, "Watchdog::Watch(", description, "): null communicator");
  TORCH_CHECK(timeout.count() > 0, "Watchdog::Watch(", description, "): timeout must be positive, got ",
              timeout.count(), " ms");
  TORCH_CHECK(poll != nullptr, "Watchdog::Watch(", description, "): null poll");
  std::shared_ptr<Collective> collective(new Collective(comm, std::move(description), timeout, std::move(poll)));
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!stop_, "Watchdog::Watch(", collective->description(), "): the watchdog was shut down");
  bool failed = false;
  {
    // Under comm->mu_: a failure either happened before (throw) or will count this one.
    std::lock_guard<std::mutex> comm_lock(comm->mu_);
    failed = comm->failed_.load(std::memory_order_relaxed);
    if (!failed) ++comm->in_flight_;
  }
  if (failed) comm->ThrowIfFailed(collective->description());
  incoming_.push_back(collective);
  num_watched_.fetch_add(1, std::memory_order_acq_rel);
  return collective;
}

bool Watchdog::Fail(const std::shared_ptr<Communicator>& comm, const Collective* culprit, const std::string& message) {
  TORCH_CHECK(comm != nullptr, "Watchdog::Fail: null communicator");
  size_t in_flight = 0;
  {
    std::lock_guard<std::mutex> lock(comm->mu_);
    if (comm->failed_.load(std::memory_order_relaxed)) return false;
    comm->error_ = message;
    comm->culprit_ = culprit;
    in_flight = comm->in_flight_;
    comm->in_flight_ = 0;  // every in-flight collective fails with the communicator
    // Set before the abort: a collective whose kernels exit because of the abort must not
    // be mistaken for one that completed.
    comm->failed_.store(true, std::memory_order_release);
  }
  std::string abort_note;
  try {
    if (comm->abort_) comm->abort_();
  } catch (const std::exception& e) {
    abort_note = absl::StrCat(" (the abort threw: ", e.what(), ")");
  } catch (...) {
    abort_note = " (the abort threw an unknown exception)";
  }
  // Waiters wake once the abort returned (failed_ was set under mu_: no lost wake-up).
  comm->cv_.notify_all();
  const std::string line = absl::StrCat("[fsdp watchdog] ", message, abort_note, " [communicator ", comm->name_,
                                        " aborted; ", in_flight, " in-flight collective(s) failed]");
  try {
    if (options_.log) {
      options_.log(line);
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
      std::fflush(stderr);
    }
  } catch (...) {
  }
  return true;
}

void Watchdog::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  std::lock_guard<std::mutex> join_lock(join_mu_);
  if (!thread_.joinable()) return;
  if (thread_.get_id() == std::this_thread::get_id()) {
    thread_.detach();  // the last owner let go on the watchdog thread itself
    return;
  }
  thread_.join();
  // The thread is gone: release what the polls hold. Statuses stay as they are.
  std::lock_guard<std::mutex> lock(mu_);
  for (auto* list : {&incoming_, &watched_}) {
    for (auto& c : *list) c->poll_ = nullptr;
    num_watched_.fetch_sub(list->size(), std::memory_order_acq_rel);
    list->clear();
  }
}

void Watchdog::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait_for(lock, options_.poll_interval, [&] { return stop_; });
    if (stop_) return;
    for (auto& c : incoming_) watched_.push_back(std::move(c));
    incoming_.clear();
    lock.unlock();
    Tick();
    lock.lock();
  }
}

void Watchdog::Tick() {
  size_t kept = 0;
  for (size_t i = 0; i < watched_.size(); ++i) {
    std::shared_ptr<Collective>& c = watched_[i];
    Communicator& comm = *c->comm_;
    bool finished = comm.failed();
    if (!finished) {
      // Time first: a collective that finishes during its poll is not timed out.
      const Clock::time_point before_poll = Clock::now();
      WatchPoll result;
      try {
        result = c->poll_();
      } catch (const std::exception& e) {
        result = WatchPoll::Failed(absl::StrCat("its poll threw: ", e.what()));
      } catch (...) {
        result = WatchPoll::Failed("its poll threw an unknown exception");
      }
      if (result.state == WatchPoll::State::kDone) {
        {
          std::lock_guard<std::mutex> lock(comm.mu_);
          if (!comm.failed_.load(std::memory_order_relaxed)) {
            c->done_ = true;
            --comm.in_flight_;
          }
        }
        comm.cv_.notify_all();
        finished = true;
      } else if (result.state == WatchPoll::State::kFailed) {
        Fail(c->comm_, c.get(),
             absl::StrCat(c->description_, " failed: ", result.error, "; communicator ", comm.name_,
                          " aborted by the watchdog"));
        finished = true;
      } else if (before_poll >= c->deadline_) {
        const auto ran = std::chrono::duration_cast<std::chrono::milliseconds>(before_poll - c->start_);
        Fail(c->comm_, c.get(),
             absl::StrCat(c->description_, " timed out after ", c->timeout_.count(), " ms (watchdog: still running ",
                          ran.count(), " ms after it was enqueued); communicator ", comm.name_,
                          " aborted by the watchdog"));
        finished = true;
      }
    }
    if (finished) {
      c->poll_ = nullptr;  // releases what the poll holds (events, buffers) now
      c.reset();
      num_watched_.fetch_sub(1, std::memory_order_acq_rel);
    } else {
      if (kept != i) watched_[kept] = std::move(c);
      ++kept;
    }
  }
  watched_.resize(kept);
}

}  // namespace fsdp::comm
