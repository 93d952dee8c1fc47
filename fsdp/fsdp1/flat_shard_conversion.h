// Converting between a flat parameter's shard layout and its original parameters by FQN:
// the one place both FSDP1 model state dicts and FSDP1 optimizer state (optim_state/) use.
#ifndef FSDP_FSDP_FSDP1_FLAT_STATE_H_
#define FSDP_FSDP_FSDP1_FLAT_STATE_H_

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

#include "comm/process_group.h"

namespace torch::nn {
class Module;
}

namespace fsdp::fsdp1 {

class FlatParamHandle;

// This rank's 1-D shard of a tensor laid out like `handle`'s flat parameter -> the tensor of
// each original parameter (its shape), keyed `prefix` + FQN. Gathers over `shard_group`
// (null or size 1: `shard` is the whole flat tensor); padding is dropped. Collective.
std::map<std::string, at::Tensor> UnflattenShard(const FlatParamHandle& handle, const at::Tensor& shard,
                                                 const comm::ProcessGroupPtr& shard_group, const std::string& prefix);

// The inverse for rank `rank` of `world_size`: the original parameters' tensors (keys
// `prefix` + FQN; a missing one is zeros) flattened in the flat parameter's layout, and
// this rank's chunk of it, zero padded to the chunk size (torch.chunk as FSDP1 shards).
// Shapes must match the parameters (error naming the FQN); `dtype` is the result's. Local.
at::Tensor FlatShardOf(const FlatParamHandle& handle, const std::map<std::string, const at::Tensor*>& tensors,
                       int64_t rank, int64_t world_size, c10::ScalarType dtype, const std::string& prefix);

// The FQN prefix ("block0.") of the module owning `handle` under `root` ("" for the root).
std::string HandlePrefix(torch::nn::Module& root, const FlatParamHandle& handle);

}  // namespace fsdp::fsdp1

#endif  // FSDP_FSDP_FSDP1_FLAT_STATE_H_
