// The optimizer-adapter registry: a user-registered optimizer (VelocitySgd below, not shipped)
// round-trips through the full and sharded optimizer state dicts of both FSDPs at several
// world sizes and continues exactly like an uninterrupted run on one rank; the shipped
// Adagrad and RMSprop adapters do the same under FSDP2; registry errors name the culprit.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/optim_state_file.h"
#include "fsdp/fsdp1/state_dict.h"
#include "fsdp/fsdp1/test_models.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/fsdp2/test_models.h"
#include "optim_state/fsdp1_optim_state.h"
#include "optim_state/fsdp2_optim_state.h"
#include "optim_state/optim_state_dict.h"
#include "optim_state/optimizer_adapter.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"
#include "testing/test_dir.h"

namespace fsdp::optim_state {
namespace {

using fsdp::testing::Backend;

// ------------------------------------------------------------ a user's own optimizer
struct VelocitySgdOptions : torch::optim::OptimizerCloneableOptions<VelocitySgdOptions> {
  explicit VelocitySgdOptions(double lr = 1e-2) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(double, beta) = 0.9;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct VelocitySgdParamState : torch::optim::OptimizerCloneableParamState<VelocitySgdParamState> {
  TORCH_ARG(at::Tensor, velocity);
  TORCH_ARG(int64_t, count) = 0;
};

// v = beta v + g; p -= lr v / sqrt(count): the scalar count changes every step's update.
class VelocitySgd : public torch::optim::Optimizer {
 public:
  VelocitySgd(std::vector<at::Tensor> params, VelocitySgdOptions defaults)
      : Optimizer(std::move(params), std::make_unique<VelocitySgdOptions>(defaults)) {}

