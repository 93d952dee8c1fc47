// Optimizer state of FSDP1 models in the FQN-keyed format (optimizers built on the flat
// parameters, or with use_orig_params on the original parameters' sharded views), as
// PyTorch's torch/distributed/fsdp/_optim_utils.py does it: a flat parameter's state is unflattened into its original
// parameters (gathered, padding stripped, split by numels, reshaped), and a full FQN-keyed state is flattened back into
// this rank's flat shard (zero fill for parameters without state; scalar state must agree).
#ifndef FSDP_OPTIM_STATE_FSDP1_OPTIM_STATE_H_
#define FSDP_OPTIM_STATE_FSDP1_OPTIM_STATE_H_

#include <map>
#include <string>

#include "comm/process_group.h"
#include "optim_state/optim_state_dict.h"

namespace fsdp::fsdp1 {
class FlatParamHandle;
class FullyShardedDataParallel;
}  // namespace fsdp::fsdp1

namespace fsdp::optim_state {

// This rank's state of `handle`'s flat parameter (positive-dim tensors of the flat shard's
// size) -> the state of each original parameter, keyed `prefix` + its FQN in the handle.
// Positive-dim tensors are all-gathered over `shard_group` (null or size 1: the shard is
// the whole flat parameter); collective over that group. Zero-dim and non-tensor state is
// given to every original parameter.
std::map<std::string, StateMap> UnflattenOptimState(const fsdp1::FlatParamHandle& handle, const StateMap& flat_state,
                                                    const comm::ProcessGroupPtr& shard_group,
                                                    const std::string& prefix = "");

// The inverse for rank `rank` of `world_size`: the original parameters' full state (keys
// `prefix` + FQN; parameters may be missing) -> the flat shard's state. Errors as PyTorch:
// differing state names or types across the original parameters, a tensor state whose shape
// differs from its parameter, differing dtypes, scalar state missing on some parameters or
// with differing values. Empty when no original parameter has state. Local.
StateMap FlattenOptimState(const fsdp1::FlatParamHandle& handle, const std::map<std::string, StateMap>& full,
                           int64_t rank, int64_t world_size, const std::string& prefix = "");

// Model level: the optimizer was built on `root.parameters()`: the flat parameters of handles
// with use_orig_params false, the original parameters of those with use_orig_params true
// (with a sharded strategy each holds this rank's 1-D part, and the optimizer state only for
// the parts in this rank's shard), and any parameters no handle manages. With
// use_orig_params, Get gathers each original parameter's parts from every rank of the shard
// group and Load keeps this rank's part (PyTorch's _allgather_orig_param_states and
// _shard_orig_param_state, torch/distributed/fsdp/_optim_utils.py). The full state is
// FQN-keyed exactly like FSDP2's (GetFullOptimStateDict in fsdp2_optim_state.h), so either
// loads into the other at any world size. Get is collective over every handle's shard group
// (rank0_only: the other ranks return an empty dict); Load is local.
OptimStateDict GetFullOptimStateDict(const fsdp1::FullyShardedDataParallel& root,
                                     const torch::optim::Optimizer& optimizer, bool rank0_only = false);
void LoadFullOptimStateDict(const fsdp1::FullyShardedDataParallel& root, torch::optim::Optimizer& optimizer,
                            const OptimStateDict& full);

// The sharded (local) state: what the optimizer holds on this rank, each flat parameter's
// state under its FQN in the wrapped model (`<module prefix>_flat_param`, its name in
// PyTorch's FSDP1 without the wrapper prefix) with this rank's flat shard as tensors, other
// parameters (use_orig_params: the originals, with their part in this rank's shard) under
// their FQNs. As torch/distributed/fsdp's LOCAL_STATE_DICT (v2.15.0): it loads
// back only into the same wrapping at the same world size; a full state dict reshards. Local.
OptimStateDict GetShardedOptimStateDict(const fsdp1::FullyShardedDataParallel& root,
                                        const torch::optim::Optimizer& optimizer);
void LoadShardedOptimStateDict(const fsdp1::FullyShardedDataParallel& root, torch::optim::Optimizer& optimizer,
                               const OptimStateDict& sharded);

}  // namespace fsdp::optim_state

#endif  // FSDP_OPTIM_STATE_FSDP1_OPTIM_STATE_H_
