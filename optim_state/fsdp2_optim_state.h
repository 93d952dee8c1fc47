// Optimizer state of fully_shard'ed (FSDP2) models in the FQN-keyed format: the full state
// (each positive-dim tensor gathered to its parameter's global shape) and back, which is
// also how a state saved at one world size loads at another.
#ifndef FSDP_OPTIM_STATE_FSDP2_OPTIM_STATE_H_
#define FSDP_OPTIM_STATE_FSDP2_OPTIM_STATE_H_

#include "optim_state/optim_state_dict.h"

namespace torch::nn {
class Module;
}

namespace fsdp::optim_state {

// The optimizer's names for `root`'s parameters (fsdp::fsdp2::NamedParameters).
NamedParams NamedOptimizerParams(torch::nn::Module& root);

// Collective over the model's meshes, on every rank. Positive-dim state tensors of FSDP
// parameters, and of tensor-parallel parameters no fully_shard manages (laid out as their
// parameter's DTensor), are all-gathered (tied parameters under their first FQN); zero-dim and
// non-tensor state is taken as this rank has it. Every rank must hold state for the same
// parameters (else every rank fails naming the first differing FQN). rank0_only: the other
// ranks return an empty dict (they still take part in the gathers).
OptimStateDict GetFullOptimStateDict(torch::nn::Module& root, const torch::optim::Optimizer& optimizer,
                                     bool rank0_only = false);

// Loads a full state (from any world size or tensor-parallel degree): each positive-dim
// tensor of an FSDP or tensor-parallel parameter is chunked like the parameter; then
// SetOptimStateDict with its checks. Local, no communication.
void LoadFullOptimStateDict(torch::nn::Module& root, torch::optim::Optimizer& optimizer, const OptimStateDict& full);

// The sharded state: this rank's own state, FQN-keyed, each positive-dim tensor its shard of
// the parameter (as torch.distributed.checkpoint.state_dict's get_optimizer_state_dict without
// full_state_dict, v2.15.0, keyed by FQN; the tensors are local shards, not DTensors). Each
// rank saves and loads its own (e.g. one file per rank); it loads back only where every
// parameter has the same shard shape (same mesh; a full state dict changes the world size).
// Local, no communication. Get's tensors alias the optimizer's state.
OptimStateDict GetShardedOptimStateDict(torch::nn::Module& root, const torch::optim::Optimizer& optimizer);
// `tensors`: as SetOptimStateDict's.
void LoadShardedOptimStateDict(torch::nn::Module& root, torch::optim::Optimizer& optimizer,
                               const OptimStateDict& sharded, StateTensors tensors = StateTensors::kCopy);
// LoadShardedOptimStateDict's checks only (CheckOptimStateDict).
void CheckShardedOptimStateDict(torch::nn::Module& root, torch::optim::Optimizer& optimizer,
                                const OptimStateDict& sharded);

}  // namespace fsdp::optim_state

#endif  // FSDP_OPTIM_STATE_FSDP2_OPTIM_STATE_H_