  at::Tensor step(LossClosure closure = nullptr) override {
    at::NoGradGuard no_grad;
    for (auto& group : param_groups_) {
      const auto& o = static_cast<const VelocitySgdOptions&>(group.options());
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& slot = state_[p.unsafeGetTensorImpl()];
        if (!slot) {
          auto fresh = std::make_unique<VelocitySgdParamState>();
          fresh->velocity(at::zeros_like(p));
          slot = std::move(fresh);
        }
        auto& s = static_cast<VelocitySgdParamState&>(*slot);
        s.count(s.count() + 1);
        s.velocity().mul_(o.beta()).add_(p.grad());
        p.add_(s.velocity(), -o.lr() / std::sqrt(static_cast<double>(s.count())));
      }
    }
    return {};
  }
};

void RegisterVelocitySgdOnce() {
  static const bool registered = [] {
    RegisterOptimizerAdapter<VelocitySgd, VelocitySgdParamState, VelocitySgdOptions>(
        "VelocitySgd", {
                           .read_state =
                               [](const VelocitySgdParamState& s) {
                                 return StateMap{{"velocity", s.velocity()}, {"count", s.count()}};
                               },
                           .write_state =
                               [](const ParamStateReader& in, VelocitySgdParamState& s) {
                                 s.velocity(in.Tensor("velocity"));
                                 s.count(in.Step("count"));
                               },
                           .read_options =
                               [](const VelocitySgdOptions& o) {
                                 return OptionMap{{"lr", o.lr()}, {"beta", o.beta()}};
                               },
                           .write_options =
                               [](const OptionReader& in, VelocitySgdOptions& o) {
                                 o.lr(in.Double("lr"));
                                 o.beta(in.Double("beta"));
                               },
                       });
    return true;
  }();
  (void)registered;
}

// ------------------------------------------------------------ helpers
using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>, double lr)>;

OptimizerFactory VelocitySgdFactory() {
  return [](std::vector<at::Tensor> params, double lr) {
    return std::make_unique<VelocitySgd>(std::move(params), VelocitySgdOptions(lr));
  };
}

// `steps` steps of the plain model on one rank (the reference).
fsdp2::testing::Net Reference(const OptimizerFactory& make, int steps) {
  fsdp2::testing::Net ref;
  fsdp2::testing::InitDeterministic(*ref);
  auto opt = make(ref->parameters(), 1e-2);
  fsdp2::testing::TrainSteps(ref, *opt, 0, steps, 1, 0);
  return ref;
}

void ExpectMatchesReference(const checkpoint::TensorDict& full, torch::nn::Module& ref, const std::string& label) {
  for (const auto& item : ref.named_parameters()) {
    const at::Tensor* got = full.find(item.key());
    ASSERT_NE(got, nullptr) << label << " " << item.key();
    const double scale = std::max(1.0, item.value().abs().max().item<double>());
    // Kept at 1e-6 (8 float32 ulps, 2^-23, at scale 1), tighter than AdamWParityTolerance(6, 1e-2):
    // the optimizers here include SGD-like ones, whose lost step is lr * |g|, smaller than AdamW's lr,
    // and whose parameters carry the sliced-batch gradients' few ulps scaled by lr, not amplified.
    EXPECT_LE((*got - item.value()).abs().max().item<double>(), 1e-6 * scale) << label << " " << item.key();
  }
}

// An FSDP2 model (seed `seed`) on `pg` with the factory's optimizer on its sharded parameters.
struct Fsdp2Run {
  Fsdp2Run(const comm::ProcessGroupPtr& pg, const OptimizerFactory& make, uint64_t seed, double lr) {
    auto mesh = mesh::DeviceMesh::Create(pg, {pg->size()});
    fsdp2::testing::InitDeterministic(*model, seed);
    for (auto& b : model->layers) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
    fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
    opt = make(fsdp2::testing::UniqueParameters(*model), lr);
  }
  void Train(int first, int steps, const comm::ProcessGroupPtr& pg) {
    fsdp2::testing::TrainSteps(model, *opt, first, steps, pg->size(), pg->rank());
  }
  fsdp2::testing::Net model;
  std::unique_ptr<torch::optim::Optimizer> opt;
};

struct Fsdp1AdapterRun {
  Fsdp1AdapterRun(const comm::ProcessGroupPtr& pg, const OptimizerFactory& make, uint64_t seed, double lr) {
    fsdp1::testing::InitDeterministic(*model, seed);
    fsdp1::FSDPOptions options{.process_group = pg};
    for (auto& b : model->layers) fsdp1::wrap_fsdp(b.ptr(), options);
    root = std::make_unique<fsdp1::FullyShardedDataParallel>(fsdp1::wrap_fsdp(model.ptr(), options));
    opt = make(root->parameters(), lr);
  }
  void Train(int first, int steps, const comm::ProcessGroupPtr& pg) {
    fsdp2::testing::TrainSteps(model, *opt, first, steps, pg->size(), pg->rank());
  }
  fsdp1::testing::Net model;
  std::unique_ptr<fsdp1::FullyShardedDataParallel> root;
  std::unique_ptr<torch::optim::Optimizer> opt;
};

// Full state dicts through files: 3 steps at world `from`, rank 0 saves model and optimizer
// state, a fresh model (other seed, other lr) at world `to` loads them and trains 3 more.
template <class From, class To>
void FullRoundTrip(const OptimizerFactory& make, int from, int to, const std::string& label,
                   const std::function<void(const OptimStateDict&)>& check_saved = {}) {
  fsdp2::testing::Net ref = Reference(make, 6);
  const std::string model_path = fsdp::testing::NewTestPath("model_" + label),
                    optim_path = fsdp::testing::NewTestPath("optim_" + label);
  fsdp::testing::RunOnRanks(Backend::kThreaded, from, [&](const comm::ProcessGroupPtr& pg) {
    From run(pg, make, 11, 1e-2);
    run.Train(0, 3, pg);
    checkpoint::TensorDict model_sd;
    OptimStateDict optim_sd;
    if constexpr (std::is_same_v<From, Fsdp2Run>) {
      model_sd = fsdp2::GetFullStateDict(*run.model, {.rank0_only = true});
      optim_sd = GetFullOptimStateDict(*run.model, *run.opt, /*rank0_only=*/true);
    } else {
      model_sd = fsdp1::GetFullStateDict(*run.root, /*rank0_only=*/true);
      optim_sd = GetFullOptimStateDict(*run.root, *run.opt, /*rank0_only=*/true);
    }
    if (pg->rank() != 0) return;
    if (check_saved) check_saved(optim_sd);
    checkpoint::SaveTensorDict(model_sd, model_path);
    SaveOptimStateDict(optim_sd, optim_path);
  });
  fsdp::testing::RunOnRanks(Backend::kThreaded, to, [&](const comm::ProcessGroupPtr& pg) {
    To run(pg, make, 99, 0.5);
    checkpoint::TensorDict result;
    if constexpr (std::is_same_v<To, Fsdp2Run>) {
      fsdp2::LoadFullStateDict(*run.model, fsdp2::LoadFullStateDictFile(model_path));
      LoadFullOptimStateDict(*run.model, *run.opt, LoadOptimStateDict(optim_path));
      run.Train(3, 3, pg);
      result = fsdp2::GetFullStateDict(*run.model);
    } else {
      fsdp1::LoadFullStateDict(*run.root, fsdp1::LoadFullStateDictFile(model_path));
      LoadFullOptimStateDict(*run.root, *run.opt, LoadOptimStateDict(optim_path));
      run.Train(3, 3, pg);
      result = fsdp1::GetFullStateDict(*run.root);
    }
    ExpectMatchesReference(result, *ref, absl::StrCat(label, " rank ", pg->rank()));
  });
  std::remove(model_path.c_str());
  std::remove(optim_path.c_str());
}

// Sharded state dicts at one world size: each rank keeps its own optimizer state (through its
// bytes, as a per-rank file) and the model's full state; a fresh model and optimizer load both
// and continue.
template <class Run>
void ShardedRoundTrip(const OptimizerFactory& make, int world, const std::string& label) {
  fsdp2::testing::Net ref = Reference(make, 6);
  fsdp::testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
    std::vector<char> optim_bytes;
    checkpoint::TensorDict model_sd;
    {
      Run run(pg, make, 11, 1e-2);
      run.Train(0, 3, pg);
      if constexpr (std::is_same_v<Run, Fsdp2Run>) {
        model_sd = fsdp2::GetFullStateDict(*run.model);
        optim_bytes = SerializeOptimStateDict(GetShardedOptimStateDict(*run.model, *run.opt));
      } else {
        model_sd = fsdp1::GetFullStateDict(*run.root);
        optim_bytes = SerializeOptimStateDict(GetShardedOptimStateDict(*run.root, *run.opt));
      }
    }
    const OptimStateDict sharded = DeserializeOptimStateDict(optim_bytes, "rank file");
    EXPECT_EQ(sharded.optimizer, "VelocitySgd");
    EXPECT_FALSE(sharded.state.empty());
    Run run(pg, make, 99, 0.5);
    checkpoint::TensorDict result;
    if constexpr (std::is_same_v<Run, Fsdp2Run>) {
      fsdp2::LoadFullStateDict(*run.model, model_sd);
      LoadShardedOptimStateDict(*run.model, *run.opt, sharded);
      run.Train(3, 3, pg);
      result = fsdp2::GetFullStateDict(*run.model);
    } else {
      fsdp1::LoadFullStateDict(*run.root, model_sd);
      LoadShardedOptimStateDict(*run.root, *run.opt, sharded);
      run.Train(3, 3, pg);
      result = fsdp1::GetFullStateDict(*run.root);
    }
    ExpectMatchesReference(result, *ref, absl::StrCat(label, " rank ", pg->rank()));
  });
}

