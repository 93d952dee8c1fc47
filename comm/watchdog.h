// Watchdog: a background thread that enforces per-collective deadlines even when nobody
// waits, and turns the first timeout or failure on a communicator into one abort plus a
// clear error for every in-flight and later collective of that communicator (PyTorch's
// ProcessGroupNCCL watchdog, backend-agnostic: backends supply poll and abort callbacks).
//
// Usage (one Watchdog may serve several communicators, e.g. a group and its subgroups):
//   auto watchdog = std::make_shared<Watchdog>();
//   auto comm = watchdog->AddCommunicator("nccl rank 1/4 on cuda:1", [c] { c->Abort(); });
//   comm->ThrowIfFailed(what);                  // before enqueueing (sticky error)
//   ... enqueue the collective ...
//   auto watched = watchdog->Watch(comm, what, timeout, [e] { return PollEvent(e); });
//   ... Work::wait polls its own completion and watched->status() ...
#ifndef FSDP_COMM_WATCHDOG_H_
#define FSDP_COMM_WATCHDOG_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/work.h"

namespace fsdp::comm {

// What one non-blocking poll of a collective found.
struct WatchPoll {
  enum class State { kRunning, kDone, kFailed };

  static WatchPoll Running() { return {State::kRunning, ""}; }
  static WatchPoll Done() { return {State::kDone, ""}; }
  static WatchPoll Failed(std::string error) { return {State::kFailed, std::move(error)}; }

  State state = State::kRunning;
  // kFailed: the complete error message (see Watchdog::Collective::status); else empty.
  std::string error;
};

struct WatchdogOptions {
  // How often the thread polls every in-flight collective; also bounds how late a
  // timeout is detected. Must be positive.
  std::chrono::milliseconds poll_interval{5};
  // Receives the one line logged per failed communicator (no trailing newline).
  // Null: the line goes to stderr. Called on the thread that failed the communicator.
  std::function<void(const std::string&)> log;
};

// Thread-safe: every method may be called from any thread.
class Watchdog {
 public:
  // A communicator: the unit that is aborted and fails as a whole. Created by
  // AddCommunicator; healthy until its first failure, failed (sticky) from then on.
  class Communicator {
   public:
    const std::string& name() const { return name_; }
    // True once a collective of this communicator timed out or failed. Never resets.
    bool failed() const { return failed_.load(std::memory_order_acquire); }
    // The first failure's message ("" while healthy).
    std::string error() const;
    // Throws c10::DistBackendError "<what> failed: communicator <name> was aborted by the
    // watchdog earlier: <error()>" once failed; no-op while healthy.
    void ThrowIfFailed(const std::string& what) const;
    // Collectives registered and neither done nor failed.
    size_t num_in_flight() const;

   private:
    friend class Watchdog;
    Communicator(std::string name, std::function<void()> abort) : name_(std::move(name)), abort_(std::move(abort)) {}

    const std::string name_;
    const std::function<void()> abort_;
    std::atomic<bool> failed_{false};
    mutable std::mutex mu_;
    std::condition_variable cv_;     // signalled when a collective finishes or it fails
    std::string error_;              // guarded by mu_
    const void* culprit_ = nullptr;  // guarded by mu_: the Collective that failed first
    size_t in_flight_ = 0;           // guarded by mu_
  };

  // One registered collective. Its status is decided once: done (its poll said so before
  // the communicator failed) or failed (its communicator failed first).
  class Collective {
   public:
    const std::string& description() const { return description_; }
    std::chrono::steady_clock::time_point deadline() const { return deadline_; }
    // Never blocks on the poll. kFailed carries the message:
    // - the collective that timed out: "<description> timed out after <T> ms (...);
    //   communicator <name> aborted by the watchdog";
    // - the one whose poll failed: "<description> failed: <poll error>; communicator <name>
    //   aborted by the watchdog";
    // - every other one of the communicator: "<description> failed: communicator <name>
    //   aborted by the watchdog after an earlier failure: <first message>".
    WatchPoll status() const;
    // Blocks until status() is not kRunning or `timeout` passed; returns status().
    WatchPoll Wait(Timeout timeout) const;

   private:
    friend class Watchdog;
    Collective(std::shared_ptr<Communicator> comm, std::string description, Timeout timeout,
               std::function<WatchPoll()> poll);

    const std::shared_ptr<Communicator> comm_;
    const std::string description_;
    const Timeout timeout_;
    const std::chrono::steady_clock::time_point start_;
    const std::chrono::steady_clock::time_point deadline_;
    std::function<WatchPoll()> poll_;  // only the watchdog thread calls it; reset when finished
    bool done_ = false;                // guarded by comm_->mu_
  };

  // Starts the thread. Throws c10::Error on a non-positive poll_interval.
  explicit Watchdog(WatchdogOptions options = {});
  // Shutdown().
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // `name` names the communicator in messages (e.g. "nccl rank 1/4 on cuda:1"). `abort` is
  // called at most once, on the thread that detects the first failure (usually the
  // watchdog's): it must return promptly and should not throw (a throw is logged).
  std::shared_ptr<Communicator> AddCommunicator(std::string name, std::function<void()> abort);

  // Starts watching a collective already enqueued on `comm`; its deadline is now +
  // `timeout` (positive). `poll` must not block; it is called only on the watchdog thread,
  // every poll_interval, until it reports kDone or kFailed (a throw counts as kFailed) or
  // the communicator failed, and is destroyed then. A collective still running at its
  // deadline times out. Throws comm->ThrowIfFailed's error when `comm` already failed, and
  // c10::Error after Shutdown().
  std::shared_ptr<Collective> Watch(const std::shared_ptr<Communicator>& comm, std::string description, Timeout timeout,
                                    std::function<WatchPoll()> poll);

  // Fails `comm` from outside the thread (e.g. Work::wait saw a timeout or an async error):
  // as for a failure the thread detected, unless `comm` already failed (then a no-op).
  // `culprit` (may be null) gets exactly `message` as its error; other collectives name it.
  // Returns whether this call failed the communicator.
  bool Fail(const std::shared_ptr<Communicator>& comm, const Collective* culprit, const std::string& message);

  // Stops and joins the thread promptly (it does not wait for collectives or deadlines),
  // then drops the watched collectives and destroys their polls; their statuses stay as
  // they are (running ones never finish). Idempotent.
  void Shutdown();

  // Collectives registered and not yet dropped by the thread (finished ones are dropped
  // within one poll_interval), over all communicators.
  size_t num_watched() const { return num_watched_.load(std::memory_order_acquire); }

 private:
  void Run();
  // Polls every watched collective once; drops the finished ones.
  void Tick();

  const WatchdogOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;                                  // guarded by mu_
  std::vector<std::shared_ptr<Collective>> incoming_;  // guarded by mu_
  std::vector<std::shared_ptr<Collective>> watched_;   // the thread's own
  std::atomic<size_t> num_watched_{0};
  std::mutex join_mu_;  // serializes Shutdown's join
  std::thread thread_;
};

}  // namespace fsdp::comm

#endif  // FSDP_COMM_WATCHDOG_H_
