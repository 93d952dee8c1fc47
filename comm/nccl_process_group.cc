// NCCL backend on the NCCL C API and the CUDA runtime only: no libtorch_cuda, no c10/cuda.
// Compiled only under --config=cuda (see comm/BUILD.bazel).
#include "comm/nccl_process_group.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/accumulate.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/internal/cuda_utils.h"
#include "comm/internal/tcp_store.h"
#include "comm/watchdog.h"

namespace fsdp::comm {
namespace {

using internal::CudaEvent;
using internal::DeviceGuard;
using internal::NcclErrorText;

// One communicator with its stream, shared by the group and its Works (a Work may outlive
// its group). Keeps the tensors of queued collectives alive until their completion event
// was seen: LibTorch's caching allocator only orders frees against the default stream, so
// memory freed early could be reused while NCCL still reads or writes it.
class NcclComm {
 public:
  // Takes ownership of `comm` (also when this throws: the shared_ptr's destructor runs).
  static std::shared_ptr<NcclComm> Adopt(ncclComm_t comm, int device, Timeout shutdown_timeout) {
    std::shared_ptr<NcclComm> owned(new NcclComm(comm, device, shutdown_timeout));
    DeviceGuard guard(device);
    // Non-blocking: no implicit sync with the legacy default stream; WaitForDefaultStream
    // orders what must be ordered.
    FSDP_CUDA_CHECK(cudaStreamCreateWithFlags(&owned->stream_, cudaStreamNonBlocking));
    owned->default_stream_ready_ = std::make_unique<CudaEvent>();
    return owned;
  }

  ~NcclComm() {
    // The last owner: no other thread uses the communicator any more.
    if (comm_ == nullptr) return;
    int previous = -1;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_ &&
                          cudaSetDevice(device_) == cudaSuccess;
    // Destroying a communicator with collectives in flight can hang on peers that never
    // join them: give them the group's timeout, then abort.
    bool idle = aborted_ ? false : WaitIdle(/*check_async=*/true, shutdown_timeout_);
    if (!aborted_) {
      if (idle) {
        (void)ncclCommDestroy(comm_);
      } else {
        (void)ncclCommAbort(comm_);
        aborted_.store(true);
      }
    }
    // Aborted kernels exit promptly; if the stream still did not drain, leak the tensors
    // and the barrier buffer rather than hand memory back that a kernel may still write.
    if (!idle) idle = WaitIdle(/*check_async=*/false, std::chrono::seconds(10));
    if (idle) {
      pending_.clear();
      if (barrier_buffer_ != nullptr) (void)cudaFree(barrier_buffer_);
    } else {
      try {  // a warning handler may throw; a destructor must not
        TORCH_WARN("nccl on cuda:", device_, ": the stream did not drain at shutdown; leaking ",
                   pending_.size(), " collectives' buffers");
      } catch (...) {
      }
      (void)new std::deque<Pending>(std::move(pending_));
    }
    default_stream_ready_.reset();
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    (void)cudaGetLastError();
    if (switched) (void)cudaSetDevice(previous);
  }

  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }

  // Runs `fn(comm)` holding the communicator: an abort requested meanwhile (by the
  // watchdog thread) runs when `fn` returned, never during an NCCL call. Throws
  // DistBackendError naming `what` once aborted (the communicator is freed then).
  template <typename Fn>
  void Use(const std::string& what, Fn&& fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      TORCH_CHECK_WITH(DistBackendError, !aborted(), what,
                       ": the NCCL communicator was aborted after an earlier failure");
      AbortIfRequestedOnExit deferred(this);
      fn(comm_);
    }
    RunRequestedAbort();
  }

