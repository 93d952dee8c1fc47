// CUDA / NCCL helpers of the NCCL backend: checked calls, a device guard, an event.
// Only for --config=cuda builds.
#ifndef FSDP_COMM_INTERNAL_CUDA_UTILS_H_
#define FSDP_COMM_INTERNAL_CUDA_UTILS_H_

#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace fsdp::comm::internal {

// Throws c10::Error naming the failed call. Clears CUDA's last-error slot so the failure
// does not resurface in an unrelated LibTorch launch check later.
#define FSDP_CUDA_CHECK(call)                                                          \
  do {                                                                                 \
    const cudaError_t fsdp_cuda_status = (call);                                       \
    if (fsdp_cuda_status != cudaSuccess) {                                             \
      (void)cudaGetLastError();                                                        \
      TORCH_CHECK(false, #call, " failed: ", cudaGetErrorName(fsdp_cuda_status), " (", \
                  cudaGetErrorString(fsdp_cuda_status), ")");                          \
    }                                                                                  \
  } while (0)

#define FSDP_NCCL_CHECK(call)                                                                          \
  do {                                                                                                 \
    const ncclResult_t fsdp_nccl_status = (call);                                                      \
    TORCH_CHECK(fsdp_nccl_status == ncclSuccess, #call, " failed: ", NcclErrorText(fsdp_nccl_status)); \
  } while (0)

// ncclGetErrorString plus NCCL's last detailed message, when it has one.
inline std::string NcclErrorText(ncclResult_t status) {
  std::string text = ncclGetErrorString(status);
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&text, " (", last, ")");
  return text;
}

// Makes `device` current for a scope (NCCL and stream calls act on the current device)
// and restores the caller's device: the group must not move LibTorch's current device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    FSDP_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device_) FSDP_CUDA_CHECK(cudaSetDevice(device_));
  }
  ~DeviceGuard() {
    if (previous_ != device_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = -1;
};

class CudaEvent {
 public:
  CudaEvent() { FSDP_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  // Safe while a record is pending: CUDA frees the event once it completed.
  ~CudaEvent() { (void)cudaEventDestroy(event_); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace fsdp::comm::internal

#endif  // FSDP_COMM_INTERNAL_CUDA_UTILS_H_
