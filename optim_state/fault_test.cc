// Faults injected into FSDP2 optimizer-state consolidation (comm::FaultyProcessGroup on rank
// 0): a failed all-reduce of the cross-rank agreement check or a failed gather of an AdamW
// moment is an error on every rank within the collective timeout and leaves the model and
// optimizer untouched; a failed reduce-scatter in backward poisons the model, and loading the
// last checkpoint (model + AdamW state) into a new model on new groups continues exactly as a
// fault-free run. (FSDP1's optimizer-state faults: fsdp/fsdp1/fault_test.cc.)
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/faulty_process_group.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/fsdp2/test_models.h"
#include "mesh/device_mesh.h"
#include "optim_state/fsdp2_optim_state.h"
#include "testing/fault_injection.h"

namespace fsdp::optim_state {
namespace {

using fsdp::testing::AfterFault;
using fsdp::testing::FaultScenario;
using fsdp2::testing::Net;

// The Model of fsdp::testing::RunFaultThenRestore: blocks and root fully_shard'ed, AdamW.
class Fsdp2Model {
 public:
  struct Checkpoint {
    fsdp2::FullStateDict model;
    OptimStateDict optim;
  };

  Fsdp2Model(const comm::ProcessGroupPtr& group, uint64_t seed) : rank_(group->rank()), world_(group->size()) {
    fsdp2::testing::InitDeterministic(*model_, seed);
    auto mesh = mesh::DeviceMesh::Create(group, {group->size()});
    for (auto& b : model_->layers) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
    fsdp2::fully_shard(model_.ptr(), {.mesh = mesh});
    opt_ = std::make_unique<torch::optim::AdamW>(fsdp2::testing::UniqueParameters(*model_),
                                                 torch::optim::AdamWOptions(1e-2));
  }

  void Train(int first, int steps) { fsdp2::testing::TrainSteps(model_, *opt_, first, steps, world_, rank_); }
  Checkpoint Save() { return {fsdp2::GetFullStateDict(*model_), GetFullOptimStateDict(*model_, *opt_)}; }
  void Load(const Checkpoint& c) {
    fsdp2::LoadFullStateDict(*model_, c.model);
    LoadFullOptimStateDict(*model_, *opt_, c.optim);
  }
  std::map<std::string, at::Tensor> FullParams() { return fsdp::testing::ToMap(fsdp2::GetFullStateDict(*model_)); }
  // Between steps FSDP2's parameters are their local shards.
  std::vector<at::Tensor> LocalState() {
    return fsdp::testing::CopyParamsAndAdamWState(*opt_, fsdp2::testing::UniqueParameters(*model_));
  }
  void ExpectPoisoned(const std::string& cause) {
    using fsdp::testing::ExpectPoisonedCall;
    ExpectPoisonedCall([&] { model_(at::ones({2, 3})); }, "pre-forward", cause);
    ExpectPoisonedCall([&] { GetFullOptimStateDict(*model_, *opt_); }, "NamedParameters", cause);
  }

  Net& model() { return model_; }
  torch::optim::AdamW& optimizer() { return *opt_; }

 private:
  int rank_, world_;
  Net model_;
  std::unique_ptr<torch::optim::AdamW> opt_;
};

using Kind = comm::Fault::Kind;

void ConsolidateWithFault(const comm::Fault& fault) {
  fsdp::testing::RunFaultThenRestore<Fsdp2Model>(
      {.fault = fault, .rank0_error = "injected fault"}, AfterFault::kUnchanged,
      [](Fsdp2Model& m) { GetFullOptimStateDict(*m.model(), m.optimizer()); });
}

TEST(Fsdp2OptimStateFault, AFailedAgreementCheckErrsOnEveryRankAndLeavesTheStateUntouched) {
  ConsolidateWithFault({.kind = Kind::kFail, .index = 0, .op = "all_reduce"});
}

TEST(Fsdp2OptimStateFault, AFailedMomentGatherErrsOnEveryRankAndLeavesTheStateUntouched) {
  ConsolidateWithFault({.kind = Kind::kFail, .index = 1, .op = "all_gather_into_tensor"});
}

TEST(Fsdp2OptimStateFault, AFailedReduceScatterPoisonsAndTheCheckpointWithAdamWStateContinuesExactly) {
  fsdp::testing::RunFaultThenRestore<Fsdp2Model>(
      {.fault = {.kind = Kind::kFail, .index = 0, .op = "reduce_scatter_tensor"}, .rank0_error = "injected fault"},
      AfterFault::kPoisoned, [](Fsdp2Model& m) { m.Train(1, 1); });
}

}  // namespace
}  // namespace fsdp::optim_state
