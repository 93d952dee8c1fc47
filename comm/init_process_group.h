// The process group a torchrun-launched program trains on, chosen by device as PyTorch's
// init_process_group picks its default backend (torch/distributed/distributed_c10d.py at the
// pinned version: "cpu:gloo,cuda:nccl"): Gloo for "cpu", NCCL (c10d's ProcessGroupNCCL) for
// "cuda", with this rank on cuda:LOCAL_RANK.
//
// Contract:
// - Reads the torchrun environment (ReadTorchrunEnv) and rendezvouses like
//   CreateGlooProcessGroupFromEnv / CreateNcclProcessGroupFromEnv; collective over the world.
// - device must be "cpu" or "cuda"; anything else is a c10::Error naming it, raised before
//   any rendezvous. "cuda" in a build without CUDA, or without that GPU, is the NCCL
//   factory's error (it says how to build it / which device is missing).
// - Thread-compatible: call once per process, before training.
#ifndef FSDP_COMM_INIT_PROCESS_GROUP_H_
#define FSDP_COMM_INIT_PROCESS_GROUP_H_

#include <c10/core/Device.h>

#include <string>

#include "comm/process_group.h"

namespace fsdp::comm {

struct DeviceProcessGroup {
  ProcessGroupPtr group;
  // Where this rank's model and batches live: cpu, or cuda:LOCAL_RANK.
  c10::Device device = c10::Device(c10::kCPU);
};

DeviceProcessGroup InitProcessGroupFromEnv(const std::string& device);

}  // namespace fsdp::comm

#endif  // FSDP_COMM_INIT_PROCESS_GROUP_H_
