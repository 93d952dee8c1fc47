// An optimizer state dict keyed by parameter FQN (the format both FSDPs save and load), and
// conversions to and from torch::optim optimizers through the optimizer-adapter registry
// (optimizer_adapter.h: Adam, AdamW, SGD, Adagrad, RMSprop, and any the user registers).
#ifndef FSDP_OPTIM_STATE_OPTIM_STATE_DICT_H_
#define FSDP_OPTIM_STATE_OPTIM_STATE_DICT_H_

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "checkpoint/optim_state_file.h"
#include "comm/process_group.h"

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace fsdp::optim_state {

// The data types and the file format live in //checkpoint (checkpoint/optim_state_file.h);
// these names keep fsdp::optim_state::OptimStateDict etc. working.
using checkpoint::Classify;
using checkpoint::OptimStateDict;
using checkpoint::ParamGroupState;
using checkpoint::StateKind;
using checkpoint::StateValue;
using OptionMap = checkpoint::OptionMap;
using StateMap = checkpoint::StateMap;

// The optimizer's parameters by name: each tensor the optimizer holds, once (tied
// parameters under their first name). Under FSDP these are the sharded parameters.
using NamedParams = std::vector<std::pair<std::string, at::Tensor>>;

// Reads `optimizer`'s state and groups. Every parameter of the optimizer must be in `named`
// (else an error naming the group and index). Tensors alias the optimizer's state.
OptimStateDict GetOptimStateDict(const torch::optim::Optimizer& optimizer, const NamedParams& named);

// Replaces `optimizer`'s state and group options with `state_dict`'s (tensors are cloned).
// State is matched by FQN and param groups by MatchParamGroups (each group's options go to
// the optimizer's group holding the same FQNs, in any order). Both functions look the
// optimizer's adapter up (an optimizer no adapter matches is an error listing the registered
// ones). Errors, each naming the offending value: another optimizer type, an FQN the
// optimizer does not have (or lacks), param groups split differently, a state tensor whose
// shape differs from its parameter, a missing or mistyped option, a negative step. On an
// error the optimizer is unchanged.
//
// `tensors`: kCopy gives the optimizer copies of the dict's tensors (the dict stays the
// caller's); kAdopt makes a tensor already of its parameter's device and dtype the optimizer's
// state itself, as PyTorch's Optimizer.load_state_dict does (its value.to(...) returns such a
// tensor unchanged): for a caller whose dict is its own staging (dcp::Load), one copy of the
// optimizer state less.
enum class StateTensors { kCopy, kAdopt };
void SetOptimStateDict(torch::optim::Optimizer& optimizer, const NamedParams& named, const OptimStateDict& state_dict,
                       StateTensors tensors = StateTensors::kCopy);
// Every check of SetOptimStateDict, without changing the optimizer (the same errors): for a
// caller that must know the state will install before it fills the state's tensors.
void CheckOptimStateDict(torch::optim::Optimizer& optimizer, const NamedParams& named,
                         const OptimStateDict& state_dict);

// For each of the optimizer's param groups (`optimizer_groups`, FQN lists), the index of the
// loaded group holding the same set of FQNs (in any order): param groups are matched by
// name, never by position, so a checkpoint loads under another wrapping, world size or FSDP.
// PyTorch 2.15 gets there by rekeying the loaded groups' FQNs to the optimizer's own
// parameter keys (_rekey_sharded_optim_state_dict in torch/distributed/fsdp/_optim_utils.py)
// and then requires the same number of groups with the same sizes
// (torch/optim/optimizer.py, load_state_dict); its id map is positional, so groups in another
// order fail there ("doesn't match the size of optimizer's group") or mix up state. Here
// the order does not matter; errors, prefixed by `caller` and naming the FQN: one the
// optimizer has and the loaded groups lack, one the loaded groups list but the optimizer
// lacks, one listed twice, a group of either side whose FQNs the other splits across groups
// (PyTorch fails these too), a different number of (empty) groups.
std::vector<size_t> MatchParamGroups(const std::vector<std::vector<std::string>>& optimizer_groups,
                                     const std::vector<ParamGroupState>& loaded, const char* caller);

// PyTorch's key agreement: every rank of `world` holds state for the same `fqns` (a rank
// without state would skip a gather and hang the others). Collective (two all-reduces);
// every rank fails naming the first FQN the ranks disagree on. No-op for null / size 1.
void CheckStateAgreement(const comm::ProcessGroupPtr& world, const std::vector<std::string>& fqns,
                         const OptimStateDict& local, const char* caller);

// Rekeying: the state by parameter ID (the position in the flattened param groups, as
// torch.optim's state_dict() numbers parameters) and back by the groups' FQN lists.
std::map<int64_t, std::map<std::string, StateValue>> StateById(const OptimStateDict& state_dict);
OptimStateDict FromStateById(std::string optimizer, std::vector<ParamGroupState> param_groups,
                             const std::map<int64_t, std::map<std::string, StateValue>>& state);

// The file (checkpoint/optim_state_file.h): torch pickle of the dict (tensors saved from the
// CPU, written atomically) and back; the loader validates the untrusted bytes and names the
// file and the bad value in its errors.
using checkpoint::DeserializeOptimStateDict;
using checkpoint::LoadOptimStateDict;
using checkpoint::SaveOptimStateDict;
using checkpoint::SerializeOptimStateDict;

// Scatter from rank 0 (PyTorch's broadcast of a rank-0-only full state): rank 0's dict
// reaches every rank of `world` (the others' argument is ignored; pass an empty dict).
// Collective; then Load*OptimStateDict takes each rank's part.
OptimStateDict BroadcastOptimStateDict(const OptimStateDict& state_dict, const comm::ProcessGroupPtr& world);

}  // namespace fsdp::optim_state

#endif  // FSDP_OPTIM_STATE_OPTIM_STATE_DICT_H_
