// Default (CPU-only) build: CUDA streams and device properties need --config=cuda.
#include <c10/util/Exception.h>

#include "device/internal/cuda_info.h"
#include "device/internal/pools.h"

namespace fsdp::device::internal {

std::shared_ptr<StreamPool> CreateCudaStreamPool(c10::Device device, const StreamOptions&) {
  TORCH_CHECK(false, "StreamPool::Create(", device,
              "): CUDA streams not built: rebuild with --config=cuda (needs nvcc)");
}

std::string CudaDeviceName(c10::DeviceIndex index) {
  TORCH_CHECK(false, "DeviceName(cuda:", static_cast<int>(index), "): CUDA not built: rebuild with --config=cuda");
}

int64_t CudaDeviceMemoryBytes(c10::DeviceIndex index) {
  TORCH_CHECK(false, "DeviceMemoryBytes(cuda:", static_cast<int>(index),
              "): CUDA not built: rebuild with --config=cuda");
}

}  // namespace fsdp::device::internal
