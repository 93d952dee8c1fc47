// The optimizer-adapter registry: how optimizer state dicts (optim_state_dict.h, and both
// FSDPs' full / sharded optimizer state built on it) read and write a torch::optim
// optimizer's per-parameter state and param group options. Adam, AdamW, SGD, Adagrad and
// RMSprop are registered from the start, with PyTorch 2.15's state and option names
// (torch/optim/{adam,adamw,sgd,adagrad,rmsprop}.py, v2.15.0); register an adapter for your
// own optimizer type to checkpoint it the same way, under FSDP1 or FSDP2.
//
// Contract:
// - Thread-safety: registering and looking up may happen concurrently from any thread (one
//   mutex). Adapters are never removed; a looked-up adapter stays valid for the program's
//   life. An adapter's methods may run concurrently (e.g. threaded ranks): keep them free of
//   mutable shared state.
// - Lookup: the most recently registered adapter whose Matches() accepts the optimizer wins
//   (so an adapter for a subclass of SGD, registered later, takes precedence over SGD's).
// - Errors are c10::Errors: registering an empty name, a null adapter or a name that is
//   already registered ("... an optimizer adapter named 'SGD' is already registered"); an
//   optimizer no adapter matches (the message names its type and lists the registered
//   names). Readers below name the parameter FQN, the state or option and the bad value.
//
// Typed registration (the usual way), e.g. for `class MySgd : public torch::optim::Optimizer`
// with `MySgdParamState` and `MySgdOptions`:
//
//   fsdp::optim_state::RegisterOptimizerAdapter<MySgd, MySgdParamState, MySgdOptions>("MySgd", {
//       .read_state = [](const MySgdParamState& s) {
//         return fsdp::optim_state::StateMap{{"velocity", s.velocity()}, {"count", s.count()}};
//       },
//       .write_state = [](const fsdp::optim_state::ParamStateReader& in, MySgdParamState& s) {
//         s.velocity(in.Tensor("velocity"));
//         s.count(in.Int("count"));
//       },
//       .read_options = [](const MySgdOptions& o) { return fsdp::optim_state::OptionMap{{"lr", o.lr()}}; },
//       .write_options = [](const fsdp::optim_state::OptionReader& in, MySgdOptions& o) { o.lr(in.Double("lr")); },
//   });
//
// State values follow the checkpoint format (checkpoint/optim_state_file.h): tensors shaped
// like their parameter are sharded / gathered with it; int64, double and zero-dim tensors are
// scalars that must agree across ranks (and across the parameters of an FSDP1 flat
// parameter).
#ifndef FSDP_OPTIM_STATE_OPTIMIZER_ADAPTER_H_
#define FSDP_OPTIM_STATE_OPTIMIZER_ADAPTER_H_

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "optim_state/optim_state_dict.h"

namespace fsdp::optim_state {

// Typed reads of one parameter's loaded state, for OptimizerAdapter::MakeState. Errors name
// the parameter and the state: "optimizer state of 'w' has no 'exp_avg'", "optimizer state
// 'exp_avg' of 'w' has shape [2] but the parameter has shape [3]", "... has the wrong type".
class ParamStateReader {
 public:
  // `adopt`: Tensor() returns a state tensor already of the parameter's device and dtype
  // itself instead of a clone (SetOptimStateDict's StateTensors::kAdopt).
  ParamStateReader(const StateMap& state, const std::string& fqn, const at::Tensor& param, bool adopt = false)
      : state_(state), fqn_(fqn), param_(param), adopt_(adopt) {}

  bool Has(const std::string& name) const { return state_.count(name) > 0; }
  // A tensor of the parameter's shape, cloned onto the parameter's device and dtype (or, when
  // adopting, the state's tensor itself if it is already there).
  at::Tensor Tensor(const std::string& name) const;
  // Tensor(name) if present, else an undefined tensor (optional state such as amsgrad's).
  at::Tensor OptionalTensor(const std::string& name) const;
  int64_t Int(const std::string& name) const;
  // Int(name), which must be >= 0 ("optimizer state 'step' of 'w' is -3 (negative)").
  int64_t Step(const std::string& name = "step") const;
  double Double(const std::string& name) const;

  const std::string& fqn() const { return fqn_; }
  const at::Tensor& param() const { return param_; }
  const StateMap& state() const { return state_; }

 private:
  const StateMap& state_;
  const std::string& fqn_;
  const at::Tensor& param_;
  const bool adopt_;
};

// Typed reads of a loaded param group's options, for OptimizerAdapter::WriteOptions (ints
// are accepted where floats are meant, as Python's optimizers do). Errors: "the optimizer
// state's param group has no option 'lr'", "param group option 'lr' is a String, not a float".
class OptionReader {
 public:
  explicit OptionReader(const OptionMap& options) : options_(options) {}

