// The flattened state dict of //dcp, internal to it: what a fully_shard'ed model and its
// optimizer hold, under the keys PyTorch 2.15 gives them when a Python user runs
//
//   dcp.save({"model": get_model_state_dict(model),
//             "optim": get_optimizer_state_dict(model, optim)}, checkpoint_id=dir)
//
// (torch/distributed/checkpoint/state_dict.py builds the nested dict; _nested_dict.py
// flatten_state_dict with _traverse.py traverse_state_dict flattens it: every Mapping is
// entered, a list is entered when it holds a Mapping or a tensor, and the path elements are
// joined with "."):
//   model.<fqn>                        tensor (DTensor for FSDP parameters)
//   optim.state.<fqn>.<name>           tensor: exp_avg, exp_avg_sq, ..., and `step` as a
//                                      0-d float32 tensor (torch/optim/adam.py)
//   optim.param_groups.<i>.<option>    bytes: torch.save of the option's value (float, bool,
//                                      None, tuple), one entry per option
//   optim.param_groups.<i>.params      bytes: torch.save of the group's FQN list
// The object paths (planner_data) are ("model", fqn), ("optim", "state", fqn, name) and
// ("optim", "param_groups", i, option): an FQN is one path element.
//
// Contract: CollectSaveSources reshards every FSDP group first (outside forward/backward
// only); the tensors it returns alias the model's and the optimizer's (detached). Local, no
// communication. Errors are c10::Errors naming the FQN.
#ifndef FSDP_DCP_STATE_ITEMS_H_
#define FSDP_DCP_STATE_ITEMS_H_

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/dcp_metadata.h"
#include "comm/process_group.h"
#include "optim_state/optim_state_dict.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}
namespace fsdp::fsdp2 {
class FSDPParam;
}

namespace fsdp::dcp::internal {

using checkpoint::DcpPathElement;

std::string ModelKey(const std::string& fqn);
std::string OptimStateKey(const std::string& fqn, const std::string& name);
std::string ParamGroupKey(size_t group, const std::string& option);
inline constexpr char kModelPrefix[] = "model.";
inline constexpr char kOptimStatePrefix[] = "optim.state.";
inline constexpr char kParamGroupsPrefix[] = "optim.param_groups.";

// One tensor of the flattened state dict, as this rank holds it.
struct TensorSource {
  std::string key;
  std::vector<DcpPathElement> object_path;
  // Laid out like this FSDP parameter's shard (null: this rank holds the whole tensor, the
  // same on every rank: buffers, parameters FSDP does not manage, 0-d state).
  const fsdp2::FSDPParam* fsdp = nullptr;
  at::Tensor local;
  std::vector<int64_t> global_size;
  // >= 0: an FSDP1 piece: `local` is 1-D and holds the elements [flat_start, + numel) of the
  // row-major flattening of the global tensor (internal::FlatRangeBoxes).
  int64_t flat_start = -1;
};

// One non-tensor value, written as the torch.save bytes of `value`.
struct BytesSource {
  std::string key;
  std::vector<DcpPathElement> object_path;
  c10::IValue value;
};

struct SaveSources {
  std::vector<TensorSource> tensors;
  std::vector<BytesSource> bytes;
  // The world group of the model's meshes; null when FSDP manages no parameter.
  comm::ProcessGroupPtr world;
};

// An FSDP1 (wrap_fsdp) parameter as this rank holds it: its elements [flat_start, +
// local.numel()) in row-major order (fsdp1::LocalFlatPieces); `local` undefined: none.
struct FlatPiece {
  std::vector<int64_t> shape;
  int64_t flat_start = 0;
  at::Tensor local;
  int64_t offset_in_shard = 0;  // of the piece in its flat parameter's local shard
  std::string flat_param_key;   // the flat parameter's key in the optimizer's local state
  int64_t shard_numel = 0;      // of that local shard
};

// The FSDP1 parameters of a wrap_fsdp tree: pieces by parameter name (tied parameters
// under each name), and each flat parameter's original parameters (primary names) in order.
struct FlatModel {
  std::map<std::string, FlatPiece> by_fqn;
  std::map<std::string, std::vector<std::string>> fqns_of_flat_param;
  bool empty() const { return by_fqn.empty(); }
};

// Empty unless `model` is the root of a wrap_fsdp tree; sets *world to the FSDP1 shard
// group then (hybrid strategies are refused: no one group spans their replicas).
FlatModel CollectFlatPieces(torch::nn::Module& model, comm::ProcessGroupPtr* world, const char* caller);

// FSDP1 optimizer state between the optimizer's local form (flat-parameter keys, this rank's
// flat shard: optim_state::GetShardedOptimStateDict) and DCP's (original parameter names;
// positive-dim tensors as this rank's 1-D piece of each, empty where it holds none; scalars
// repeated for each original parameter; param groups listing original names). Local.
optim_state::OptimStateDict FlatOptimToPieces(const optim_state::OptimStateDict& local, const FlatModel& flat);
optim_state::OptimStateDict PiecesToFlatOptim(const optim_state::OptimStateDict& pieces, const FlatModel& flat,
                                              const char* caller);

// Checks SaveOptions/LoadOptions::extra_state (dcp.h: keys non-empty, unique, outside
// "model." and "optim.", tensors defined); throws c10::Error naming `caller` and the key.
void CheckExtraState(const std::vector<std::pair<std::string, at::Tensor>>& extra, const char* caller);
// The object path Python's flatten_state_dict gives key "a.b": {"a", "b"}.
std::vector<DcpPathElement> ExtraStatePath(const std::string& key);
// Appends each extra tensor as a whole-tensor source (written once, like a buffer).
void AddExtraState(const std::vector<std::pair<std::string, at::Tensor>>& extra, SaveSources& out, const char* caller);

// `optimizer` may be null (model only).
SaveSources CollectSaveSources(torch::nn::Module& model, const torch::optim::Optimizer* optimizer);

// The param group options PyTorch 2.15's optimizer of this adapter name has and LibTorch's
// lacks, with their defaults (maximize, foreach, capturable, differentiable, fused,
// decoupled_weight_decay: torch/optim/{adam,adamw,sgd,adagrad,rmsprop}.py), so that a Python
// optimizer's load finds every key it asks for. Empty for other optimizers.
optim_state::OptionMap PythonOnlyOptions(const std::string& optimizer);

}  // namespace fsdp::dcp::internal

#endif  // FSDP_DCP_STATE_ITEMS_H_
