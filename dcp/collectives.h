// Byte collectives of //dcp, internal to it: the variable-length all-gather and broadcast
// that carry save plans, fragments and error messages between the ranks (DCP's
// _DistWrapper.gather_object / all_gather_object / broadcast_object in
// torch/distributed/checkpoint/utils.py, without pickling Python objects).
//
// Contract:
//  * Every function is collective over `group`: every rank calls it, in the same order as
//    its other collectives on that group. A null group stands for a world of one rank
//    (nothing is communicated).
//  * AllGatherBytes returns every rank's bytes, in rank order (two all-gathers: the lengths,
//    then the bytes padded to the longest). BroadcastBytes returns `root`'s bytes on every
//    rank (its argument is ignored elsewhere).
//  * AgreeOrThrow: an all-gather of each rank's error message ("" when it succeeded). If any
//    rank failed, every rank throws a c10::Error: a failed rank its own message unchanged,
//    the others "<what>: rank <r> failed: <r's message>" (the first failed rank). So a
//    collective operation succeeds everywhere or fails everywhere.
//  * AllGatherOrThrow: AllGatherBytes and AgreeOrThrow in one.
//  * Communication errors (a timed-out or failed collective) are the backend's c10::Errors.
//  * Not thread-safe beyond the group's own rule: one thread per group at a time.
#ifndef FSDP_DCP_COLLECTIVES_H_
#define FSDP_DCP_COLLECTIVES_H_

#include <string>
#include <vector>

#include "comm/process_group.h"

namespace fsdp::dcp::internal {

std::vector<std::vector<char>> AllGatherBytes(const comm::ProcessGroupPtr& group, const std::vector<char>& mine);

std::vector<char> BroadcastBytes(const comm::ProcessGroupPtr& group, const std::vector<char>& bytes, int root);

void AgreeOrThrow(const comm::ProcessGroupPtr& group, const std::string& local_error, const std::string& what);

// AllGatherBytes of `payload` with AgreeOrThrow's error agreement in the same collective:
// a rank with a non-empty `local_error` sends it instead, and then every rank throws as
// AgreeOrThrow does; otherwise returns every rank's payload.
std::vector<std::vector<char>> AllGatherOrThrow(const comm::ProcessGroupPtr& group, const std::string& local_error,
                                                const std::vector<char>& payload, const std::string& what);

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