  // The communicator's asynchronous error, ncclSuccess if none. Never blocks: also
  // ncclSuccess once aborted or while another thread holds the communicator (ask again).
  ncclResult_t AsyncError() {
    ncclResult_t result = ncclSuccess;
    {
      std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
      if (!lock.owns_lock() || aborted()) return ncclSuccess;
      ncclResult_t async = ncclSuccess;
      const ncclResult_t status = ncclCommGetAsyncError(comm_, &async);
      result = status != ncclSuccess ? status : async;
      if (result == ncclInProgress) result = ncclSuccess;
    }
    RunRequestedAbort();
    return result;
  }

  // The group's stream waits for everything already queued on the legacy default stream
  // (where LibTorch produced the inputs). The host does not block.
  void WaitForDefaultStream() {
    FSDP_CUDA_CHECK(cudaEventRecord(default_stream_ready_->get(), cudaStreamLegacy));
    FSDP_CUDA_CHECK(cudaStreamWaitEvent(stream_, default_stream_ready_->get(), 0));
  }

  // Marks the end of the collective just enqueued; `tensors` stay alive until it is done.
  std::shared_ptr<CudaEvent> RecordCompletion(std::vector<at::Tensor> tensors) {
    auto done = std::make_shared<CudaEvent>();
    FSDP_CUDA_CHECK(cudaEventRecord(done->get(), stream_));
    PruneCompleted();
    pending_.push_back(Pending{done, std::move(tensors)});
    return done;
  }

  // Drops the tensors of finished collectives. One stream: events complete in order, so the
  // first not-done entry ends the scan.
  void PruneCompleted() {
    while (!pending_.empty()) {
      if (cudaEventQuery(pending_.front().done->get()) != cudaSuccess) {
        (void)cudaGetLastError();  // not ready (or failed: the Work reports it)
        return;
      }
      pending_.pop_front();
    }
  }

  // After an async error or a timeout the communicator is unusable; aborting also makes
  // its kernels exit. Any thread, never blocks: while another thread is inside an NCCL call
  // on the communicator (see Use), that thread aborts when the call returned.
  void Abort() noexcept {
    abort_requested_.store(true);
    RunRequestedAbort();
  }

  // A 4-byte device buffer for barrier's all_reduce, made on first use.
  void* BarrierBuffer() {
    if (barrier_buffer_ == nullptr) {
      FSDP_CUDA_CHECK(cudaMalloc(&barrier_buffer_, sizeof(int32_t)));
      // On the group's stream: the legacy stream is not ordered before it.
      FSDP_CUDA_CHECK(cudaMemsetAsync(barrier_buffer_, 0, sizeof(int32_t), stream_));
    }
    return barrier_buffer_;
  }

 private:
  struct Pending {
    std::shared_ptr<CudaEvent> done;
    std::vector<at::Tensor> tensors;
  };

  // Runs a requested abort when the holder of mu_ leaves Use (also when `fn` threw).
  struct AbortIfRequestedOnExit {
    explicit AbortIfRequestedOnExit(NcclComm* c) : comm(c) {}
    ~AbortIfRequestedOnExit() {
      if (comm->abort_requested_.load()) comm->AbortLocked();
    }
    NcclComm* comm;
  };

  NcclComm(ncclComm_t comm, int device, Timeout shutdown_timeout)
      : comm_(comm), device_(device), shutdown_timeout_(shutdown_timeout) {}

  // Aborts now if an abort was requested and no other thread holds the communicator (the
  // holder aborts on its way out: it re-checks after unlocking, so no request is lost).
  void RunRequestedAbort() noexcept {
    if (!abort_requested_.load() || aborted()) return;
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (lock.owns_lock()) AbortLocked();
  }

  // mu_ held.
  void AbortLocked() noexcept {
    if (aborted()) return;
    int previous = -1;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_ &&
                          cudaSetDevice(device_) == cudaSuccess;
    (void)ncclCommAbort(comm_);
    aborted_.store(true, std::memory_order_release);
    (void)cudaGetLastError();
    if (switched) (void)cudaSetDevice(previous);
  }

