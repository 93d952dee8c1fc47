// The optimizer-state checkpoint format shared by both FSDPs: an optimizer state dict keyed
// by parameter FQN, its data types, and its file (a torch pickle of the 3-tuple
// (optimizer name, {fqn: {state name: value}}, [(fqns, {option: value})])). The conversion
// to and from live torch::optim optimizers is optim_state's (optim_state/optim_state_dict.h,
// which re-exports these names in fsdp::optim_state).
#ifndef FSDP_CHECKPOINT_OPTIM_STATE_FILE_H_
#define FSDP_CHECKPOINT_OPTIM_STATE_FILE_H_

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

namespace fsdp::checkpoint {

// One state value, classified as torch/distributed/fsdp/_optim_utils.py (v2.15.0) does: a
// tensor with positive rank (laid out like its parameter: sharded, gathered, resharded), a
// zero-dim tensor, or a non-tensor scalar (LibTorch's Adam keeps `step` as an int64). The
// last two are the same on every rank and are taken as they are.
using StateValue = std::variant<at::Tensor, int64_t, double>;
enum class StateKind { kPositiveDimTensor, kZeroDimTensor, kNonTensor };
StateKind Classify(const StateValue& value);

// State name ("step", "exp_avg", ...) -> value, of one parameter.
using StateMap = std::map<std::string, StateValue>;
// Param group option name ("lr", "betas", ...) -> value.
using OptionMap = std::map<std::string, c10::IValue>;

struct ParamGroupState {
  std::vector<std::string> params;  // FQNs, in the optimizer's order
  OptionMap options;
};

struct OptimStateDict {
  std::string optimizer;  // the optimizer adapter's name: "Adam", "AdamW", "SGD", ...
  // FQN -> state name -> value; parameters without state (no step taken yet, or frozen)
  // are absent.
  std::map<std::string, StateMap> state;
  std::vector<ParamGroupState> param_groups;
};

// The file (tensors saved from the CPU, written atomically) and back. The loader reads the
// file as untrusted bytes (checkpoint_reader.h), validates the structure and reports what is
// wrong (naming the file and the value) instead of crashing; errors start with
// "LoadOptimStateDict: ".
void SaveOptimStateDict(const OptimStateDict& state_dict, const std::string& path);
OptimStateDict LoadOptimStateDict(const std::string& path);
// The same bytes in memory; `source` names them in errors.
std::vector<char> SerializeOptimStateDict(const OptimStateDict& state_dict);
OptimStateDict DeserializeOptimStateDict(const std::vector<char>& bytes, const std::string& source);

}  // namespace fsdp::checkpoint

#endif  // FSDP_CHECKPOINT_OPTIM_STATE_FILE_H_