// ------------------------------------------------------------ tests
TEST(OptimizerAdapter, UserOptimizerRoundTripsThroughFsdp2FullAndShardedStateDicts) {
  RegisterVelocitySgdOnce();
  FullRoundTrip<Fsdp2Run, Fsdp2Run>(VelocitySgdFactory(), 2, 3, "fsdp2_w2_to_w3", [](const OptimStateDict& sd) {
    EXPECT_EQ(sd.optimizer, "VelocitySgd");
    const StateMap& in_w = sd.state.at("in.weight");
    EXPECT_EQ(std::get<at::Tensor>(in_w.at("velocity")).sizes(), (c10::IntArrayRef{5, 3}));  // gathered
    EXPECT_EQ(std::get<int64_t>(in_w.at("count")), 3);
    EXPECT_DOUBLE_EQ(sd.param_groups.at(0).options.at("beta").toDouble(), 0.9);
  });
  FullRoundTrip<Fsdp2Run, Fsdp2Run>(VelocitySgdFactory(), 4, 1, "fsdp2_w4_to_w1");
  ShardedRoundTrip<Fsdp2Run>(VelocitySgdFactory(), 3, "fsdp2_sharded_w3");
}

TEST(OptimizerAdapter, UserOptimizerRoundTripsThroughFsdp1FullAndShardedStateDicts) {
  RegisterVelocitySgdOnce();
  FullRoundTrip<Fsdp1AdapterRun, Fsdp1AdapterRun>(VelocitySgdFactory(), 3, 2, "fsdp1_w3_to_w2");
  FullRoundTrip<Fsdp1AdapterRun, Fsdp2Run>(VelocitySgdFactory(), 4, 3, "fsdp1_w4_to_fsdp2_w3");
  ShardedRoundTrip<Fsdp1AdapterRun>(VelocitySgdFactory(), 2, "fsdp1_sharded_w2");
}

