// The torchrun environment contract: how a launcher tells a process who it is.
#ifndef FSDP_COMM_TORCHRUN_ENV_H_
#define FSDP_COMM_TORCHRUN_ENV_H_

#include <functional>
#include <optional>
#include <string>

namespace fsdp::comm {

// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT as set by torchrun (or `./x run`),
// and torchrun's elastic-agent variables.
struct TorchrunEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;
  int master_port = 0;
  // TORCHELASTIC_USE_AGENT_STORE=True (torchrun's elastic agent already serves the TCPStore at
  // MASTER_ADDR:MASTER_PORT, a fresh one per restart attempt): every rank, rank 0 included,
  // connects as a client, as torch/distributed/rendezvous.py _create_c10d_store does.
  bool use_agent_store = false;
  // TORCHELASTIC_RESTART_COUNT: how many times torchrun restarted the workers (0 unset).
  int restart_count = 0;
};

// Reads and validates the contract from `getenv` (the process environment by default).
// Throws c10::Error naming the variable and its bad value when one is missing, not an
// integer, out of range (RANK >= WORLD_SIZE, port outside 1..65535, ...) or empty.
TorchrunEnv ReadTorchrunEnv(const std::function<std::optional<std::string>(const std::string&)>& getenv = {});

}  // namespace fsdp::comm

#endif  // FSDP_COMM_TORCHRUN_ENV_H_
