// LibTorch's optimizers under PyTorch 2.15's state and option names (torch/optim/adam.py,
// adamw.py, sgd.py, adagrad.py, rmsprop.py, v2.15.0). Options LibTorch does not have
// (foreach, maximize, capturable, differentiable, fused) are not written; `step` is an int,
// as LibTorch keeps it (Python keeps a float tensor).
#include "optim_state/builtin_adapters.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <tuple>

namespace fsdp::optim_state::internal {
namespace {

// Puts `t` under `name` when it is defined (optional state: amsgrad's max_exp_avg_sq, ...).
void PutDefined(StateMap& out, const char* name, const at::Tensor& t) {
  if (t.defined()) out.emplace(name, t);
}

// Adam and AdamW: the same fields in two unrelated LibTorch classes.
template <class Opt, class State, class Options>
std::shared_ptr<const OptimizerAdapter> AdamLike(const char* name) {
  return std::make_shared<TypedOptimizerAdapter<Opt, State, Options>>(
      name, TypedAdapterFunctions<State, Options>{
                .read_state =
                    [](const State& s) {
                      StateMap out{{"step", s.step()}, {"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}};
                      PutDefined(out, "max_exp_avg_sq", s.max_exp_avg_sq());
                      return out;
                    },
                .write_state =
                    [](const ParamStateReader& in, State& s) {
                      s.step(in.Step());
                      s.exp_avg(in.Tensor("exp_avg"));
                      s.exp_avg_sq(in.Tensor("exp_avg_sq"));
                      if (in.Has("max_exp_avg_sq")) s.max_exp_avg_sq(in.Tensor("max_exp_avg_sq"));
                    },
                .read_options =
                    [](const Options& o) {
                      return OptionMap{
                          {"lr", o.lr()},
                          {"betas", c10::ivalue::Tuple::create(std::get<0>(o.betas()), std::get<1>(o.betas()))},
                          {"eps", o.eps()},
                          {"weight_decay", o.weight_decay()},
                          {"amsgrad", o.amsgrad()}};
                    },
                .write_options =
                    [](const OptionReader& in, Options& o) {
                      o.lr(in.Double("lr"));
                      const auto [beta1, beta2] = in.DoublePair("betas");
                      o.betas(std::make_tuple(beta1, beta2));
                      o.eps(in.Double("eps"));
                      o.weight_decay(in.Double("weight_decay"));
                      o.amsgrad(in.Bool("amsgrad"));
                    },
            });
}

std::shared_ptr<const OptimizerAdapter> Sgd() {
  using torch::optim::SGDOptions;
  using torch::optim::SGDParamState;
  return std::make_shared<TypedOptimizerAdapter<torch::optim::SGD, SGDParamState, SGDOptions>>(
      "SGD", TypedAdapterFunctions<SGDParamState, SGDOptions>{
                 .read_state =
                     [](const SGDParamState& s) {
                       StateMap out;
                       PutDefined(out, "momentum_buffer", s.momentum_buffer());
                       return out;
                     },
                 .write_state = [](const ParamStateReader& in,
                                   SGDParamState& s) { s.momentum_buffer(in.Tensor("momentum_buffer")); },
                 .read_options =
                     [](const SGDOptions& o) {
                       return OptionMap{{"lr", o.lr()},
                                        {"momentum", o.momentum()},
                                        {"dampening", o.dampening()},
                                        {"weight_decay", o.weight_decay()},
                                        {"nesterov", o.nesterov()}};
                     },
                 .write_options =
                     [](const OptionReader& in, SGDOptions& o) {
                       o.lr(in.Double("lr"));
                       o.momentum(in.Double("momentum"));
                       o.dampening(in.Double("dampening"));
                       o.weight_decay(in.Double("weight_decay"));
                       o.nesterov(in.Bool("nesterov"));
                     },
             });
}

std::shared_ptr<const OptimizerAdapter> Adagrad() {
  using torch::optim::AdagradOptions;
  using torch::optim::AdagradParamState;
  return std::make_shared<TypedOptimizerAdapter<torch::optim::Adagrad, AdagradParamState, AdagradOptions>>(
      "Adagrad", TypedAdapterFunctions<AdagradParamState, AdagradOptions>{
                     .read_state =
                         [](const AdagradParamState& s) {
                           return StateMap{{"step", s.step()}, {"sum", s.sum()}};
                         },
                     .write_state =
                         [](const ParamStateReader& in, AdagradParamState& s) {
                           s.step(in.Step());
                           s.sum(in.Tensor("sum"));
                         },
                     .read_options =
                         [](const AdagradOptions& o) {
                           return OptionMap{{"lr", o.lr()},
                                            {"lr_decay", o.lr_decay()},
                                            {"eps", o.eps()},
                                            {"weight_decay", o.weight_decay()},
                                            {"initial_accumulator_value", o.initial_accumulator_value()}};
                         },
                     .write_options =
                         [](const OptionReader& in, AdagradOptions& o) {
                           o.lr(in.Double("lr"));
                           o.lr_decay(in.Double("lr_decay"));
                           o.eps(in.Double("eps"));
                           o.weight_decay(in.Double("weight_decay"));
                           o.initial_accumulator_value(in.Double("initial_accumulator_value"));
                         },
                 });
}

std::shared_ptr<const OptimizerAdapter> Rmsprop() {
  using torch::optim::RMSpropOptions;
  using torch::optim::RMSpropParamState;
  return std::make_shared<TypedOptimizerAdapter<torch::optim::RMSprop, RMSpropParamState, RMSpropOptions>>(
      "RMSprop", TypedAdapterFunctions<RMSpropParamState, RMSpropOptions>{
                     .read_state =
                         [](const RMSpropParamState& s) {
                           StateMap out{{"step", s.step()}, {"square_avg", s.square_avg()}};
                           PutDefined(out, "momentum_buffer", s.momentum_buffer());  // momentum > 0
                           PutDefined(out, "grad_avg", s.grad_avg());                // centered
                           return out;
                         },
                     .write_state =
                         [](const ParamStateReader& in, RMSpropParamState& s) {
                           s.step(in.Step());
                           s.square_avg(in.Tensor("square_avg"));
                           s.momentum_buffer(in.OptionalTensor("momentum_buffer"));
                           s.grad_avg(in.OptionalTensor("grad_avg"));
                         },
                     .read_options =
                         [](const RMSpropOptions& o) {
                           return OptionMap{
                               {"lr", o.lr()},   {"momentum", o.momentum()}, {"alpha", o.alpha()},
                               {"eps", o.eps()}, {"centered", o.centered()}, {"weight_decay", o.weight_decay()}};
                         },
                     .write_options =
                         [](const OptionReader& in, RMSpropOptions& o) {
                           o.lr(in.Double("lr"));
                           o.momentum(in.Double("momentum"));
                           o.alpha(in.Double("alpha"));
                           o.eps(in.Double("eps"));
                           o.centered(in.Bool("centered"));
                           o.weight_decay(in.Double("weight_decay"));
                         },
                 });
}

}  // namespace

std::vector<std::shared_ptr<const OptimizerAdapter>> BuiltinOptimizerAdapters() {
  using torch::optim::Adam;
  using torch::optim::AdamOptions;
  using torch::optim::AdamParamState;
  using torch::optim::AdamW;
  using torch::optim::AdamWOptions;
  using torch::optim::AdamWParamState;
  return {AdamLike<Adam, AdamParamState, AdamOptions>("Adam"), AdamLike<AdamW, AdamWParamState, AdamWOptions>("AdamW"),
          Sgd(), Adagrad(), Rmsprop()};
}

}  // namespace fsdp::optim_state::internal
