// Fake backend: a rank with no peers, for single-process shape and control-flow tests.
#ifndef FSDP_COMM_FAKE_PROCESS_GROUP_H_
#define FSDP_COMM_FAKE_PROCESS_GROUP_H_

#include "comm/process_group.h"

namespace fsdp::comm {

// PyTorch FakeProcessGroup semantics at any claimed (rank, world_size): arguments are
// validated exactly as on real backends, every Work is complete at once, and no arithmetic
// happens across ranks:
//   all_gather_into_tensor  copies the input into every rank's chunk of the output;
//   reduce_scatter_tensor   copies this rank's chunk of the input (any ReduceOp);
//   all_reduce, broadcast   leave the tensor unchanged;
//   all_to_all_single       leaves the output unchanged; barrier does nothing;
//   new_subgroup            returns a fake group of the member ranks.
ProcessGroupPtr CreateFakeProcessGroup(int rank, int world_size, Timeout timeout = kDefaultTimeout);

}  // namespace fsdp::comm

#endif  // FSDP_COMM_FAKE_PROCESS_GROUP_H_
