// The CUDA half of device_info.h: cuda_info.cc in --config=cuda builds, otherwise
// cuda_unavailable.cc's c10::Errors saying how to get it.
#ifndef FSDP_DEVICE_INTERNAL_CUDA_INFO_H_
#define FSDP_DEVICE_INTERNAL_CUDA_INFO_H_

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace fsdp::device::internal {

std::string CudaDeviceName(c10::DeviceIndex index);
int64_t CudaDeviceMemoryBytes(c10::DeviceIndex index);

}  // namespace fsdp::device::internal

#endif  // FSDP_DEVICE_INTERNAL_CUDA_INFO_H_
