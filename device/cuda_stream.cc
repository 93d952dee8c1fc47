// CUDA streams (--config=cuda): c10::cuda streams, so that LibTorch kernels launched under
// Stream::Launch go to the stream, and cudaEvent_t events. Ordering is on the device, never on
// the host, with the contract of c10d's ProcessGroupNCCL (comm/nccl_process_group.h): a
// collective issued while a stream is LibTorch's current stream starts after that stream's
// earlier work, and Work::wait() makes the current stream wait for the collective. So
// LaunchCollective issues under the launching stream, and that stream's next Launch,
// RecordEvent or Synchronize first makes it wait for its pending collectives.
#include <c10/cuda/CUDACachingAllocator.h>
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

  void Launch(TaskRef<void> fn) override {
    c10::cuda::CUDAStreamGuard guard(stream());
    WaitForCollectives();
    fn();
  }

  void LaunchCollective(CollectiveSequencer& sequencer, TaskRef<comm::WorkPtr> issue) override {
    const uint64_t ticket = sequencer.TakeTicket();
    // ProcessGroupNCCL orders the collective after the current stream's work: this one's.
    c10::cuda::CUDAStreamGuard guard(stream());
    internal::PruneFinished(pending_);
    pending_.push_back(sequencer.IssueInTurn(ticket, issue, timeout()));
  }

  EventPtr RecordEvent() override {
    c10::cuda::CUDAStreamGuard guard(stream());
    // The recorded cudaEvent then covers the collectives too: no host wait anywhere.
    WaitForCollectives();
    auto native = NewCudaEvent();
    FSDP_DEVICE_CUDA_CHECK(cudaEventRecord(native.get(), stream().stream()));
    auto event = std::make_shared<Event>(name(), /*completed=*/true);
    event->native = native;
    auto as_work = std::make_shared<CudaEventWork>(name(), native);
    event->native_synchronize = [as_work](Timeout timeout) { as_work->wait(timeout); };
    event->native_query = [as_work] { return as_work->is_completed(); };
    return event;
  }

  void WaitEvent(const EventPtr& event) override {
    auto native = std::static_pointer_cast<CUevent_st>(event->native);
    if (!native) {  // a host (CPU) event
      event->Synchronize(timeout());
      return;
    }
    c10::cuda::CUDAGuard device_guard(device_);
    FSDP_DEVICE_CUDA_CHECK(cudaStreamWaitEvent(stream().stream(), native.get(), 0));
  }

  void Synchronize() override {
    c10::cuda::CUDAStreamGuard guard(stream());
    WaitForCollectives();
    FSDP_DEVICE_CUDA_CHECK(cudaStreamSynchronize(stream().stream()));
  }

  // record_stream: the caching allocator does not hand the block out again before the work
  // this stream has enqueued so far finished (the host may drop its reference at once).
  void KeepAlive(at::Tensor tensor) override {
    if (!tensor.defined() || !tensor.is_cuda() || !tensor.has_storage()) {
      Stream::KeepAlive(std::move(tensor));
      return;
    }
    c10::cuda::CUDAStreamGuard guard(stream());
    WaitForCollectives();  // the collectives that read or write it are then this stream's work
    c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(), stream());
  }

 private:
  c10::cuda::CUDAStream stream() const { return fixed_ ? *fixed_ : c10::cuda::getCurrentCUDAStream(device_); }
  // Under a guard that made this stream current: Work::wait of a c10d CUDA collective makes
  // the current stream wait for it on the device (a backend without that contract blocks the
  // host instead, which orders it too).
  void WaitForCollectives() {
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
