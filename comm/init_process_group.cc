#include "comm/init_process_group.h"

#include <c10/util/Exception.h>

#include "comm/gloo_process_group.h"
#include "comm/nccl_process_group.h"
#include "comm/torchrun_env.h"

namespace fsdp::comm {
namespace {

c10::Device TrainingDevice(const std::string& device) {
  if (device == "cpu") return c10::Device(c10::kCPU);
  TORCH_CHECK(device == "cuda", "InitProcessGroupFromEnv: device must be \"cpu\" (Gloo) or \"cuda\" (NCCL), got \"",
              device, "\"");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(ReadTorchrunEnv().local_rank));
}

}  // namespace

DeviceProcessGroup InitProcessGroupFromEnv(const std::string& device) {
  DeviceProcessGroup out;
  out.device = TrainingDevice(device);
  out.group = out.device.is_cuda() ? CreateNcclProcessGroupFromEnv() : CreateGlooProcessGroupFromEnv();
  return out;
}

}  // namespace fsdp::comm
