// The all-or-nothing collectives of //dcp, internal to it, over the byte collectives of
// comm/object_collectives.h (DCP's _DistWrapper in torch/distributed/checkpoint/utils.py).
//
// Contract:
//  * Every function is collective over `group`, as comm/object_collectives.h's; a null group
//    stands for a world of one rank (nothing is communicated).
//  * AgreeOrThrow: an all-gather of each rank's error message ("" when it succeeded). If any
//    rank failed, every rank throws a c10::Error: a failed rank its own message unchanged,
//    the others "<what>: rank <r> failed: <r's message>" (the first failed rank). So a
//    collective operation succeeds everywhere or fails everywhere.
//  * GatherOrThrow: AgreeOrThrow, then GatherBytes (a rank with a non-empty `local_error`
//    makes every rank throw as AgreeOrThrow does). ScatterOrThrow: root's error (if any) is
//    broadcast and every rank throws (the others "<what>: rank <root> failed: ..."), else
//    ScatterBytes.
//  * Communication errors (a timed-out or failed collective) are the backend's c10::Errors.
//  * Not thread-safe beyond the group's own rule: one thread per group at a time.
#ifndef FSDP_DCP_COLLECTIVES_H_
#define FSDP_DCP_COLLECTIVES_H_

#include <string>
#include <vector>

#include "comm/object_collectives.h"
#include "comm/process_group.h"

namespace fsdp::dcp::internal {

void AgreeOrThrow(const comm::ProcessGroupPtr& group, const std::string& local_error, const std::string& what);

// One all-gather: throws as AgreeOrThrow when a rank failed, else returns whether every rank's
// `unchanged` is true (a cached result may then be reused everywhere).
bool AgreeUnchanged(const comm::ProcessGroupPtr& group, const std::string& local_error, bool unchanged,
                    const std::string& what);

std::vector<std::vector<char>> GatherOrThrow(const comm::ProcessGroupPtr& group, const std::string& local_error,
                                             const std::vector<char>& payload, int root, const std::string& what);

std::vector<char> ScatterOrThrow(const comm::ProcessGroupPtr& group, const std::string& root_error,
                                 const std::vector<std::vector<char>>& pieces, int root, const std::string& what);

// The group an async save's background thread communicates over: `given` (checked to have
// the world's size), or, when null, a new subgroup of all of `world`'s ranks (collective over
// `world`; null for a world of one). PyTorch's async_save advises a separate Gloo group too.
comm::ProcessGroupPtr BackgroundGroup(const comm::ProcessGroupPtr& world, comm::ProcessGroupPtr given,
                                      const char* caller);

// The message of the exception `fn` throws ("" when it returns): std::exception's what()
// (c10::Error's without its backtrace), so a failure can go through AgreeOrThrow.
template <class Fn>
std::string ErrorOf(Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace fsdp::dcp::internal

#endif  // FSDP_DCP_COLLECTIVES_H_
