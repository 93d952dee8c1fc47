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
//  * GatherBytes returns every rank's bytes on `root` and nothing elsewhere (an all-gather
//    of the lengths, then an all-to-all in which each rank sends only to root: no rank but
//    root ever holds W payloads, which matters at large world sizes). ScatterBytes gives
//    rank r root's pieces[r] (pieces is read on root only).
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

#include "comm/process_group.h"

namespace fsdp::dcp::internal {

std::vector<std::vector<char>> AllGatherBytes(const comm::ProcessGroupPtr& group, const std::vector<char>& mine);

std::vector<char> BroadcastBytes(const comm::ProcessGroupPtr& group, const std::vector<char>& bytes, int root);

void AgreeOrThrow(const comm::ProcessGroupPtr& group, const std::string& local_error, const std::string& what);

std::vector<std::vector<char>> GatherBytes(const comm::ProcessGroupPtr& group, const std::vector<char>& mine, int root);

std::vector<char> ScatterBytes(const comm::ProcessGroupPtr& group, const std::vector<std::vector<char>>& pieces,
                               int root);

std::vector<std::vector<char>> GatherOrThrow(const comm::ProcessGroupPtr& group, const std::string& local_error,
                                             const std::vector<char>& payload, int root, const std::string& what);

std::vector<char> ScatterOrThrow(const comm::ProcessGroupPtr& group, const std::string& root_error,
                                 const std::vector<std::vector<char>>& pieces, int root, const std::string& what);

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
