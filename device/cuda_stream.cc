// CUDA streams (--config=cuda): c10::cuda streams, so that LibTorch kernels launched under
// Stream::Launch go to the stream, and cudaEvent_t events. The NCCL backend orders its
// collectives after the legacy default stream and makes Work::wait() block the host
// (comm/nccl_process_group.h), so LaunchCollective hands the stream's prior work to the
// collective through the legacy stream, and later work waits for the collective's Work.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <optional>
#include <thread>

#include "device/internal/pools.h"
#include "device/stream.h"

namespace fsdp::device {
namespace {

#define FSDP_DEVICE_CUDA_CHECK(call)                                                                               \
  do {                                                                                                             \
    const cudaError_t fsdp_status = (call);                                                                        \
    if (fsdp_status != cudaSuccess) {                                                                              \
      (void)cudaGetLastError();                                                                                    \
      TORCH_CHECK(false, #call, " failed: ", cudaGetErrorName(fsdp_status), " (", cudaGetErrorString(fsdp_status), \
                  ")");                                                                                            \
    }                                                                                                              \
  } while (0)

std::shared_ptr<CUevent_st> NewCudaEvent() {
  cudaEvent_t event = nullptr;
  FSDP_DEVICE_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return std::shared_ptr<CUevent_st>(event, [](cudaEvent_t e) { (void)cudaEventDestroy(e); });
}

// A recorded cudaEvent_t as a Work, so that Event covers it like a pending collective.
class CudaEventWork final : public comm::Work {
 public:
  CudaEventWork(const std::string& stream_name, std::shared_ptr<CUevent_st> event)
      : Work("cuda event on stream '" + stream_name + "'", comm::kDefaultTimeout), event_(std::move(event)) {}
  bool is_completed() override { return cudaEventQuery(event_.get()) != cudaErrorNotReady; }
  std::exception_ptr exception() override { return nullptr; }

 protected:
  bool WaitFor(Timeout timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const cudaError_t status = cudaEventQuery(event_.get());
      if (status == cudaSuccess) return true;
      if (status != cudaErrorNotReady) FSDP_DEVICE_CUDA_CHECK(status);
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  std::shared_ptr<CUevent_st> event_;
};

class CudaStream final : public Stream {
 public:
  // `fixed` unset: LibTorch's current stream on `device`, read at each use.
  CudaStream(const std::string& name, Timeout timeout, c10::DeviceIndex device,
             std::optional<c10::cuda::CUDAStream> fixed)
      : Stream(name, timeout), device_(device), fixed_(fixed) {}

  void Launch(std::function<void()> fn) override {
    DrainCollectives();
    c10::cuda::CUDAStreamGuard guard(stream());
    fn();
  }

  void LaunchCollective(CollectiveSequencer& sequencer, std::function<comm::WorkPtr()> issue) override {
    const uint64_t ticket = sequencer.TakeTicket();
    c10::cuda::CUDAGuard device_guard(device_);
    auto ready = NewCudaEvent();
    FSDP_DEVICE_CUDA_CHECK(cudaEventRecord(ready.get(), stream().stream()));
    FSDP_DEVICE_CUDA_CHECK(cudaStreamWaitEvent(cudaStreamLegacy, ready.get(), 0));
    internal::PruneFinished(pending_);
    pending_.push_back(sequencer.IssueInTurn(ticket, issue, timeout()));
  }

  EventPtr RecordEvent() override {
    c10::cuda::CUDAGuard device_guard(device_);
    auto native = NewCudaEvent();
    FSDP_DEVICE_CUDA_CHECK(cudaEventRecord(native.get(), stream().stream()));
    internal::PruneFinished(pending_);
    auto event = std::make_shared<Event>(name(), /*completed=*/true);
    for (const auto& w : pending_) event->AddPendingWork(w);
    event->native = native;
    auto as_work = std::make_shared<CudaEventWork>(name(), native);
    event->native_synchronize = [as_work](Timeout timeout) { as_work->wait(timeout); };
    return event;
  }

  void WaitEvent(const EventPtr& event) override {
    auto native = std::static_pointer_cast<CUevent_st>(event->native);
    if (!native) {  // a host (CPU) event
      event->Synchronize(timeout());
      return;
    }
    // Device side without blocking the host; the collectives it covers are host-waited
    // (NCCL Work::wait), as the recording stream's next Launch would.
    c10::cuda::CUDAGuard device_guard(device_);
    FSDP_DEVICE_CUDA_CHECK(cudaStreamWaitEvent(stream().stream(), native.get(), 0));
    event->SynchronizePendingWork(timeout());
  }

  void Synchronize() override {
    DrainCollectives();
    c10::cuda::CUDAGuard device_guard(device_);
    FSDP_DEVICE_CUDA_CHECK(cudaStreamSynchronize(stream().stream()));
  }

 private:
  c10::cuda::CUDAStream stream() const { return fixed_ ? *fixed_ : c10::cuda::getCurrentCUDAStream(device_); }
  void DrainCollectives() {
    std::vector<comm::WorkPtr> pending;
    pending.swap(pending_);
    for (const auto& w : pending) w->wait(timeout());
  }

  c10::DeviceIndex device_;
  std::optional<c10::cuda::CUDAStream> fixed_;
  std::vector<comm::WorkPtr> pending_;
};

class CudaStreamPool final : public StreamPool {
 public:
  CudaStreamPool(c10::DeviceIndex device, const StreamOptions& options)
      : StreamPool(options), device_(device), current_("compute", options.timeout, device, std::nullopt) {}

  Stream& current() override { return current_; }

  StreamPtr NewStream(const std::string& name) override {
    return std::make_shared<CudaStream>(name, options().timeout, device_,
                                        c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_));
  }

 private:
  c10::DeviceIndex device_;
  CudaStream current_;
};

}  // namespace

namespace internal {
std::shared_ptr<StreamPool> CreateCudaStreamPool(c10::Device device, const StreamOptions& options) {
  const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
  return std::make_shared<CudaStreamPool>(index, options);
}
}  // namespace internal

}  // namespace fsdp::device
