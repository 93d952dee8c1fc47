#include "comm/internal/tcp_store.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace fsdp::comm::internal {

c10::intrusive_ptr<c10d::Store> ConnectTcpStore(const TorchrunEnv& env, Timeout timeout, const char* caller) {
  TORCH_CHECK(env.world_size >= 1, caller, ": world_size must be >= 1, got ", env.world_size);
  TORCH_CHECK(env.rank >= 0 && env.rank < env.world_size, caller, ": rank must be in [0, ", env.world_size, "), got ",
              env.rank);
  TORCH_CHECK(env.master_port >= 1 && env.master_port <= 65535, caller, ": master_port must be in [1, 65535], got ",
              env.master_port);
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(env.master_port);
  store_options.isServer = env.rank == 0;
  store_options.numWorkers = env.world_size;
  store_options.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
}

}  // namespace fsdp::comm::internal