  // True once every queued collective finished; false on timeout, async error (when
  // `check_async`) or a CUDA error.
  bool WaitIdle(bool check_async, Timeout timeout) {
    if (pending_.empty()) return true;
    using Clock = std::chrono::steady_clock;
    const Clock::time_point deadline = Clock::now() + timeout;
    std::chrono::microseconds pause(10);
    while (true) {
      const cudaError_t query = cudaEventQuery(pending_.back().done->get());
      if (query == cudaSuccess) return true;
      (void)cudaGetLastError();
      if (query != cudaErrorNotReady) return false;
      if (check_async && AsyncError() != ncclSuccess) return false;
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1));
    }
  }

  ncclComm_t comm_;
  int device_;
  Timeout shutdown_timeout_;
  // mu_ guards every NCCL call on comm_ (an abort frees it).
  std::mutex mu_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> abort_requested_{false};
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<CudaEvent> default_stream_ready_;
  void* barrier_buffer_ = nullptr;
  std::deque<Pending> pending_;
};

// What the group's collectives share with the watchdog (null members: watchdog off).
struct NcclWatch {
  std::shared_ptr<Watchdog> watchdog;
  std::shared_ptr<Watchdog::Communicator> comm;
};

// The watchdog's non-blocking poll of one collective (on the watchdog thread). Holds the
// communicator weakly: the watchdog must not keep a destroyed group's communicator alive.
std::function<WatchPoll()> MakeWatchPoll(const std::shared_ptr<NcclComm>& comm,
                                         std::shared_ptr<CudaEvent> done) {
  return [weak = std::weak_ptr<NcclComm>(comm), done = std::move(done),
          device = comm->device()]() -> WatchPoll {
    // Without this the watchdog thread's first CUDA call would create a context on
    // device 0 (memory on a GPU this rank does not use).
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current != device) (void)cudaSetDevice(device);
    const cudaError_t query = cudaEventQuery(done->get());
    if (query == cudaSuccess) return WatchPoll::Done();
    (void)cudaGetLastError();
    if (query != cudaErrorNotReady) {
      return WatchPoll::Failed(absl::StrCat("cudaEventQuery failed: ", cudaGetErrorName(query),
                                            " (", cudaGetErrorString(query), ")"));
    }
    if (std::shared_ptr<NcclComm> c = weak.lock()) {
      const ncclResult_t async = c->AsyncError();
      if (async != ncclSuccess) {
        return WatchPoll::Failed(absl::StrCat("NCCL async error: ", NcclErrorText(async)));
      }
    }
    return WatchPoll::Running();
  };
}

class NcclWork final : public Work {
 public:
  NcclWork(std::string description, Timeout timeout, std::shared_ptr<NcclComm> comm,
           std::shared_ptr<CudaEvent> done, NcclWatch watch,
           std::shared_ptr<Watchdog::Collective> watched)
      : Work(std::move(description), timeout),
        comm_(std::move(comm)),
        done_(std::move(done)),
        watch_(std::move(watch)),
        watched_(std::move(watched)) {}

  bool is_completed() override { return Poll(Timeout(0)); }
  std::exception_ptr exception() override { return error_; }

 protected:
  // As in PyTorch, a timed-out wait aborts the communicator: the collective would keep
  // running (and later ones queue behind it) after the caller gave up on it.
  bool WaitFor(Timeout timeout) override {
    if (Poll(timeout)) return true;
    const std::string message = absl::StrCat(
        description(), " timed out after ", timeout.count(), " ms in Work::wait (still running on cuda:",
        comm_->device(), "; a rank may not have joined it)");
    if (watched_ == nullptr) {
      comm_->Abort();
      return false;  // Work::wait reports the timeout, with TimeoutDetail
    }
    watch_.watchdog->Fail(watch_.comm, watched_.get(),
                          absl::StrCat(message, "; communicator ", watch_.comm->name(),
                                       " aborted by the watchdog"));
    return Poll(Timeout(0));  // failed now: by this timeout or a failure just before it
  }

