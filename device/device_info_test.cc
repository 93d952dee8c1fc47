// device_info.h: the CPU's name and memory; a CUDA device's where one is, and otherwise the
// error that names the device.
#include "device/device_info.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <ATen/Context.h>

#include "testing/expect_error.h"

namespace fsdp::device {
namespace {

TEST(DeviceInfo, TheCpusNameAndPhysicalMemory) {
  EXPECT_EQ(DeviceName(c10::Device(c10::kCPU)), "cpu");
  EXPECT_EQ(DeviceMemoryBytes(c10::Device(c10::kCPU)),
            static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(::sysconf(_SC_PAGESIZE)));
  EXPECT_GT(DeviceMemoryBytes(c10::Device(c10::kCPU)), 0);
}

TEST(DeviceInfo, ACudaDeviceWhereOneIsElseAnErrorNamingIt) {
  const c10::Device cuda0(c10::kCUDA, 0);
  if (at::hasCUDA()) {
    EXPECT_FALSE(DeviceName(cuda0).empty());
    EXPECT_GT(DeviceMemoryBytes(cuda0), 0);
  } else {
#ifdef FSDP_WITH_CUDA
    EXPECT_ERROR_CONTAINS(DeviceName(cuda0), "device cuda:0 does not exist");
#else
    EXPECT_ERROR_CONTAINS(DeviceName(cuda0), "DeviceName(cuda:0): CUDA not built: rebuild with --config=cuda");
    EXPECT_ERROR_CONTAINS(DeviceMemoryBytes(cuda0), "DeviceMemoryBytes(cuda:0): CUDA not built");
#endif
  }
  EXPECT_ERROR_CONTAINS(DeviceName(c10::Device(c10::kCUDA)), "a CUDA device with an index, got cuda");
  EXPECT_ERROR_CONTAINS(DeviceName(c10::Device(c10::kMeta)), "device must be the CPU or a CUDA device");
}

}  // namespace
}  // namespace fsdp::device
