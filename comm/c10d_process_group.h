// Any c10d backend as a comm::ProcessGroup: the adapter the Gloo backend is built on, for a
// c10d::Backend the caller already has (PyTorch's ProcessGroupGloo, ProcessGroupNCCL from
// libtorch_cuda, UCC, MPI, ...).
//
//   auto store = c10::make_intrusive<c10d::FileStore>(path, world);
//   auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, gloo_options);
//   fsdp::comm::ProcessGroupPtr pg = fsdp::comm::WrapC10dBackend(gloo, {.store = store});
//   auto mesh = fsdp::mesh::DeviceMesh::Create(pg, {world});   // then fully_shard as usual
//
// Contract:
//  * Every collective maps to the backend's own (all_gather_single, reduce_scatter_single,
//    allreduce, broadcast, all_to_all_single, barrier); ranks and size are the backend's.
//    AVG runs as SUM then a division where the backend has no AVG (its name is "gloo");
//    PREMUL_SUM as a scaled copy and SUM. Results are written where comm::ProcessGroup says.
//  * Errors: a collective the backend failed throws c10::DistBackendError on wait naming the
//    collective, this rank and the elapsed time, with the backend's message; a wait that
//    outlasts its timeout says "timed out after T ms". The backend's own deadline and
//    watchdog (NCCL's) stay in charge of aborting.
//  * new_subgroup: through the backend's split() (c10d's ProcessGroup::splitGroup), which
//    rendezvous on C10dOptions::store under a fresh key prefix per call; without a store,
//    new_subgroup throws c10::Error saying so.
//  * Thread-safety: as the backend's (c10d backends take collectives from one thread at a
//    time per group, in the same order on every rank).
#ifndef FSDP_COMM_C10D_PROCESS_GROUP_H_
#define FSDP_COMM_C10D_PROCESS_GROUP_H_

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/process_group.h"

namespace fsdp::comm {

struct C10dOptions {
  // Work::wait's default timeout (the backend keeps its own collective deadline).
  Timeout timeout = kDefaultTimeout;
  // The store the backend's split() uses for new_subgroup (null: no sub-groups).
  c10::intrusive_ptr<c10d::Store> store;
  // ProcessGroup::object_collective_device(): unset, the CPU. A ProcessGroupNCCL needs its
  // CUDA device here (NCCL takes no CPU tensors), as PyTorch's object collectives use.
  std::optional<c10::Device> object_collective_device;
};

// Throws c10::Error when `backend` is null or C10dOptions::timeout is not positive.
ProcessGroupPtr WrapC10dBackend(c10::intrusive_ptr<c10d::Backend> backend, C10dOptions options = {});

}  // namespace fsdp::comm

#endif  // FSDP_COMM_C10D_PROCESS_GROUP_H_
