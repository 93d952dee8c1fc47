#include "comm/internal/tcp_store.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "comm/main_guard.h"

namespace fsdp::comm::internal {

c10::intrusive_ptr<c10d::Store> ConnectTcpStore(const TorchrunEnv& env, Timeout timeout, const char* caller) {
  TORCH_CHECK(env.world_size >= 1, caller, ": world_size must be >= 1, got ", env.world_size);
  TORCH_CHECK(env.rank >= 0 && env.rank < env.world_size, caller, ": rank must be in [0, ", env.world_size, "), got ",
              env.rank);
  TORCH_CHECK(env.master_port >= 1 && env.master_port <= 65535, caller, ": master_port must be in [1, 65535], got ",
              env.master_port);
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(env.master_port);
  store_options.isServer = env.rank == 0 && !env.use_agent_store;
  store_options.numWorkers = env.world_size;
  store_options.timeout = timeout;
  auto store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
  // This process serves its peers' store: after an error, stay long enough for them to read
  // the failure records there (comm/main_guard.h).
  if (store_options.isServer) SetExitGraceAfterError(std::chrono::milliseconds(1000));
  if (!env.use_agent_store) return store;
  // torchrun's static rendezvous keeps one agent store for every restart attempt: the keys of
  // the attempt that failed (Gloo's rendezvous addresses, the failure records) are still
  // there, so each attempt works under its own prefix (as torch.distributed's env://
  // rendezvous did with "/worker/attempt_<n>").
  return c10::make_intrusive<c10d::PrefixStore>(absl::StrCat("/worker/attempt_", env.restart_count), store);
}

}  // namespace fsdp::comm::internal