  std::string TimeoutDetail() override {
    return absl::StrCat("the collective is still running on cuda:", comm_->device(),
                        " (a rank may not have joined it); the communicator was aborted, so "
                        "later collectives on this group fail");
  }

 private:
  // True once finished, successfully or not; a failure lands in error_. Polls the event
  // itself (fast completion) and the watchdog's verdict (failures found elsewhere).
  bool Poll(Timeout timeout) {
    if (finished_) return true;
    using Clock = std::chrono::steady_clock;
    const Clock::time_point deadline = Clock::now() + timeout;
    std::chrono::microseconds pause(10);
    while (true) {
      // A communicator aborted by another Work's failure: this collective's result is lost
      // (its event may still complete, as abort makes the kernels exit).
      if (watched_ == nullptr && comm_->aborted()) {
        return Fail(absl::StrCat(description(), " failed: the NCCL communicator was aborted "
                                 "after an earlier failure"));
      }
      const cudaError_t query = cudaEventQuery(done_->get());
      if (query != cudaSuccess) (void)cudaGetLastError();  // "not ready" must not linger
      // After the event: the watchdog marks the communicator failed before aborting it, so
      // an event completed by the abort is never taken for a result.
      if (watched_ != nullptr) {
        WatchPoll verdict = watched_->status();
        if (verdict.state == WatchPoll::State::kFailed) return Fail(std::move(verdict.error));
      }
      if (query == cudaSuccess) {
        comm_->PruneCompleted();  // release buffers now rather than at the next collective
        return finished_ = true;
      }
      if (query != cudaErrorNotReady) {
        return FailAndAbort(absl::StrCat("cudaEventQuery failed: ", cudaGetErrorName(query),
                                         " (", cudaGetErrorString(query), ")"));
      }
      const ncclResult_t async = comm_->AsyncError();
      if (async != ncclSuccess) {
        return FailAndAbort(absl::StrCat("NCCL async error: ", NcclErrorText(async)));
      }
      if (Clock::now() >= deadline) return false;  // still running after `timeout`
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1));
    }
  }

  // A failure seen by this Work: abort the communicator (through the watchdog, which also
  // fails the communicator's other collectives) and fail.
  bool FailAndAbort(const std::string& reason) {
    if (watched_ == nullptr) {
      comm_->Abort();
      return Fail(absl::StrCat(description(), " failed: ", reason, "; communicator aborted"));
    }
    watch_.watchdog->Fail(watch_.comm, watched_.get(),
                          absl::StrCat(description(), " failed: ", reason, "; communicator ",
                                       watch_.comm->name(), " aborted by the watchdog"));
    return Fail(watched_->status().error);  // ours, or the failure that came first
  }

  bool Fail(std::string message) {
    error_ = std::make_exception_ptr(c10::DistBackendError(
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, std::move(message)));
    return finished_ = true;
  }

  std::shared_ptr<NcclComm> comm_;
  std::shared_ptr<CudaEvent> done_;
  NcclWatch watch_;
  std::shared_ptr<Watchdog::Collective> watched_;  // null: watchdog off
  bool finished_ = false;
  std::exception_ptr error_;
};

// Reducing collectives need NCCL's element type; Bool rides as Uint8 (MAX = or, MIN = and;
// the interface rejects SUM on Bool).
ncclDataType_t ToNcclType(const char* op, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    case at::kBool: return ncclUint8;
    default: break;
  }
  TORCH_CHECK(false, op, ": the nccl backend cannot reduce dtype ", t.scalar_type(), " (",
              DescribeTensor(t), "); supported: Float, Double, Half, BFloat16, Int, Long, Byte, "
              "Char, Bool");
}

