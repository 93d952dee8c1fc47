// Faults injected into FSDP1's collectives (comm::FaultyProcessGroup on rank 0): a failed
// all-gather in forward or backward, a failed or hung reduce-scatter in backward, a failed
// gather while consolidating the full model state dict or the optimizer state. Every rank
// gets an error within the collective timeout; after a fault inside FSDP's hooks every later
// FSDP call fails saying why, after a failed state-dict gather the local state is untouched;
// loading the last checkpoint (model + AdamW state) into a new model on new groups continues
// exactly as a fault-free run.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/faulty_process_group.h"
#include "fsdp/fsdp1/state_dict.h"
#include "fsdp/fsdp1/test_models.h"
#include "optim_state/fsdp1_optim_state.h"
#include "testing/fault_injection.h"

namespace fsdp::fsdp1 {
namespace {

using fsdp::testing::AfterFault;
using fsdp::testing::FaultScenario;
using testing::InitDeterministic;
using testing::Net;

// A nested FULL_SHARD model (the blocks and the root wrapped) with AdamW on the flat
// parameters: the Model of fsdp::testing::RunFaultThenRestore.
class Fsdp1Model {
 public:
  struct Checkpoint {
    FullStateDict model;
    optim_state::OptimStateDict optim;
  };

  Fsdp1Model(const comm::ProcessGroupPtr& group, uint64_t seed) : rank_(group->rank()), world_(group->size()) {
    InitDeterministic(*model_, seed);
    const FSDPOptions options{.process_group = group};
    for (auto& b : model_->layers) wrap_fsdp(b.ptr(), options);
    root_ = wrap_fsdp(model_.ptr(), options);
    opt_ = std::make_unique<torch::optim::AdamW>(root_.parameters(), torch::optim::AdamWOptions(1e-2));
  }

  void Train(int first, int steps) { test_models::TrainSteps(model_, *opt_, first, steps, world_, rank_); }
  Checkpoint Save() { return {GetFullStateDict(root_), optim_state::GetFullOptimStateDict(root_, *opt_)}; }
  void Load(const Checkpoint& c) {
    LoadFullStateDict(root_, c.model);
    optim_state::LoadFullOptimStateDict(root_, *opt_, c.optim);
  }
  std::map<std::string, at::Tensor> FullParams() { return fsdp::testing::ToMap(GetFullStateDict(root_)); }
  std::vector<at::Tensor> LocalState() {
    std::vector<at::Tensor> shards;
    for (FlatParamHandle* h : root_.handles()) shards.push_back(h->flat_param().local_shard);
    std::vector<at::Tensor> out = fsdp::testing::CopyParamsAndAdamWState(*opt_, root_.parameters());
    for (const at::Tensor& shard : shards) out.push_back(shard.clone());
    return out;
  }
  void ExpectPoisoned(const std::string& cause) {
    using fsdp::testing::ExpectPoisonedCall;
    ExpectPoisonedCall([&] { model_(at::ones({2, 3})); }, "pre-forward", cause);
    ExpectPoisonedCall([&] { GetFullStateDict(root_); }, "GetFullStateDict", cause);
    ExpectPoisonedCall([&] { LoadFullStateDict(root_, FullStateDict()); }, "LoadFullStateDict", cause);
    ExpectPoisonedCall([&] { optim_state::GetFullOptimStateDict(root_, *opt_); }, "FSDP1 model / optimizer state dict",
                       cause);
    ExpectPoisonedCall([&] { root_.clip_grad_norm(1.0); }, "clip_grad_norm", cause);
    ExpectPoisonedCall([&] { (void)root_.no_sync(); }, "no_sync", cause);
  }

  FullyShardedDataParallel& root() { return root_; }
  torch::optim::AdamW& optimizer() { return *opt_; }

 private:
  int rank_, world_;
  Net model_;
  FullyShardedDataParallel root_;
  std::unique_ptr<torch::optim::AdamW> opt_;
};

enum class Call { kTrainStep, kStateDict, kOptimState };

struct Fsdp1FaultCase {
  const char* name;
  comm::Fault fault;
  Call call;
  const char* rank0_error;
};

class Fsdp1FaultTest : public ::testing::TestWithParam<Fsdp1FaultCase> {};

TEST_P(Fsdp1FaultTest, EveryRankErrsInTimeThenStateIsPoisonedOrUntouchedAndARestoreContinuesExactly) {
  const Fsdp1FaultCase& c = GetParam();
  const FaultScenario scenario{.fault = c.fault, .rank0_error = c.rank0_error};
  const AfterFault after = c.call == Call::kTrainStep ? AfterFault::kPoisoned : AfterFault::kUnchanged;
  fsdp::testing::RunFaultThenRestore<Fsdp1Model>(scenario, after, [&](Fsdp1Model& m) {
    switch (c.call) {
      case Call::kTrainStep: m.Train(1, 1); break;
      case Call::kStateDict: GetFullStateDict(m.root()); break;
      case Call::kOptimState: optim_state::GetFullOptimStateDict(m.root(), m.optimizer()); break;
    }
  });
}

using Kind = comm::Fault::Kind;
// Collective order of a step (3 handles: root, block0, block1; FULL_SHARD, BACKWARD_PRE):
// forward all-gathers 0-2, backward all-gathers from 3, reduce-scatters 0-2. The full state
// dict gathers once per handle; the optimizer state's agreement check all-reduces, then each
// AdamW moment is gathered per handle.
INSTANTIATE_TEST_SUITE_P(
    Faults, Fsdp1FaultTest,
    ::testing::Values(Fsdp1FaultCase{"forward_all_gather_fails",
                                     {.kind = Kind::kFail, .index = 1, .op = "all_gather_into_tensor"},
                                     Call::kTrainStep,
                                     "injected fault"},
                      Fsdp1FaultCase{"backward_all_gather_fails",
                                     {.kind = Kind::kFail, .index = 3, .op = "all_gather_into_tensor"},
                                     Call::kTrainStep,
                                     "injected fault"},
                      Fsdp1FaultCase{"backward_reduce_scatter_fails",
                                     {.kind = Kind::kFail, .index = 0, .op = "reduce_scatter_tensor"},
                                     Call::kTrainStep,
                                     "injected fault"},
                      Fsdp1FaultCase{"backward_reduce_scatter_hangs",
                                     {.kind = Kind::kHang, .index = 1, .op = "reduce_scatter_tensor"},
                                     Call::kTrainStep,
                                     "injected hang"},
                      Fsdp1FaultCase{"state_dict_gather_fails",
                                     {.kind = Kind::kFail, .index = 2, .op = "all_gather_into_tensor"},
                                     Call::kStateDict,
                                     "injected fault"},
                      Fsdp1FaultCase{"optim_state_agreement_check_fails",
                                     {.kind = Kind::kFail, .index = 0, .op = "all_reduce"},
                                     Call::kOptimState,
                                     "injected fault"},
                      Fsdp1FaultCase{"optim_state_gather_fails",
                                     {.kind = Kind::kFail, .index = 1, .op = "all_gather_into_tensor"},
                                     Call::kOptimState,
                                     "injected fault"}),
    [](const ::testing::TestParamInfo<Fsdp1FaultCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace fsdp::fsdp1
