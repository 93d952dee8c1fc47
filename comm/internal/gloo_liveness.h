// Naming the ranks a failed Gloo collective lost (//comm:internal, for //comm:gloo).
//
// Gloo names a lost peer by its transport address. To name it by rank, every process listens
// on one TCP port per hostname (never served: the kernel completes the handshake), and
// each group publishes it in its store under its rank at creation. When a collective fails or
// times out, the ranks whose port refuses connections are gone (a dead process's sockets are
// closed by the kernel); a live but stuck rank still accepts, so it is not named.
//
// A rank whose process ended is not necessarily lost: after a peer dies, its neighbours fail
// too and exit (comm/main_guard.h), and their ports refuse as well. So a rank records its own
// first failure in the job's root store (PeerLiveness::RecordFailure) before the error leaves
// the library; Describe() names a refusing rank with such a record as "stopped after its own
// error", and only the others as lost.
#ifndef FSDP_COMM_INTERNAL_GLOO_LIVENESS_H_
#define FSDP_COMM_INTERNAL_GLOO_LIVENESS_H_

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>
#include <vector>

#include "comm/work.h"

namespace fsdp::comm::internal {

// The store key under which a group publishes rank `rank`'s liveness address.
std::string LivenessKey(int rank);

// "port@ip" of this process's liveness listener bound to `hostname`'s address (created on
// first use, never closed). Throws c10::Error when the hostname does not resolve.
std::string LivenessAddress(const std::string& hostname);

// Every rank's liveness address in one group. Thread-safe (const methods only).
class PeerLiveness {
 public:
  // `addresses` indexed by group rank; `self` this process's rank; probes last at most
  // min(timeout, 1 s). `registry`: the job's root store (shared by every group of the job,
  // so a failure recorded on one group is seen from all); may be null.
  PeerLiveness(std::vector<std::string> addresses, int self, Timeout timeout, c10::intrusive_ptr<c10d::Store> registry);

  // Records this process's first failure (later calls keep it); never throws (a store that is
  // gone too is ignored).
  void RecordFailure(const std::string& message) const;

  // "rank(s) [2] of this group gone (their processes ended: ...)" plus "; rank(s) [1]
  // stopped after their own error: <first>" for ranks that recorded a failure, or "" when
  // every peer's process is alive (or unknown). After a transport error (`retries` > 0) the
  // peer that closed the connection may still be exiting: probe again a few times, 50 ms apart.
  std::string Describe(int retries = 0) const;

 private:
  std::vector<std::string> addresses_;
  int self_;
  Timeout budget_;
  c10::intrusive_ptr<c10d::Store> registry_;
};

}  // namespace fsdp::comm::internal

#endif  // FSDP_COMM_INTERNAL_GLOO_LIVENESS_H_
