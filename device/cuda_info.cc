// device_info.h's CUDA half (--config=cuda): the CUDA runtime's device properties.
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <string>

#include "device/internal/cuda_info.h"

namespace fsdp::device::internal {
namespace {

cudaDeviceProp Properties(c10::DeviceIndex index) {
  int count = 0;
  std::string why;  // no driver or no device is an error of cudaGetDeviceCount
  if (const cudaError_t counted = cudaGetDeviceCount(&count); counted != cudaSuccess) {
    (void)cudaGetLastError();
    count = 0;
    why = std::string(" (cudaGetDeviceCount: ") + cudaGetErrorString(counted) + ")";
  }
  TORCH_CHECK(index >= 0 && index < count, "device cuda:", static_cast<int>(index), " does not exist: ", count,
              " CUDA device(s) visible", why);
  cudaDeviceProp properties{};
  const cudaError_t status = cudaGetDeviceProperties(&properties, index);
  TORCH_CHECK(status == cudaSuccess, "cudaGetDeviceProperties(cuda:", static_cast<int>(index),
              ") failed: ", cudaGetErrorString(status));
  return properties;
}

}  // namespace

std::string CudaDeviceName(c10::DeviceIndex index) { return Properties(index).name; }

int64_t CudaDeviceMemoryBytes(c10::DeviceIndex index) { return static_cast<int64_t>(Properties(index).totalGlobalMem); }

}  // namespace fsdp::device::internal
