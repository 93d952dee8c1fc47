// NCCL backend: ProcessGroup directly on the NCCL C API and the CUDA runtime (CUDA
// tensors). Built only with --config=cuda; the default build links a stub whose factories
// throw, so callers can depend on :nccl unconditionally and test NcclAvailable().
#ifndef FSDP_COMM_NCCL_PROCESS_GROUP_H_
#define FSDP_COMM_NCCL_PROCESS_GROUP_H_

#include "comm/process_group.h"
#include "comm/torchrun_env.h"

namespace fsdp::comm {

struct NcclOptions {
  // Default Work::wait timeout and the TCPStore rendezvous timeout. NCCL itself has no
  // deadline: a timed-out wait leaves the collective running (see Work::wait).
  Timeout timeout = Timeout(300000);
  // The CUDA device this rank's communicator and tensors live on; -1: env.local_rank.
  int device_index = -1;
};

// Contract beyond ProcessGroup's:
// - Every tensor is a CUDA tensor on the group's device.
// - Collectives run on the group's own CUDA stream, ordered after the work already queued
//   on the device's legacy default stream (LibTorch's default stream). Inputs produced on
//   another stream must be synchronized with it by the caller.
// - Work::wait() blocks the host until the collective finished on the device, so results
//   are then visible to every stream. The group keeps the tensors alive until then.
// - new_subgroup uses ncclCommSplit: collective over the parent, like every collective.

// Ranks meet through a c10d::TCPStore served by rank 0 at env.master_addr:master_port;
// rank 0 publishes the ncclUniqueId there.
ProcessGroupPtr CreateNcclProcessGroupWithTcpStore(const TorchrunEnv& env,
                                                   const NcclOptions& options = {});

// ReadTorchrunEnv() + CreateNcclProcessGroupWithTcpStore.
ProcessGroupPtr CreateNcclProcessGroupFromEnv(const NcclOptions& options = {});

// True only in a --config=cuda build (it says nothing about whether a GPU is present).
bool NcclAvailable();

}  // namespace fsdp::comm

#endif  // FSDP_COMM_NCCL_PROCESS_GROUP_H_