TEST(OptimizerAdapter, AdagradAndRmspropRoundTripUnderFsdp2WithPyTorchNames) {
  FullRoundTrip<Fsdp2Run, Fsdp2Run>(
      [](std::vector<at::Tensor> params, double lr) {
        return std::make_unique<torch::optim::Adagrad>(
            std::move(params), torch::optim::AdagradOptions(lr).lr_decay(0.01).initial_accumulator_value(0.1));
      },
      2, 3, "adagrad",
      [](const OptimStateDict& sd) {
        EXPECT_EQ(sd.optimizer, "Adagrad");
        EXPECT_EQ(sd.state.at("in.weight").size(), 2u);
        EXPECT_EQ(std::get<int64_t>(sd.state.at("in.weight").at("step")), 3);
        EXPECT_EQ(std::get<at::Tensor>(sd.state.at("in.weight").at("sum")).sizes(), (c10::IntArrayRef{5, 3}));
        EXPECT_DOUBLE_EQ(sd.param_groups.at(0).options.at("initial_accumulator_value").toDouble(), 0.1);
        EXPECT_DOUBLE_EQ(sd.param_groups.at(0).options.at("lr_decay").toDouble(), 0.01);
      });
  FullRoundTrip<Fsdp2Run, Fsdp2Run>(
      [](std::vector<at::Tensor> params, double lr) {
        return std::make_unique<torch::optim::RMSprop>(std::move(params),
                                                       torch::optim::RMSpropOptions(lr).momentum(0.5).centered(true));
      },
      3, 2, "rmsprop",
      [](const OptimStateDict& sd) {
        EXPECT_EQ(sd.optimizer, "RMSprop");
        std::vector<std::string> names;
        for (const auto& [name, value] : sd.state.at("head.bias")) names.push_back(name);
        EXPECT_EQ(absl::StrJoin(names, ","), "grad_avg,momentum_buffer,square_avg,step");
        EXPECT_EQ(sd.param_groups.at(0).options.at("centered").toBool(), true);
        EXPECT_DOUBLE_EQ(sd.param_groups.at(0).options.at("alpha").toDouble(), 0.99);
      });
  // Without momentum / centering RMSprop has only step and square_avg (as PyTorch).
  fsdp2::testing::Net model;
  torch::optim::RMSprop plain(model->parameters(), torch::optim::RMSpropOptions(1e-2));
  fsdp2::testing::TrainSteps(model, plain, 0, 1, 1, 0);
  EXPECT_EQ(GetOptimStateDict(plain, NamedOptimizerParams(*model)).state.at("in.weight").size(), 2u);
}