// The ncclRedOp_t for one enqueue. PREMUL_SUM creates a per-call op carrying the factor
// as a host scalar of the tensor's dtype; Release() destroys it once the call is enqueued.
class NcclRedOp {
 public:
  NcclRedOp(const char* op_name, ReduceOp op, const at::Tensor& t, ncclDataType_t type,
            ncclComm_t comm)
      : comm_(comm) {
    switch (op.kind()) {
      case ReduceOpKind::kSum: op_ = ncclSum; return;
      case ReduceOpKind::kAvg: op_ = ncclAvg; return;
      case ReduceOpKind::kMax: op_ = ncclMax; return;
      case ReduceOpKind::kMin: op_ = ncclMin; return;
      case ReduceOpKind::kPremulSum: break;
    }
    switch (t.scalar_type()) {
      case at::kFloat: Create(static_cast<float>(op.factor()), type); break;
      case at::kDouble: Create(op.factor(), type); break;
      case at::kHalf: Create(c10::Half(static_cast<float>(op.factor())), type); break;
      case at::kBFloat16: Create(c10::BFloat16(static_cast<float>(op.factor())), type); break;
      default:
        TORCH_CHECK(false, op_name, ": ", op.ToString(), " needs a floating-point tensor, got ",
                    DescribeTensor(t));
    }
  }
  ~NcclRedOp() {
    if (created_) (void)ncclRedOpDestroy(op_, comm_);  // error path only
  }
  NcclRedOp(const NcclRedOp&) = delete;
  NcclRedOp& operator=(const NcclRedOp&) = delete;

  ncclRedOp_t get() const { return op_; }

  // NCCL allows destroying the op as soon as the call using it returned.
  void Release() {
    if (!created_) return;
    created_ = false;
    FSDP_NCCL_CHECK(ncclRedOpDestroy(op_, comm_));
  }

 private:
  template <typename T>
  void Create(T scalar, ncclDataType_t type) {
    // HostImmediate: NCCL reads the scalar during the create call.
    FSDP_NCCL_CHECK(
        ncclRedOpCreatePreMulSum(&op_, &scalar, type, ncclScalarHostImmediate, comm_));
    created_ = true;
  }

  ncclComm_t comm_;
  ncclRedOp_t op_ = ncclSum;
  bool created_ = false;
};

// Closes an ncclGroupStart even when a call inside the group threw.
class NcclGroup {
 public:
  NcclGroup() { FSDP_NCCL_CHECK(ncclGroupStart()); }
  ~NcclGroup() {
    if (open_) (void)ncclGroupEnd();
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  void End() {
    open_ = false;
    FSDP_NCCL_CHECK(ncclGroupEnd());
  }

 private:
  bool open_ = true;
};

class NcclProcessGroup final : public ProcessGroup {
 public:
  // `watchdog` null: no watchdog. Subgroups share their parent's.
  NcclProcessGroup(std::shared_ptr<NcclComm> comm, int rank, int size, Timeout timeout,
                   c10::intrusive_ptr<c10d::Store> store, std::shared_ptr<Watchdog> watchdog)
      : ProcessGroup(rank, size, timeout), comm_(std::move(comm)), store_(std::move(store)) {
    if (watchdog != nullptr) {
      watch_.comm = watchdog->AddCommunicator(
          absl::StrCat(WhoAmI(), " on cuda:", comm_->device()),
          [weak = std::weak_ptr<NcclComm>(comm_)] {
            if (std::shared_ptr<NcclComm> c = weak.lock()) c->Abort();
          });
      watch_.watchdog = std::move(watchdog);
    }
  }

  std::string backend_name() const override { return "nccl"; }