  const c10::IValue& Get(const std::string& name) const;
  double Double(const std::string& name) const;
  bool Bool(const std::string& name) const;
  // A 2-tuple of floats, e.g. Adam's "betas".
  std::pair<double, double> DoublePair(const std::string& name) const;
  const OptionMap& options() const { return options_; }

 private:
  const OptionMap& options_;
};

// How one optimizer type's state and options map to and from the FQN-keyed format.
class OptimizerAdapter {
 public:
  explicit OptimizerAdapter(std::string name) : name_(std::move(name)) {}
  virtual ~OptimizerAdapter() = default;

  // The name stored in OptimStateDict::optimizer (a state saved from one optimizer type only
  // loads into the same type).
  const std::string& name() const { return name_; }
  virtual bool Matches(const torch::optim::Optimizer& optimizer) const = 0;
  // One parameter's state -> name -> value. Tensors may alias the optimizer's.
  virtual StateMap ReadState(const torch::optim::OptimizerParamState& state) const = 0;
  // A fresh param state from a loaded one; throws (via the reader) on missing / bad values.
  virtual std::unique_ptr<torch::optim::OptimizerParamState> MakeState(const ParamStateReader& in) const = 0;
  virtual OptionMap ReadOptions(const torch::optim::OptimizerOptions& options) const = 0;
  // Writes the loaded options into `options` (checked on a copy first, so it may throw).
  virtual void WriteOptions(const OptionReader& in, torch::optim::OptimizerOptions& options) const = 0;

 private:
  std::string name_;
};

void RegisterOptimizerAdapter(std::shared_ptr<const OptimizerAdapter> adapter);

// The adapter for `optimizer` (see Lookup above), or an error naming the optimizer's type and
// the registered names.
std::shared_ptr<const OptimizerAdapter> OptimizerAdapterFor(const torch::optim::Optimizer& optimizer);

// Registered adapter names, sorted.
std::vector<std::string> RegisteredOptimizerAdapters();

// The typed form: `Opt` is recognised by dynamic_cast, its param states are `ParamState`,
// its group options `Options`. All four functions are required.
template <class ParamState, class Options>
struct TypedAdapterFunctions {
  std::function<StateMap(const ParamState&)> read_state;
  std::function<void(const ParamStateReader&, ParamState&)> write_state;
  std::function<OptionMap(const Options&)> read_options;
  std::function<void(const OptionReader&, Options&)> write_options;
};

template <class Opt, class ParamState, class Options>
class TypedOptimizerAdapter final : public OptimizerAdapter {
 public:
  TypedOptimizerAdapter(std::string name, TypedAdapterFunctions<ParamState, Options> fns)
      : OptimizerAdapter(std::move(name)), fns_(std::move(fns)) {
    TORCH_CHECK(fns_.read_state && fns_.write_state && fns_.read_options && fns_.write_options,
                "RegisterOptimizerAdapter: adapter '", this->name(),
                "' lacks one of read_state, write_state, read_options, write_options");
  }
  bool Matches(const torch::optim::Optimizer& optimizer) const override {
    return dynamic_cast<const Opt*>(&optimizer) != nullptr;
  }
  StateMap ReadState(const torch::optim::OptimizerParamState& state) const override {
    return fns_.read_state(static_cast<const ParamState&>(state));
  }
  std::unique_ptr<torch::optim::OptimizerParamState> MakeState(const ParamStateReader& in) const override {
    auto state = std::make_unique<ParamState>();
    fns_.write_state(in, *state);
    return state;
  }
  OptionMap ReadOptions(const torch::optim::OptimizerOptions& options) const override {
    return fns_.read_options(static_cast<const Options&>(options));
  }
  void WriteOptions(const OptionReader& in, torch::optim::OptimizerOptions& options) const override {
    fns_.write_options(in, static_cast<Options&>(options));
  }

 private:
  TypedAdapterFunctions<ParamState, Options> fns_;
};

template <class Opt, class ParamState, class Options>
void RegisterOptimizerAdapter(std::string name, TypedAdapterFunctions<ParamState, Options> fns) {
  static_assert(std::is_base_of_v<torch::optim::Optimizer, Opt>, "Opt must derive from torch::optim::Optimizer");
  static_assert(std::is_base_of_v<torch::optim::OptimizerParamState, ParamState>,
                "ParamState must derive from torch::optim::OptimizerParamState");
  static_assert(std::is_base_of_v<torch::optim::OptimizerOptions, Options>,
                "Options must derive from torch::optim::OptimizerOptions");
  RegisterOptimizerAdapter(
      std::make_shared<TypedOptimizerAdapter<Opt, ParamState, Options>>(std::move(name), std::move(fns)));
}

}  // namespace fsdp::optim_state

#endif  // FSDP_OPTIM_STATE_OPTIMIZER_ADAPTER_H_
