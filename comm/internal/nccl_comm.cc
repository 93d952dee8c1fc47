// NcclComm and the NCCL call helpers of the NCCL backend (comm/nccl_process_group.cc).
// Compiled only under --config=cuda (see comm/BUILD.bazel).
#include "comm/internal/nccl_comm.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "comm/process_group.h"

namespace fsdp::comm::internal {

std::shared_ptr<NcclComm> NcclComm::Adopt(ncclComm_t comm, int device, Timeout shutdown_timeout) {
  std::shared_ptr<NcclComm> owned(new NcclComm(comm, device, shutdown_timeout));
  DeviceGuard guard(device);
  // Non-blocking: no implicit sync with the legacy default stream; WaitForDefaultStream
  // orders what must be ordered.
  FSDP_CUDA_CHECK(cudaStreamCreateWithFlags(&owned->stream_, cudaStreamNonBlocking));
  owned->default_stream_ready_ = std::make_unique<CudaEvent>();
  return owned;
}

NcclComm::~NcclComm() {
  // The last owner: no other thread uses the communicator any more.
  if (comm_ == nullptr) return;
  int previous = -1;
  const bool switched =
      cudaGetDevice(&previous) == cudaSuccess && previous != device_ && cudaSetDevice(device_) == cudaSuccess;
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
      TORCH_WARN("nccl on cuda:", device_, ": the stream did not drain at shutdown; leaking ", pending_.size(),
                 " collectives' buffers");
    } catch (...) {
    }
    (void)new std::deque<Pending>(std::move(pending_));
  }
  default_stream_ready_.reset();
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  (void)cudaGetLastError();
  if (switched) (void)cudaSetDevice(previous);
}

ncclResult_t NcclComm::AsyncError() {
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

void NcclComm::WaitForDefaultStream() {
  FSDP_CUDA_CHECK(cudaEventRecord(default_stream_ready_->get(), cudaStreamLegacy));
  FSDP_CUDA_CHECK(cudaStreamWaitEvent(stream_, default_stream_ready_->get(), 0));
}

std::shared_ptr<CudaEvent> NcclComm::RecordCompletion(std::vector<at::Tensor> tensors) {
  auto done = std::make_shared<CudaEvent>();
  FSDP_CUDA_CHECK(cudaEventRecord(done->get(), stream_));
  PruneCompleted();
  pending_.push_back(Pending{done, std::move(tensors)});
  return done;
}

void NcclComm::PruneCompleted() {
  while (!pending_.empty()) {
    if (cudaEventQuery(pending_.front().done->get()) != cudaSuccess) {
      (void)cudaGetLastError();  // not ready (or failed: the Work reports it)
      return;
    }
    pending_.pop_front();
  }
}

void* NcclComm::BarrierBuffer() {
  if (barrier_buffer_ == nullptr) {
    FSDP_CUDA_CHECK(cudaMalloc(&barrier_buffer_, sizeof(int32_t)));
    // On the group's stream: the legacy stream is not ordered before it.
    FSDP_CUDA_CHECK(cudaMemsetAsync(barrier_buffer_, 0, sizeof(int32_t), stream_));
  }
  return barrier_buffer_;
}

void NcclComm::RunRequestedAbort() noexcept {
  if (!abort_requested_.load() || aborted()) return;
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (lock.owns_lock()) AbortLocked();
}

void NcclComm::AbortLocked() noexcept {
  if (aborted()) return;
  int previous = -1;
  const bool switched =
      cudaGetDevice(&previous) == cudaSuccess && previous != device_ && cudaSetDevice(device_) == cudaSuccess;
  (void)ncclCommAbort(comm_);
  aborted_.store(true, std::memory_order_release);
  (void)cudaGetLastError();
  if (switched) (void)cudaSetDevice(previous);
}

bool NcclComm::WaitIdle(bool check_async, Timeout timeout) {
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

std::function<WatchPoll()> MakeWatchPoll(const std::shared_ptr<NcclComm>& comm, std::shared_ptr<CudaEvent> done) {
  return [weak = std::weak_ptr<NcclComm>(comm), done = std::move(done), device = comm->device()]() -> WatchPoll {
    // Without this the watchdog thread's first CUDA call would create a context on
    // device 0 (memory on a GPU this rank does not use).
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current != device) (void)cudaSetDevice(device);
    const cudaError_t query = cudaEventQuery(done->get());
    if (query == cudaSuccess) return WatchPoll::Done();
    (void)cudaGetLastError();
    if (query != cudaErrorNotReady) {
      return WatchPoll::Failed(
          absl::StrCat("cudaEventQuery failed: ", cudaGetErrorName(query), " (", cudaGetErrorString(query), ")"));
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
  TORCH_CHECK(false, op, ": the nccl backend cannot reduce dtype ", t.scalar_type(), " (", DescribeTensor(t),
              "); supported: Float, Double, Half, BFloat16, Int, Long, Byte, "
              "Char, Bool");
}

NcclRedOp::NcclRedOp(const char* op_name, ReduceOp op, const at::Tensor& t, ncclDataType_t type, ncclComm_t comm)
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
      TORCH_CHECK(false, op_name, ": ", op.ToString(), " needs a floating-point tensor, got ", DescribeTensor(t));
  }
}

void NcclRedOp::Release() {
  if (!created_) return;
  created_ = false;
  FSDP_NCCL_CHECK(ncclRedOpDestroy(op_, comm_));
}

}  // namespace fsdp::comm::internal
