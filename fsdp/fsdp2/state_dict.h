// Model state dicts of fully_shard'ed modules: sharded (PyTorch's model.state_dict() with
// DTensor parameters) and full (torch.distributed.checkpoint.state_dict's
// full_state_dict / cpu_offload / broadcast_from_rank0 options), keyed by the original
// parameter names (FQNs relative to the root module; no FSDP wrapper in them).
//
// Every function here is collective over the ranks of the model's meshes when it gathers
// or broadcasts (full state dicts): call it on every rank, in the same order, outside
// forward/backward. Groups that are unsharded (e.g. the root after forward with
// reshard_after_forward false) are resharded first, as PyTorch's pre-save/pre-load hooks
// do.
#ifndef FSDP_FSDP_FSDP2_STATE_DICT_H_
#define FSDP_FSDP_FSDP2_STATE_DICT_H_

#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include <string>
#include <vector>

#include "checkpoint/tensor_dict_file.h"
#include "dtensor/dtensor.h"

namespace torch::nn {
class Module;
}

namespace fsdp::fsdp2 {

class FSDPParam;

// The model's parameters in named_parameters() order, each tensor once (tied ones under
// their first name), with the FSDPParam managing each (null if FSDP does not). Reshards
// every FSDP group first (outside forward/backward only).
struct NamedParameter {
  std::string fqn;
  at::Tensor param;
  FSDPParam* fsdp_param = nullptr;
};
std::vector<NamedParameter> NamedParameters(torch::nn::Module& root);

// This rank's rows of `full`, a tensor of `p`'s global shape (for FSDP + TP, of its TP chunk):
// what the sharded parameter holds of it. A view when possible.
at::Tensor LocalShardOf(const FSDPParam& p, const at::Tensor& full);
// The global tensor of `local`, laid out like `p`'s sharded parameter. Collective over p's
// mesh.
at::Tensor GatherLikeParam(const FSDPParam& p, const at::Tensor& local);

// FQN -> tensor, in the module's named_parameters() then named_buffers() order. Tied
// parameters appear under each of their names (as PyTorch's state_dict()).
// The type of checkpoint::TensorDict (checkpoint/tensor_dict_file.h), which FSDP1's full
// state dicts share.
using FullStateDict = checkpoint::TensorDict;

struct ShardedStateDict {
  // FSDP-managed parameters as DTensors (the sharded parameter: Shard(dim) on the FSDP
  // mesh, (Replicate, Shard) for HSDP, (StridedShard, TP placements) for FSDP + TP), and
  // tensor-parallel parameters no fully_shard manages (their module's spec). The local
  // tensors alias the live parameters: clone them to keep a snapshot.
  torch::OrderedDict<std::string, dtensor::DTensor> dtensors;
  // Buffers and other parameters FSDP does not manage (ignored_params), as this rank holds
  // them.
  FullStateDict tensors;
};

ShardedStateDict GetShardedStateDict(torch::nn::Module& root);

// Copies `state_dict` into the model's shards. Keys must match exactly (missing and
// unexpected keys are errors naming them). A DTensor must have the parameter's global
// shape and a mesh with the parameter's layout; other placements on that mesh are
// redistributed (e.g. a Replicate checkpoint). Values are copied (dtype cast as
// Tensor::copy_), so the state dict stays usable.
void LoadShardedStateDict(torch::nn::Module& root, const ShardedStateDict& state_dict);

struct FullStateDictOptions {
  // Get: ranks other than 0 return an empty dict (they still take part in the gathers).
  // Load: only rank 0's dict is read (the others may pass an empty one); each tensor is
  // broadcast from rank 0 and sliced locally.
  bool rank0_only = false;
  // Get: move the gathered tensors to the CPU.
  bool cpu_offload = false;
};

// All-gathers every parameter; FSDP-managed ones come back unpadded in the original shape,
// and so do tensor-parallel parameters no fully_shard manages (a DistributedParameterModule's,
// gathered over its mesh).
FullStateDict GetFullStateDict(torch::nn::Module& root, const FullStateDictOptions& options = {});

// Takes this rank's shard of each full tensor (torch.chunk on the shard dim; for FSDP + TP
// the tensor-parallel chunk first; for a tensor-parallel parameter no fully_shard manages,
// its spec's box). Shapes must equal the parameters' global shapes.
void LoadFullStateDict(torch::nn::Module& root, const FullStateDict& state_dict,
                       const FullStateDictOptions& options = {});

// A full state dict as a file (torch pickle of a str -> Tensor dict; tensors are saved
// from the CPU; written atomically) and back: checkpoint::SaveTensorDict / LoadTensorDict
// (checkpoint/tensor_dict_file.h) with these functions' names in errors, kept for FSDP2
// users. Loading reads untrusted bytes (checkpoint/checkpoint_reader.h): a truncated
// or corrupted file is a c10::Error naming the file and the bad value. Python's torch.save
// of a dict or a state_dict() of tensors loads too.
void SaveFullStateDict(const FullStateDict& state_dict, const std::string& path);
FullStateDict LoadFullStateDictFile(const std::string& path);
// The same bytes in memory; `source` names them in errors.
FullStateDict DeserializeFullStateDict(const std::vector<char>& bytes, const std::string& source);

}  // namespace fsdp::fsdp2

#endif  // FSDP_FSDP_FSDP2_STATE_DICT_H_