TEST(OptimizerAdapter, RegistryErrorsNameTheCulprit) {
  RegisterVelocitySgdOnce();
  const std::vector<std::string> names = RegisteredOptimizerAdapters();
  EXPECT_EQ(absl::StrJoin(names, ","), "Adagrad,Adam,AdamW,RMSprop,SGD,VelocitySgd");
  const TypedAdapterFunctions<torch::optim::SGDParamState, torch::optim::SGDOptions> noop{
      .read_state = [](const torch::optim::SGDParamState&) { return StateMap{}; },
      .write_state = [](const ParamStateReader&, torch::optim::SGDParamState&) {},
      .read_options = [](const torch::optim::SGDOptions&) { return OptionMap{}; },
      .write_options = [](const OptionReader&, torch::optim::SGDOptions&) {},
  };
  EXPECT_ERROR_CONTAINS(
      (RegisterOptimizerAdapter<torch::optim::SGD, torch::optim::SGDParamState, torch::optim::SGDOptions>("SGD", noop)),
      "RegisterOptimizerAdapter: an optimizer adapter named 'SGD' is already registered");
  EXPECT_ERROR_CONTAINS(
      (RegisterOptimizerAdapter<torch::optim::SGD, torch::optim::SGDParamState, torch::optim::SGDOptions>("", noop)),
      "RegisterOptimizerAdapter: the adapter's name is empty");
  EXPECT_ERROR_CONTAINS(RegisterOptimizerAdapter(nullptr), "RegisterOptimizerAdapter: the adapter is null");
  auto incomplete = noop;
  incomplete.write_state = nullptr;
  EXPECT_ERROR_CONTAINS(
      (RegisterOptimizerAdapter<torch::optim::SGD, torch::optim::SGDParamState, torch::optim::SGDOptions>("Partial",
                                                                                                          incomplete)),
      "adapter 'Partial' lacks one of read_state, write_state");
  EXPECT_EQ(RegisteredOptimizerAdapters(), names);  // failed registrations leave no trace

  fsdp2::testing::Net model;
  torch::optim::LBFGS lbfgs(model->parameters(), torch::optim::LBFGSOptions(1.0));
  EXPECT_ERROR_CONTAINS(GetOptimStateDict(lbfgs, NamedOptimizerParams(*model)),
                        "no optimizer adapter matches optimizer type torch::optim::LBFGS; registered adapters: "
                        "[Adagrad, Adam, AdamW, RMSprop, SGD, VelocitySgd]");
  EXPECT_ERROR_CONTAINS(SetOptimStateDict(lbfgs, NamedOptimizerParams(*model), OptimStateDict{"LBFGS", {}, {}}),
                        "no optimizer adapter matches optimizer type torch::optim::LBFGS");

  // A state of one registered type does not load into another; bad values name the state.
  VelocitySgd velocity(model->parameters(), VelocitySgdOptions(1e-2));
  fsdp2::testing::TrainSteps(model, velocity, 0, 1, 1, 0);
  OptimStateDict sd = GetOptimStateDict(velocity, NamedOptimizerParams(*model));
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
  EXPECT_ERROR_CONTAINS(SetOptimStateDict(adamw, NamedOptimizerParams(*model), sd),
                        "the optimizer state is for VelocitySgd but the optimizer is AdamW");
  sd.state.at("in.weight").at("count") = int64_t{-2};
  EXPECT_ERROR_CONTAINS(SetOptimStateDict(velocity, NamedOptimizerParams(*model), sd),
                        "optimizer state 'count' of 'in.weight' is -2 (negative)");
  sd.state.at("in.weight").at("count") = 1.5;
  EXPECT_ERROR_CONTAINS(SetOptimStateDict(velocity, NamedOptimizerParams(*model), sd),
                        "optimizer state 'count' of 'in.weight' has the wrong type (expected an int)");
  sd.state.at("in.weight").erase("count");
  sd.param_groups.at(0).options.at("beta") = c10::IValue("high");
  EXPECT_ERROR_CONTAINS(SetOptimStateDict(velocity, NamedOptimizerParams(*model), sd),
                        "param group option 'beta' is a String, not a float");
}

}  // namespace
}  // namespace fsdp::optim_state
