// Work: the handle of one asynchronous collective.
#ifndef FSDP_COMM_WORK_H_
#define FSDP_COMM_WORK_H_

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>

namespace fsdp::comm {

class FlightRecorder;
class ProcessGroup;

using Timeout = std::chrono::milliseconds;

// The default deadline of a collective, a stream's host wait and the rate limiter's event
// wait: 5 minutes. PyTorch's default_pg_timeout (torch/distributed/constants.py) is 30
// minutes; we fail sooner because a hung peer is the common cause and the whole job waits.
// Every ProcessGroup / stream option takes its own timeout.
inline constexpr Timeout kDefaultTimeout{300000};

// The handle a collective returns. Output tensors hold the result only after wait()
// returned. Not thread-safe: one rank's thread owns its Work objects.
class Work {
 public:
  // Builds a description on demand (see description()).
  using DescriptionFn = std::function<std::string()>;
  virtual ~Work() = default;

  // True once the collective finished, successfully or with an error. Never blocks.
  virtual bool is_completed() = 0;

  // Blocks until the collective finished (using the group's timeout, or `timeout`).
  // Throws c10::DistBackendError when the collective failed (the backend's message) or did
  // not finish in time (the message says "timed out", the collective and the wait).
  // After one successful wait, later waits return at once (streams and events may wait for
  // one collective more than once).
  void wait();
  void wait(Timeout timeout);

  // The error of a failed collective; null while running or after success.
  virtual std::exception_ptr exception() = 0;

  // "all_reduce(SUM) Float[6] #3 on threaded rank 1/4": used in every error message. A
  // backend may give it lazily (a DescriptionFn): built on the first call, so a collective
  // that never fails or is never traced builds no string.
  const std::string& description() const;

  // Runs `fn` on the waiting thread right after a successful wait, before wait() returns
  // (used for post-processing such as AVG's division on backends without AVG).
  void AddCompletionStep(std::function<void()> fn);

 protected:
  Work(std::string description, Timeout default_timeout)
      : description_(std::move(description)), default_timeout_(default_timeout) {}
  Work(DescriptionFn describe, Timeout default_timeout)
      : describe_(std::move(describe)), default_timeout_(default_timeout) {}

  // Waits up to `timeout`; returns false if the collective is still running then.
  virtual bool WaitFor(Timeout timeout) = 0;
  // Extra context for a timeout message (e.g. which ranks never joined).
  virtual std::string TimeoutDetail() { return ""; }
  // After the first successful wait (and its completion step): the backend drops what it
  // kept for the collective (ProcessGroupGloo's work holds its tensors, and a reduce-scatter's
  // copy of the input), so no memory stays with a finished collective that a stream or an
  // event still lists. is_completed() and exception() stay valid (true / null) after it.
  virtual void ReleaseAfterWait() {}

 private:
  friend class ProcessGroup;
  // Failures dump, and success completes, the collective's flight recorder entry.
  void OnWaitFailed(const std::string& reason);

  FlightRecorder* recorder_ = nullptr;  // the entry's ring, when recorded
  int64_t record_id_ = -1;
  mutable std::string description_;
  mutable std::function<std::string()> describe_;  // until description() ran
  Timeout default_timeout_;
  std::function<void()> completion_step_;
  bool completion_step_done_ = false;
  bool waited_ = false;
};

using WorkPtr = std::shared_ptr<Work>;

// A Work that is already finished (zero-element collectives, world size 1, the Fake group);
// its description given, or built only when asked for.
WorkPtr MakeCompletedWork(std::string description);
WorkPtr MakeCompletedWork(std::function<std::string()> describe);

}  // namespace fsdp::comm

#endif  // FSDP_COMM_WORK_H_
