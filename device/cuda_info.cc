// device_info.h's CUDA half (--config=cuda): the CUDA runtime's device properties.
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include "device/internal/cuda_info.h"

namespace fsdp::device::internal {
namespace {

cudaDeviceProp Properties(c10::DeviceIndex index) {
  int count = 0;
  const cudaError_t counted = cudaGetDeviceCount(&count);  // no driver or no device: an error
  if (counted != cudaSuccess) {
    (void)cudaGetLastError();
    count = 0;
  }
  TORCH_CHECK(index >= 0 && index < count, "device cuda:", static_cast<int>(index), " does not exist: ", count,
              " CUDA device(s) visible", counted == cudaSuccess ? "" : " (cudaGetDeviceCount: ",
              counted == cudaSuccess ? "" : cudaGetErrorString(counted), counted == cudaSuccess ? "" : ")");
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
