#include "comm/init_process_group.h"

#include <c10/util/Exception.h>

#include "comm/gloo_process_group.h"
#include "comm/nccl_process_group.h"
#include "comm/torchrun_env.h"

namespace fsdp::comm {

DeviceProcessGroup InitProcessGroupFromEnv(const std::string& device) {
  TORCH_CHECK(device == "cpu" || device == "cuda",
              "InitProcessGroupFromEnv: device must be \"cpu\" (Gloo) or \"cuda\" (NCCL), got \"", device, "\"");
  const TorchrunEnv env = ReadTorchrunEnv();
  if (device == "cpu") return {CreateGlooProcessGroupWithTcpStore(env), c10::Device(c10::kCPU)};
  return {CreateNcclProcessGroupWithTcpStore(env),
          c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank))};
}

}  // namespace fsdp::comm
