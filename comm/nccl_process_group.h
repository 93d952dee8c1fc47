// NCCL backend: ProcessGroup directly on the NCCL C API and the CUDA runtime (CUDA
// tensors). Built only with --config=cuda; the default build links a stub whose factories
// throw, so callers can depend on :nccl unconditionally and test NcclAvailable().
#ifndef FSDP_COMM_NCCL_PROCESS_GROUP_H_
#define FSDP_COMM_NCCL_PROCESS_GROUP_H_

#include <chrono>

#include "comm/process_group.h"
#include "comm/torchrun_env.h"

namespace fsdp::comm {

struct NcclOptions {
  // Every collective's deadline (from its enqueue, enforced by the watchdog), the default
  // Work::wait timeout and the TCPStore rendezvous timeout.
  Timeout timeout = kDefaultTimeout;
  // The CUDA device this rank's communicator and tensors live on; -1: env.local_rank.
  int device_index = -1;
  // A Watchdog thread (comm/watchdog.h, shared with the subgroups) polls every in-flight
  // collective: on its timeout or an NCCL async error it aborts the communicator, fails
  // every in-flight collective of it and logs one line, even when nobody waits. Off: only
  // Work::wait notices (and aborts) a timed-out or failed collective.
  bool watchdog = true;
  // How often the watchdog polls (positive).
  std::chrono::milliseconds watchdog_poll_interval{10};
};

// Contract beyond ProcessGroup's:
// - Every tensor is a CUDA tensor on the group's device.
// - Collectives run on the group's own CUDA stream, ordered after the work already queued
//   on the device's legacy default stream (LibTorch's default stream). Inputs produced on
//   another stream must be synchronized with it by the caller.
// - Work::wait() blocks the host until the collective finished on the device, so results
//   are then visible to every stream. The group keeps the tensors alive until then.
// - Failures are sticky per communicator (as in PyTorch): a collective that timed out (in
//   the watchdog or in Work::wait) or hit an NCCL async error aborts the communicator;
//   its other in-flight collectives fail with a message naming the first failure, and so
//   does every later collective (and new_subgroup) on the group. Subgroups have their own
//   communicators: they fail independently.
// - new_subgroup uses ncclCommSplit: collective over the parent, like every collective.

// Ranks meet through a c10d::TCPStore served by rank 0 at env.master_addr:master_port;
// rank 0 publishes the ncclUniqueId there.
ProcessGroupPtr CreateNcclProcessGroupWithTcpStore(const TorchrunEnv& env, const NcclOptions& options = {});

// ReadTorchrunEnv() + CreateNcclProcessGroupWithTcpStore.
ProcessGroupPtr CreateNcclProcessGroupFromEnv(const NcclOptions& options = {});

// True only in a --config=cuda build (it says nothing about whether a GPU is present).
bool NcclAvailable();

}  // namespace fsdp::comm

#endif  // FSDP_COMM_NCCL_PROCESS_GROUP_H_