 protected:
  // Data movement (all_gather, broadcast, all_to_all) copies bytes: any dtype works.
  WorkPtr DoAllGather(const at::Tensor& output, const at::Tensor& input) override {
    constexpr const char* kOp = "all_gather_into_tensor";
    CheckOnDevice(kOp, "output", output);
    CheckOnDevice(kOp, "input", input);
    const std::string what = Describe(kOp, input);
    if (input.numel() == 0) return MakeCompletedWork(what);
    return Enqueue(what, {output, input}, [&](ncclComm_t comm, cudaStream_t stream) {
      FSDP_NCCL_CHECK(ncclAllGather(input.data_ptr(), output.data_ptr(), input.nbytes(),
                                    ncclUint8, comm, stream));
    });
  }

  WorkPtr DoReduceScatter(const at::Tensor& output, const at::Tensor& input,
                          ReduceOp op) override {
    constexpr const char* kOp = "reduce_scatter_tensor";
    CheckOnDevice(kOp, "output", output);
    CheckOnDevice(kOp, "input", input);
    const ncclDataType_t type = ToNcclType(kOp, input);
    const std::string what = Describe(absl::StrCat(kOp, "(", op.ToString(), ")"), input);
    if (output.numel() == 0) return MakeCompletedWork(what);
    return Enqueue(what, {output, input}, [&](ncclComm_t comm, cudaStream_t stream) {
      NcclRedOp red(kOp, op, input, type, comm);
      FSDP_NCCL_CHECK(ncclReduceScatter(input.data_ptr(), output.data_ptr(), output.numel(),
                                        type, red.get(), comm, stream));
      red.Release();
    });
  }

