// What a device is, for a training loop's log and its peak-FLOPs lookup: its name, as
// torch.cuda.get_device_name gives it ("NVIDIA H100 80GB HBM3"), and its memory.
//
//   const std::string name = fsdp::device::DeviceName(c10::Device(c10::kCUDA, 0));
//
// Contract: `device` is the CPU or a CUDA device with an index. The CPU's name is "cpu" and
// its memory the machine's physical memory. A CUDA device in a build without CUDA
// (--config=cuda), or one that does not exist, is a c10::Error naming it. Thread-safe.
#ifndef FSDP_DEVICE_DEVICE_INFO_H_
#define FSDP_DEVICE_DEVICE_INFO_H_

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace fsdp::device {

std::string DeviceName(c10::Device device);

// The device's total memory in bytes (CUDA: cudaDeviceProp::totalGlobalMem, what
// torch.cuda.get_device_properties(d).total_memory reports).
int64_t DeviceMemoryBytes(c10::Device device);

}  // namespace fsdp::device

#endif  // FSDP_DEVICE_DEVICE_INFO_H_
