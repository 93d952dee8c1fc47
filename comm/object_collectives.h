// Byte collectives: the variable-length all-gather, broadcast, gather and scatter that carry
// host data (save plans, metadata, optimizer-state schemas, error messages) between ranks,
// as PyTorch's object collectives (all_gather_object / broadcast_object_list /
// gather_object / scatter_object_list in torch/distributed/distributed_c10d.py) without
// pickling Python objects. The tensors go through ProcessGroup::object_collective_device()
// (NCCL: its CUDA device), the results come back to the host.
//
// Contract:
//  * Every function is collective over `group`: every rank calls it, in the same order as
//    its other collectives on that group. A null group, or a group of one rank, stands for
//    a world of one rank (nothing is communicated).
//  * AllGatherBytes returns every rank's bytes, in rank order (two all-gathers: the lengths,
//    then the bytes padded to the longest). BroadcastBytes returns `root`'s bytes on every
//    rank (its argument is ignored elsewhere).
//  * GatherBytes returns every rank's bytes on `root` and nothing elsewhere (an all-gather
//    of the lengths, then an all-to-all in which each rank sends only to root: no rank but
//    root ever holds W payloads, which matters at large world sizes). ScatterBytes gives
//    rank r root's pieces[r] (pieces is read on root only).
//  * A negative length from a peer is a c10::Error naming the rank; communication errors are
//    the backend's. Not thread-safe beyond the group's own rule: one thread at a time.
#ifndef FSDP_COMM_OBJECT_COLLECTIVES_H_
#define FSDP_COMM_OBJECT_COLLECTIVES_H_

#include <vector>

#include "comm/process_group.h"

namespace fsdp::comm {

std::vector<std::vector<char>> AllGatherBytes(const ProcessGroupPtr& group, const std::vector<char>& mine);

std::vector<char> BroadcastBytes(const ProcessGroupPtr& group, const std::vector<char>& bytes, int root);

std::vector<std::vector<char>> GatherBytes(const ProcessGroupPtr& group, const std::vector<char>& mine, int root);

std::vector<char> ScatterBytes(const ProcessGroupPtr& group, const std::vector<std::vector<char>>& pieces, int root);

}  // namespace fsdp::comm

#endif  // FSDP_COMM_OBJECT_COLLECTIVES_H_
