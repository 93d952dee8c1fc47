// Threaded backend: W ranks as W threads of one process, with real data exchange.
#ifndef FSDP_COMM_THREADED_PROCESS_GROUP_H_
#define FSDP_COMM_THREADED_PROCESS_GROUP_H_

#include <string>
#include <vector>

#include "comm/process_group.h"

namespace fsdp::comm {

// Creates the `world_size` rank handles of one threaded world; hand element r to the
// thread that plays rank r.
//
// Collectives rendezvous by per-rank sequence number: the k-th collective of every rank
// forms one operation, executed by the last rank to arrive (earlier ranks return a pending
// Work at once, so several collectives can be outstanding). Ranks that disagree about the
// k-th collective (op, dtype, shape, reduce op, root) all get an error naming both calls.
// Reductions run in rank order, f16/bf16 accumulate in f32: results are deterministic.
std::vector<ProcessGroupPtr> CreateThreadedProcessGroups(int world_size, Timeout timeout = kDefaultTimeout);

// Fails every pending and future collective of `group`'s world with `reason` (used by the
// test runner when one rank's thread dies, so the others stop waiting at once).
// `group` must come from CreateThreadedProcessGroups (or a subgroup of one).
void AbortThreadedWorld(ProcessGroup& group, const std::string& reason);

}  // namespace fsdp::comm

#endif  // FSDP_COMM_THREADED_PROCESS_GROUP_H_