  WorkPtr DoAllReduce(const at::Tensor& tensor, ReduceOp op) override {
    constexpr const char* kOp = "all_reduce";
    CheckOnDevice(kOp, "tensor", tensor);
    const ncclDataType_t type = ToNcclType(kOp, tensor);
    const std::string what = Describe(absl::StrCat(kOp, "(", op.ToString(), ")"), tensor);
    if (tensor.numel() == 0) return MakeCompletedWork(what);
    return Enqueue(what, {tensor}, [&](ncclComm_t comm, cudaStream_t stream) {
      NcclRedOp red(kOp, op, tensor, type, comm);
      FSDP_NCCL_CHECK(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), type,
                                    red.get(), comm, stream));
      red.Release();
    });
  }

  WorkPtr DoBroadcast(const at::Tensor& tensor, int root) override {
    constexpr const char* kOp = "broadcast";
    CheckOnDevice(kOp, "tensor", tensor);
    const std::string what = Describe(absl::StrCat(kOp, "(root=", root, ")"), tensor);
    if (tensor.numel() == 0) return MakeCompletedWork(what);
    return Enqueue(what, {tensor}, [&](ncclComm_t comm, cudaStream_t stream) {
      FSDP_NCCL_CHECK(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.nbytes(),
                                    ncclUint8, root, comm, stream));
    });
  }

  WorkPtr DoAllToAll(const at::Tensor& output, const at::Tensor& input,
                     const std::vector<int64_t>& output_split_sizes,
                     const std::vector<int64_t>& input_split_sizes) override {
    constexpr const char* kOp = "all_to_all_single";
    CheckOnDevice(kOp, "output", output);
    CheckOnDevice(kOp, "input", input);
    const std::string what = Describe(
        absl::StrCat(kOp, "(in [", absl::StrJoin(input_split_sizes, ","), "], out [",
                     absl::StrJoin(output_split_sizes, ","), "])"),
        input);
    // Validated: output and input agree beyond dim 0, so one row size serves both.
    const size_t row_bytes =
        input.element_size() * static_cast<size_t>(c10::multiply_integers(input.sizes().slice(1)));
    return Enqueue(what, {output, input}, [&](ncclComm_t comm, cudaStream_t stream) {
      const char* send = static_cast<const char*>(input.data_ptr());
      char* recv = static_cast<char*>(output.data_ptr());
      NcclGroup group;
      for (int peer = 0; peer < size(); ++peer) {
        const size_t send_bytes = input_split_sizes[peer] * row_bytes;
        const size_t recv_bytes = output_split_sizes[peer] * row_bytes;
        // Zero-byte pieces are skipped on both sides (peer's matching count is zero too).
        if (send_bytes > 0) FSDP_NCCL_CHECK(ncclSend(send, send_bytes, ncclUint8, peer, comm, stream));
        if (recv_bytes > 0) FSDP_NCCL_CHECK(ncclRecv(recv, recv_bytes, ncclUint8, peer, comm, stream));
        send += send_bytes;
        recv += recv_bytes;
      }
      group.End();
    });
  }

  WorkPtr DoBarrier() override {
    const std::string what = Describe("barrier", at::Tensor());
    return Enqueue(what, {}, [&](ncclComm_t comm, cudaStream_t stream) {
      void* buffer = comm_->BarrierBuffer();
      FSDP_NCCL_CHECK(ncclAllReduce(buffer, buffer, 1, ncclInt32, ncclSum, comm, stream));
    });
  }

  std::shared_ptr<ProcessGroup> DoNewSubgroup(const std::vector<int>& ranks) override {
    const std::string what = absl::StrCat("new_subgroup on ", WhoAmI());
    if (watch_.comm != nullptr) watch_.comm->ThrowIfFailed(what);
    const auto it = std::find(ranks.begin(), ranks.end(), rank());
    const bool member = it != ranks.end();
    DeviceGuard guard(comm_->device());
    ncclComm_t child = nullptr;
    // Collective over this group (not watched: it blocks until every rank joined). Key =
    // parent rank keeps the sorted `ranks` order.
    comm_->Use(what, [&](ncclComm_t comm) {
      FSDP_NCCL_CHECK(ncclCommSplit(comm, member ? 0 : NCCL_SPLIT_NOCOLOR, rank(), &child,
                                    /*config=*/nullptr));
    });
    if (!member) return nullptr;
    TORCH_CHECK(child != nullptr, "new_subgroup on ", WhoAmI(),
                ": ncclCommSplit returned no communicator for a member");
    return std::make_shared<NcclProcessGroup>(
        NcclComm::Adopt(child, comm_->device(), timeout()), static_cast<int>(it - ranks.begin()),
        static_cast<int>(ranks.size()), timeout(), store_, watch_.watchdog);
  }

 private:
  void CheckOnDevice(const char* op, const char* arg, const at::Tensor& t) const {
    TORCH_CHECK(t.is_cuda(), op, ": ", arg, " must be a CUDA tensor for the nccl backend, got ",
                arg, " on ", t.device().str());
    TORCH_CHECK(t.device().index() == comm_->device(), op, ": ", arg, " must be on cuda:",
                comm_->device(), " (this rank's NCCL device), got ", arg, " on ",
                t.device().str());
  }

  // "<op> <tensor> #<seq> on nccl rank r/W"; seq numbers this group's collectives, the
  // same on every rank, so mismatched calls can be matched up from the messages.
  std::string Describe(const std::string& op_text, const at::Tensor& t) {
    const uint64_t seq = next_seq_++;
    return absl::StrCat(op_text, t.defined() ? " " : "", t.defined() ? DescribeTensor(t) : "",
                        " #", seq, " on ", WhoAmI());
  }

  // Runs `launch` on the group's stream after the default stream's queued work and returns
  // a Work on the completion event. `tensors` stay alive until the collective finished.
  // With the watchdog on, the collective is watched from its enqueue with the group's
  // timeout; a failed communicator fails it before anything is enqueued (sticky error).
  template <typename Launch>
  WorkPtr Enqueue(const std::string& what, std::vector<at::Tensor> tensors, Launch&& launch) {
    if (watch_.comm != nullptr) watch_.comm->ThrowIfFailed(what);
    DeviceGuard guard(comm_->device());
    comm_->WaitForDefaultStream();
    comm_->Use(what, [&](ncclComm_t comm) { launch(comm, comm_->stream()); });
    std::shared_ptr<CudaEvent> done = comm_->RecordCompletion(std::move(tensors));
    std::shared_ptr<Watchdog::Collective> watched;
    if (watch_.watchdog != nullptr) {
      // Throws if the communicator failed since the check above: the result is lost.
      watched = watch_.watchdog->Watch(watch_.comm, what, timeout(), MakeWatchPoll(comm_, done));
    }
    return std::make_shared<NcclWork>(what, timeout(), comm_, std::move(done), watch_,
                                      std::move(watched));
  }

  std::shared_ptr<NcclComm> comm_;
  NcclWatch watch_;
  // Kept for the group's lifetime: rank 0 serves the rendezvous store.
  c10::intrusive_ptr<c10d::Store> store_;
  uint64_t next_seq_ = 0;
};

