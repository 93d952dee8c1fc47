// The TCPStore rendezvous shared by the Gloo and NCCL backends.
#ifndef FSDP_COMM_INTERNAL_TCP_STORE_H_
#define FSDP_COMM_INTERNAL_TCP_STORE_H_

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/torchrun_env.h"
#include "comm/work.h"

namespace fsdp::comm::internal {

// Validates `env` (errors start with `caller`) and connects to the TCPStore that rank 0
// serves at env.master_addr:env.master_port; waits for peers up to `timeout`. Under
// torchrun's agent store (env.use_agent_store) every rank is a client and the keys live under
// "/worker/attempt_<restart_count>/".
c10::intrusive_ptr<c10d::Store> ConnectTcpStore(const TorchrunEnv& env, Timeout timeout, const char* caller);

}  // namespace fsdp::comm::internal

#endif  // FSDP_COMM_INTERNAL_TCP_STORE_H_
