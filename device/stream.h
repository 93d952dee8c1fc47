// Device-generic streams and events: the execution model FSDP's overlap is written in
// (PyTorch's torch.cuda.Stream / Event as used by _fsdp_param_group.py and FSDP1's
// _runtime_utils.py), with three implementations:
// - inline (CPU default): work runs on the calling thread; a collective is issued at once
//   and stays pending on the stream, so its all-gather overlaps the host's compute exactly
//   as a backend's asynchronous Work does.
// - async (CPU, FSDP_CPU_STREAMS=async): each stream is a worker thread executing its queue
//   in order, so copy-ins, collectives and gradient reductions really run concurrently with
//   the host's compute. A missing wait then reads stale data (an optional per-task delay
//   makes that deterministic): ordering bugs show up in CPU tests.
// - CUDA (--config=cuda): c10::cuda streams and cudaEvent_t; collectives ordered on the
//   device (c10d ProcessGroupNCCL's contract), never by host waits.
//
// The host thread's own "compute stream" is StreamPool::current(). As on CUDA, work
// launched on a stream is ordered only after earlier work on that stream and after events
// the stream was told to wait for.
#ifndef FSDP_DEVICE_STREAM_H_
#define FSDP_DEVICE_STREAM_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/work.h"

namespace fsdp::device {

using Timeout = comm::Timeout;

// A callable handed to a stream, borrowed for the duration of the call. Streams that run
// work on the calling thread (inline CPU, CUDA) call it in place: no std::function, no
// allocation per launch (FSDP launches ~5 closures per module and step). A stream that runs
// it later (async CPU) takes it into a std::function: moved from when the caller passed an
// rvalue (a lambda written in the call), copied when it passed an lvalue.
// Not thread-safe; valid only until the call it was passed to returns.
template <typename R>
class TaskRef {
 public:
  template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, TaskRef> &&
                                                    std::is_object_v<std::remove_reference_t<F>> &&
                                                    std::is_invocable_r_v<R, std::remove_reference_t<F>&>>>
  TaskRef(F&& fn)  // NOLINT(google-explicit-constructor): a lambda converts where a stream takes a task
      : callable_(const_cast<void*>(static_cast<const void*>(std::addressof(fn)))),
        run_(&RunAs<std::remove_reference_t<F>>),
        take_(&TakeAs<F>) {}

  R operator()() const { return run_(callable_); }
  // The callable as a std::function that outlives this call (moved out of an rvalue).
  std::function<R()> Take() const { return take_(callable_); }

 private:
  template <typename Fn>
  static R RunAs(void* callable) {
    if constexpr (std::is_void_v<R>) {
      (*static_cast<Fn*>(callable))();
    } else {
      return (*static_cast<Fn*>(callable))();
    }
  }
  template <typename F>
  static std::function<R()> TakeAs(void* callable) {
    using Fn = std::remove_reference_t<F>;
    if constexpr (std::is_lvalue_reference_v<F>) {
      return std::function<R()>(*static_cast<Fn*>(callable));
    } else {
      return std::function<R()>(std::move(*static_cast<Fn*>(callable)));
    }
  }

  void* callable_;
  R (*run_)(void*);
  std::function<R()> (*take_)(void*);
};

// Completion of the work a stream had enqueued when the event was recorded. Thread-safe.
class Event {
 public:
  // An event that is already complete (a recording on the host's inline stream): one shared
  // instance; Complete() and AddPendingWork() on it throw.
  static std::shared_ptr<Event> Completed();

  // True once the recorded work finished (successfully or not). Never blocks.
  bool Query();
  // Blocks the calling thread until the recorded work finished, up to `timeout` (the
  // collectives it covers: up to their group's own timeout). Throws the first error of that
  // work (c10::Error), or a c10::Error saying it timed out and naming the stream.
  void Synchronize(Timeout timeout);
  // Synchronize without the device-side part (native_synchronize).
  void SynchronizePendingWork(Timeout timeout);

  // Implementation side (streams): marks the flag part complete, with an optional error.
  void Complete(std::exception_ptr error = nullptr);
  // Collectives issued before the recording that the event also covers.
  void AddPendingWork(comm::WorkPtr work);
  explicit Event(std::string stream_name, bool completed = false);

  // Device-side part (the CUDA implementation's cudaEvent_t), which a device stream waits
  // for without blocking the host, and how the host waits for it (Synchronize calls it).
  // native_query: whether the device-side part finished (Query calls it; never blocks).
  std::shared_ptr<void> native;
  std::function<void(Timeout)> native_synchronize;
  std::function<bool()> native_query;

