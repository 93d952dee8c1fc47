// Gloo backend: an adapter over LibTorch's c10d::ProcessGroupGloo (CPU tensors).
#ifndef FSDP_COMM_GLOO_PROCESS_GROUP_H_
#define FSDP_COMM_GLOO_PROCESS_GROUP_H_

#include <string>

#include "comm/process_group.h"
#include "comm/torchrun_env.h"

namespace fsdp::comm {

struct GlooOptions {
  // Collective deadline (gloo's own timeout) and default Work::wait timeout.
  Timeout timeout = kDefaultTimeout;
  // Address this rank's gloo transport binds to. Empty (the default): as PyTorch's
  // ProcessGroupGloo (torch/csrc/distributed/c10d/init.cpp): the interfaces named in the
  // environment variable GLOO_SOCKET_IFNAME (comma-separated: one transport device each),
  // else the address this host's name resolves to (c10d's createDefaultDevice, which falls
  // back to loopback when the name resolves to nothing usable). Across hosts, set
  // GLOO_SOCKET_IFNAME (e.g. eth0) or a name that resolves to a routable address; a
  // literal "127.0.0.1" here only reaches ranks on this machine.
  std::string hostname;
  // c10d's gloo worker threads per group.
  int threads = 2;
};

// Errors of a collective that failed or timed out because peers' processes died name them:
// "<collective> failed after <T> ms: connection lost: rank(s) [R] of this group gone (...)
// (gloo: <gloo's message>)" (gloo itself names only the peer's address); a real timeout says
// "timed out after <timeout> ms". A rank whose process ended after its own error (it records
// that in the job's store first) is named apart: "rank(s) [R] stopped after their own error
// (<its message>)". For that each process listens on one extra TCP port per
// hostname (connections are only drained, never served), which every group publishes in its
// store at creation; on an error the peers' ports are probed (on loopback in microseconds,
// at most 1 s per probe, 3 probes 50 ms apart after a transport error): a refused or reset
// connection means the process is gone. A live rank, even a stuck one, is never named.

// Ranks meet through a c10d::FileStore at `store_path` (ranks as threads or processes on
// one machine). The file must not hold a previous run's keys: use a fresh path.
ProcessGroupPtr CreateGlooProcessGroupWithFileStore(const std::string& store_path, int rank, int world_size,
                                                    const GlooOptions& options = {});

// Ranks meet through a c10d::TCPStore served by rank 0 at env.master_addr:master_port.
ProcessGroupPtr CreateGlooProcessGroupWithTcpStore(const TorchrunEnv& env, const GlooOptions& options = {});

// ReadTorchrunEnv() + CreateGlooProcessGroupWithTcpStore: what a program launched by
// torchrun (or `./x run -n N`) calls.
ProcessGroupPtr CreateGlooProcessGroupFromEnv(const GlooOptions& options = {});

}  // namespace fsdp::comm

#endif  // FSDP_COMM_GLOO_PROCESS_GROUP_H_