constexpr const char* kUniqueIdKey = "fsdp/nccl/unique_id";

}  // namespace

ProcessGroupPtr CreateNcclProcessGroupWithTcpStore(const TorchrunEnv& env,
                                                   const NcclOptions& options) {
  constexpr const char* kFn = "CreateNcclProcessGroupWithTcpStore";
  TORCH_CHECK(options.timeout.count() > 0, kFn, ": NcclOptions.timeout must be positive, got ",
              options.timeout.count(), " ms");
  TORCH_CHECK(options.device_index >= -1, kFn, ": NcclOptions.device_index must be >= -1, got ",
              options.device_index);
  TORCH_CHECK(!options.watchdog || options.watchdog_poll_interval.count() > 0, kFn,
              ": NcclOptions.watchdog_poll_interval must be positive, got ",
              options.watchdog_poll_interval.count(), " ms");
  const int device = options.device_index >= 0 ? options.device_index : env.local_rank;
  int device_count = 0;
  FSDP_CUDA_CHECK(cudaGetDeviceCount(&device_count));
  TORCH_CHECK(device >= 0 && device < device_count, kFn, ": CUDA device ", device,
              options.device_index >= 0 ? " (NcclOptions.device_index)" : " (LOCAL_RANK)",
              " does not exist: ", device_count, " visible");

  auto store = internal::ConnectTcpStore(env, options.timeout, kFn);

  ncclUniqueId id;
  if (env.rank == 0) {
    FSDP_NCCL_CHECK(ncclGetUniqueId(&id));
    const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
    store->set(kUniqueIdKey, std::vector<uint8_t>(bytes, bytes + sizeof(id)));
  } else {
    const std::vector<uint8_t> bytes = store->get(kUniqueIdKey);  // waits up to the timeout
    TORCH_CHECK(bytes.size() == sizeof(id), kFn, ": the store's ", kUniqueIdKey, " holds ",
                bytes.size(), " bytes, expected sizeof(ncclUniqueId) = ", sizeof(id));
    std::memcpy(&id, bytes.data(), sizeof(id));
  }

  DeviceGuard guard(device);
  ncclComm_t comm = nullptr;
  // Blocks until every rank joined (no timeout of its own).
  FSDP_NCCL_CHECK(ncclCommInitRank(&comm, env.world_size, id, env.rank));
  std::shared_ptr<Watchdog> watchdog;
  if (options.watchdog) {
    WatchdogOptions watchdog_options;
    watchdog_options.poll_interval = options.watchdog_poll_interval;
    watchdog = std::make_shared<Watchdog>(std::move(watchdog_options));
  }
  return std::make_shared<NcclProcessGroup>(NcclComm::Adopt(comm, device, options.timeout),
                                            env.rank, env.world_size, options.timeout, store,
                                            std::move(watchdog));
}

ProcessGroupPtr CreateNcclProcessGroupFromEnv(const NcclOptions& options) {
  return CreateNcclProcessGroupWithTcpStore(ReadTorchrunEnv(), options);
}

bool NcclAvailable() { return true; }

}  // namespace fsdp::comm