 private:
  std::string stream_name_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  std::vector<comm::WorkPtr> pending_;
  bool always_complete_ = false;  // Completed()'s instance: set before it is shared, then constant
};
using EventPtr = std::shared_ptr<Event>;

// Hands out the order in which collectives are issued to their process groups. Backends
// match collectives by per-rank issue order, which must be program order on every rank;
// with async streams two workers could otherwise swap a reduce-scatter and a prefetching
// all-gather. A ticket is taken on the host when the collective is launched; the launching
// stream issues it only when every earlier ticket was issued or skipped. After a failed
// issue, every later collective is skipped with that error (like a sticky CUDA error), so
// a failure cannot make ranks pair different collectives. Thread-safe.
class CollectiveSequencer {
 public:
  uint64_t TakeTicket();
  // Waits up to `timeout` for `ticket`'s turn, then issues via `issue` (or throws the
  // recorded earlier error), and passes the turn on in every case.
  comm::WorkPtr IssueInTurn(uint64_t ticket, TaskRef<comm::WorkPtr> issue, Timeout timeout);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_ticket_ = 0;
  uint64_t turn_ = 0;
  std::exception_ptr error_;
};

// An in-order queue of work. Not thread-safe: the rank's host thread launches on it.
class Stream {
 public:
  virtual ~Stream() = default;
  const std::string& name() const { return name_; }

  // Runs `fn` after everything enqueued on this stream before. An exception from `fn`
  // fails the stream: later work on it is skipped and its later events carry the error.
  virtual void Launch(TaskRef<void> fn) = 0;
  // Issues a collective (the c10d call, returning its Work) in program order among the
  // collectives of `sequencer`, after everything enqueued on this stream before; the
  // stream's later work runs after the collective finished.
  virtual void LaunchCollective(CollectiveSequencer& sequencer, TaskRef<comm::WorkPtr> issue) = 0;
  // An event that completes when everything enqueued so far finished.
  virtual EventPtr RecordEvent() = 0;
  // Later work on this stream runs only after `event` completed (on the host's inline
  // stream: blocks now, and throws the event's error).
  virtual void WaitEvent(const EventPtr& event) = 0;
  void WaitStream(Stream& other) { WaitEvent(other.RecordEvent()); }
  // Blocks the host until everything enqueued finished; throws the stream's first error.
  virtual void Synchronize() = 0;
  // record_stream's role: keeps `tensor`'s storage alive until the work enqueued so far
  // finished, so the host may drop its reference at once (CPU: a reference held by a task on
  // the stream; CUDA: the caching allocator's recordStream).
  virtual void KeepAlive(at::Tensor tensor);

 protected:
  Stream(std::string name, Timeout timeout) : name_(std::move(name)), timeout_(timeout) {}
  Timeout timeout() const { return timeout_; }

 private:
  std::string name_;
  Timeout timeout_;
};
using StreamPtr = std::shared_ptr<Stream>;

enum class CpuStreamMode {
  kInline,  // work on the calling thread; collectives pending on the stream
  kAsync,   // one worker thread per stream
};

struct StreamOptions {
  CpuStreamMode cpu_mode = CpuStreamMode::kInline;
  // Async mode: each worker sleeps this long before each task, so that work launched
  // without the right wait is observably late (for tests; 0 in production).
  std::chrono::microseconds cpu_task_delay{0};
  // Deadline of every wait on an event (collectives carry their group's own timeout).
  Timeout timeout = comm::kDefaultTimeout;
};

// `options` with the debugging override of the environment variable FSDP_CPU_STREAMS
// applied: unset -> `options` unchanged; "inline" -> kInline; "async" -> kAsync;
// "async:<microseconds>" -> kAsync with that task delay. Anything else is a c10::Error
// naming the variable and its value.
StreamOptions ApplyStreamEnvOverride(StreamOptions options);
// ApplyStreamEnvOverride of the defaults.
StreamOptions StreamOptionsFromEnv();

// The streams of one rank on one device, and the sequencer their collectives share.
class StreamPool {
 public:
  virtual ~StreamPool() = default;
  // CPU: per options.cpu_mode. CUDA: needs a --config=cuda build (else a c10::Error).
  static std::shared_ptr<StreamPool> Create(c10::Device device, StreamOptions options);

  // The host's compute stream (CPU: inline on the host thread; CUDA: LibTorch's current
  // stream on the device).
  virtual Stream& current() = 0;
  // A new stream named `name` (used in error messages).
  virtual StreamPtr NewStream(const std::string& name) = 0;

  CollectiveSequencer& sequencer() { return sequencer_; }
  const StreamOptions& options() const { return options_; }

 protected:
  explicit StreamPool(StreamOptions options) : options_(options) {}

 private:
  StreamOptions options_;
  CollectiveSequencer sequencer_;
};
using StreamPoolPtr = std::shared_ptr<StreamPool>;

// CPU stream factories (StreamPool::Create uses them; exposed for tests).
StreamPtr NewInlineStream(const std::string& name, Timeout timeout);
StreamPtr NewAsyncCpuStream(const std::string& name, Timeout timeout, std::chrono::microseconds task_delay);

}  // namespace fsdp::device

#endif  // FSDP_DEVICE_STREAM_H_
