// Full model state dicts of FSDP1 models, keyed by the original parameter names: the same
// type and file format (checkpoint/tensor_dict_file.h) as FSDP2's, so a checkpoint of either
// loads into the other, at any world size.
#ifndef FSDP_FSDP_FSDP1_STATE_DICT_H_
#define FSDP_FSDP_FSDP1_STATE_DICT_H_

#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include <string>
#include <vector>

#include "checkpoint/tensor_dict_file.h"
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"

namespace fsdp::fsdp1 {

// checkpoint::TensorDict, the type of fsdp::fsdp2::FullStateDict too.
using FullStateDict = checkpoint::TensorDict;

// Collective over every handle's shard group; call on every rank outside forward/backward
// (handles must be resharded). Parameters in named_parameters() order (tied ones under each
// name), then buffers. rank0_only: other ranks return an empty dict.
FullStateDict GetFullStateDict(const FullyShardedDataParallel& root, bool rank0_only = false);

// Takes this rank's chunk of every flat parameter from the full tensors (local). Missing,
// unexpected and misshapen keys are errors naming them.
void LoadFullStateDict(const FullyShardedDataParallel& root, const FullStateDict& state_dict);

// This rank's pieces of the original parameters, for sharded checkpoints (dcp/dcp.h): for
// each original parameter of every flat parameter (under its primary name), the elements
// [flat_start, flat_start + local.numel()) of its row-major flattening that this rank's
// flat shard holds, as a 1-D view into the local shard (writing into it changes the model);
// `local` is undefined when the shard holds none of it. `group`: the handle's shard group
// (null when unsharded). Local (lazy init, no collective); call on every rank outside
// forward/backward.
struct LocalFlatPiece {
  std::string fqn;
  std::vector<int64_t> shape;
  int64_t flat_start = 0;
  at::Tensor local;
  comm::ProcessGroupPtr group;
  // Where the piece sits in the local shard, and the flat parameter's name in the optimizer
  // state (optim_state/fsdp1_optim_state.h: "<module prefix>_flat_param") and shard numel.
  int64_t offset_in_shard = 0;
  std::string flat_param_key;
  int64_t shard_numel = 0;
};
std::vector<LocalFlatPiece> LocalFlatPieces(const FullyShardedDataParallel& root);

// A full state dict as a file (torch.save-compatible str -> Tensor dict, written atomically)
// and back: checkpoint::SaveTensorDict / LoadTensorDict with these names in errors. Loading
// validates the untrusted bytes (checkpoint/checkpoint_reader.h). Files written by FSDP2's
// fsdp::fsdp2::SaveFullStateDict load here and the other way round.
void SaveFullStateDict(const FullStateDict& state_dict, const std::string& path);
FullStateDict LoadFullStateDictFile(const std::string& path);

}  // namespace fsdp::fsdp1

#endif  // FSDP_FSDP_FSDP1_STATE_DICT_H_
