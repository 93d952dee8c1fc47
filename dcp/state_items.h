// The flattened state dict of //dcp, internal to it: what a model (any kind, through its
// adapter: dcp/adapter.h) and its optimizer hold, under the keys PyTorch 2.15 gives them when a Python user runs
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
// Contract: CollectSaveSources gets the layout of each sharded parameter from the model's
// adapter (dcp/adapter.h; made first, so FSDP groups are resharded); the tensors it returns
// alias the model's and the optimizer's (detached). Local, no communication. Errors are
// c10::Errors naming the FQN.
#ifndef FSDP_DCP_STATE_ITEMS_H_
#define FSDP_DCP_STATE_ITEMS_H_

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/dcp_metadata.h"
#include "dcp/plan.h"
#include "dcp/stateful.h"
#include "optim_state/optim_state_dict.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace fsdp::dcp::internal {

using checkpoint::DcpPathElement;

std::string ModelKey(const std::string& fqn);
std::string OptimStateKey(const std::string& fqn, const std::string& name);
std::string ParamGroupKey(size_t group, const std::string& option);
inline constexpr char kModelPrefix[] = "model.";
inline constexpr char kOptimStatePrefix[] = "optim.state.";
inline constexpr char kParamGroupsPrefix[] = "optim.param_groups.";

class ShardedParam;
class ModelAdapter;

// One tensor of the flattened state dict, as this rank holds it.
struct TensorSource {
  std::string key;
  std::vector<DcpPathElement> object_path;
  at::Tensor local;
  std::vector<int64_t> global_size;
  // The boxes of the global tensor `local` holds (sharded: the parameter's; else the whole).
  std::vector<Box> boxes;
  // The parameter `local` is laid out like (null: whole, the same on every rank: buffers,
  // parameters no adapter shards, 0-d state, Stateful tensors).
  const ShardedParam* sharded = nullptr;
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
};

// One leaf of a Stateful's state dict (dcp/stateful.h), flattened as Python's DCP flattens it.
struct StateLeaf {
  std::string key;  // "<name>.<path>"
  std::vector<DcpPathElement> object_path;
  c10::IValue value;
  // Replaces the leaf in the state dict it came from (dicts and lists share their storage).
  std::function<void(c10::IValue)> set;
};

// Checks the names (dcp/stateful.h) and flattens every object's state_dict(); throws
// c10::Error naming `caller`, the name and the path of a leaf DCP cannot store.
std::vector<StateLeaf> FlattenStateful(const StatefulItems& items, std::vector<StateDict>& state_dicts,
                                       const char* caller);
// Appends each leaf of every object: tensors whole (written once, like a buffer), the rest as
// bytes entries.
void AddStateful(const StatefulItems& items, SaveSources& out, const char* caller);

// `optimizer` may be null (model only). Model entries in named_parameters() then
// named_buffers() order (tied parameters under each name, as state_dict()), then the
// optimizer's state and param groups.
// `flatten_param_groups`: SaveOptions::flatten_optimizer_state_dict; `stored_fqn`:
// SaveOptions::stored_fqn (null: the FQNs), whose names must be distinct (else a c10::Error
// naming both FQNs).
SaveSources CollectSaveSources(torch::nn::Module& model, const ModelAdapter& adapter,
                               const torch::optim::Optimizer* optimizer, bool flatten_param_groups = false,
                               const std::function<std::string(const std::string&)>& stored_fqn = nullptr);

// The param group options PyTorch 2.15's optimizer of this adapter name has and LibTorch's
// lacks, with their defaults (maximize, foreach, capturable, differentiable, fused,
// decoupled_weight_decay: torch/optim/{adam,adamw,sgd,adagrad,rmsprop}.py), so that a Python
// optimizer's load finds every key it asks for. Empty for other optimizers.
optim_state::OptionMap PythonOnlyOptions(const std::string& optimizer);

}  // namespace fsdp::dcp::internal

#endif  // FSDP_DCP_STATE_ITEMS_H_
