// NCCL through PyTorch's own engine: c10d::ProcessGroupNCCL from libtorch_cuda (its watchdog,
// flight recorder, timeouts and ncclCommSplit sub-groups) behind comm::ProcessGroup. Built
// only with --config=cuda; the default build links a stub whose factories throw, so callers
// can depend on :nccl unconditionally and test NcclAvailable().
//
// A c10d::ProcessGroupNCCL (or any c10d::Backend) the caller built already is wrapped with
// comm::WrapC10dBackend (comm/c10d_process_group.h) instead.
#ifndef FSDP_COMM_NCCL_PROCESS_GROUP_H_
#define FSDP_COMM_NCCL_PROCESS_GROUP_H_

#include "comm/process_group.h"
#include "comm/torchrun_env.h"

namespace fsdp::comm {

struct NcclOptions {
  // ProcessGroupNCCL's collective timeout (its watchdog acts on it, as
  // torch.distributed.init_process_group(timeout=...)), the default Work::wait timeout and the
  // TCPStore rendezvous timeout.
  Timeout timeout = kDefaultTimeout;
  // The CUDA device this rank's communicator and tensors live on; -1: env.local_rank.
  int device_index = -1;
};

// Contract beyond ProcessGroup's (ProcessGroupNCCL's, see torch/csrc/distributed/c10d/
// ProcessGroupNCCL.hpp at the pinned version):
// - Every tensor is a CUDA tensor (a CPU tensor is a c10::Error naming the collective and
//   the tensor's device, before anything is enqueued).
// - A collective is ordered after the work already queued on the *current* CUDA stream of
//   its tensors' device (LibTorch's current stream), and runs on ProcessGroupNCCL's own
//   stream; the caching allocator keeps its tensors alive until it finished.
// - Work::wait() and Work::wait(timeout) make the current stream wait for the collective on
//   the device; they do not block the host, and the deadline is ProcessGroupNCCL's (its
//   watchdog; set TORCH_NCCL_BLOCKING_WAIT=1 for host-blocking waits that throw on it).
//   Read results on the host after synchronizing that stream (e.g. tensor.cpu()).
// - Failures and timeouts are ProcessGroupNCCL's: its watchdog (always running) aborts the
//   communicator and, by default, ends the process (PyTorch's TORCH_NCCL_ASYNC_ERROR_HANDLING,
//   read when the group is created, chooses otherwise); new_subgroup splits the communicator (ncclCommSplit) after
//   a rendezvous on the group's store, and is collective over the parent.

// Ranks meet through a c10d::TCPStore served by rank 0 at env.master_addr:master_port (a
// client of torchrun's agent store under TORCHELASTIC_USE_AGENT_STORE).
ProcessGroupPtr CreateNcclProcessGroupWithTcpStore(const TorchrunEnv& env, const NcclOptions& options = {});

// ReadTorchrunEnv() + CreateNcclProcessGroupWithTcpStore.
ProcessGroupPtr CreateNcclProcessGroupFromEnv(const NcclOptions& options = {});

// True only in a --config=cuda build (it says nothing about whether a GPU is present).
bool NcclAvailable();

}  // namespace fsdp::comm

#endif  // FSDP_COMM_NCCL_PROCESS_GROUP_H_
