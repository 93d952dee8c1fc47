// The NCCL backend's communicator wrapper (NcclComm: one ncclComm_t with its stream, the
// tensors of in-flight collectives and a thread-safe abort), the watchdog's poll of one
// collective, and the per-call NCCL helpers (element type, reduction op, group guard).
// Only for --config=cuda builds (see comm/BUILD.bazel, :nccl).
#ifndef FSDP_COMM_INTERNAL_NCCL_COMM_H_
#define FSDP_COMM_INTERNAL_NCCL_COMM_H_

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/internal/cuda_utils.h"
#include "comm/reduce_op.h"
#include "comm/watchdog.h"
#include "comm/work.h"

namespace fsdp::comm::internal {

// One communicator with its stream, shared by the group and its Works (a Work may outlive
// its group). Keeps the tensors of queued collectives alive until their completion event
// was seen: LibTorch's caching allocator only orders frees against the default stream, so
// memory freed early could be reused while NCCL still reads or writes it.
class NcclComm {
 public:
  // Takes ownership of `comm` (also when this throws: the shared_ptr's destructor runs).
  static std::shared_ptr<NcclComm> Adopt(ncclComm_t comm, int device, Timeout shutdown_timeout);

  ~NcclComm();

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
  ncclResult_t AsyncError();

  // The group's stream waits for everything already queued on the legacy default stream
  // (where LibTorch produced the inputs). The host does not block.
  void WaitForDefaultStream();

  // Marks the end of the collective just enqueued; `tensors` stay alive until it is done.
  std::shared_ptr<CudaEvent> RecordCompletion(std::vector<at::Tensor> tensors);

  // Drops the tensors of finished collectives. One stream: events complete in order, so the
  // first not-done entry ends the scan.
  void PruneCompleted();

  // After an async error or a timeout the communicator is unusable; aborting also makes
  // its kernels exit. Any thread, never blocks: while another thread is inside an NCCL call
  // on the communicator (see Use), that thread aborts when the call returned.
  void Abort() noexcept {
    abort_requested_.store(true);
    RunRequestedAbort();
  }

  // A 4-byte device buffer for barrier's all_reduce, made on first use.
  void* BarrierBuffer();

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
  void RunRequestedAbort() noexcept;

  // mu_ held.
  void AbortLocked() noexcept;

  // True once every queued collective finished; false on timeout, async error (when
  // `check_async`) or a CUDA error.
  bool WaitIdle(bool check_async, Timeout timeout);

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

// The watchdog's non-blocking poll of one collective (on the watchdog thread). Holds the
// communicator weakly: the watchdog must not keep a destroyed group's communicator alive.
std::function<WatchPoll()> MakeWatchPoll(const std::shared_ptr<NcclComm>& comm, std::shared_ptr<CudaEvent> done);

// Reducing collectives need NCCL's element type; Bool rides as Uint8 (MAX = or, MIN = and;
// the interface rejects SUM on Bool).
ncclDataType_t ToNcclType(const char* op, const at::Tensor& t);

// The ncclRedOp_t for one enqueue. PREMUL_SUM creates a per-call op carrying the factor
// as a host scalar of the tensor's dtype; Release() destroys it once the call is enqueued.
class NcclRedOp {
 public:
  NcclRedOp(const char* op_name, ReduceOp op, const at::Tensor& t, ncclDataType_t type, ncclComm_t comm);
  ~NcclRedOp() {
    if (created_) (void)ncclRedOpDestroy(op_, comm_);  // error path only
  }
  NcclRedOp(const NcclRedOp&) = delete;
  NcclRedOp& operator=(const NcclRedOp&) = delete;

  ncclRedOp_t get() const { return op_; }

  // NCCL allows destroying the op as soon as the call using it returned.
  void Release();

 private:
  template <typename T>
  void Create(T scalar, ncclDataType_t type) {
    // HostImmediate: NCCL reads the scalar during the create call.
    FSDP_NCCL_CHECK(ncclRedOpCreatePreMulSum(&op_, &scalar, type, ncclScalarHostImmediate, comm_));
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

}  // namespace fsdp::comm::internal

#endif  // FSDP_COMM_INTERNAL_NCCL_COMM_H_
