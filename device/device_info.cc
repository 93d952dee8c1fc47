#include "device/device_info.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include "device/internal/cuda_info.h"

namespace fsdp::device {
namespace {

void CheckDevice(c10::Device device) {
  TORCH_CHECK(device.is_cpu() || (device.is_cuda() && device.has_index()),
              "device must be the CPU or a CUDA device with an index, got ", device.str());
}

}  // namespace

std::string DeviceName(c10::Device device) {
  CheckDevice(device);
  return device.is_cpu() ? "cpu" : internal::CudaDeviceName(device.index());
}

int64_t DeviceMemoryBytes(c10::Device device) {
  CheckDevice(device);
  if (device.is_cuda()) return internal::CudaDeviceMemoryBytes(device.index());
  return static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
}

}  // namespace fsdp::device
