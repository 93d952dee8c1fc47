// Faults injected into FSDP2's collectives (comm::FaultyProcessGroup on rank 0): every rank
// gets an error within the collective timeout, FSDP then refuses further use with a message
// that says why (never silently wrong), and loading the last full state dict (model and
// optimizer) into a new model on new groups continues exactly as uninterrupted training.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <limits>
#include <mutex>

#include "absl/strings/match.h"
#include "comm/faulty_process_group.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/fsdp2/test_models.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::fsdp2 {
namespace {

using fsdp::testing::Backend;
using testing::InitDeterministic;
using testing::Net;
using testing::TrainSteps;
using Clock = std::chrono::steady_clock;

void ShardNet(Net& model, const mesh::DeviceMeshPtr& mesh) {
  for (auto& b : model->layers) fully_shard(b.ptr(), {.mesh = mesh});
  fully_shard(model.ptr(), {.mesh = mesh});
}

struct FaultCase {
  const char* name;
  comm::Fault fault;
  bool in_state_dict;  // fault the state-dict gather instead of a training step
  const char* rank0_error;
};

class FaultTest : public ::testing::TestWithParam<FaultCase> {};

TEST_P(FaultTest, EveryRankErrsInTimeThenFsdpRefusesAndARestoreContinuesExactly) {
  const FaultCase c = GetParam();
  std::mutex mu;
  FullStateDict saved;  // full parameters after step 0 (identical on every rank)
  fsdp::testing::RunOptions options;
  options.collective_timeout = std::chrono::milliseconds(500);
  fsdp::testing::RunOnRanks(
      Backend::kThreaded, 2,
      [&](const comm::ProcessGroupPtr& pg) {
        auto faulty = std::make_shared<comm::FaultyProcessGroup>(pg, std::vector<comm::Fault>{});
        Net model;
        InitDeterministic(*model);
        ShardNet(model, mesh::DeviceMesh::Create(faulty, {2}));
        torch::optim::SGD opt(model->parameters(), 1e-2);  // stateless: a restart needs the parameters only
        TrainSteps(model, opt, 0, 1, 2, pg->rank());
        const FullStateDict snapshot = GetFullStateDict(*model);
        if (pg->rank() == 0) {
          std::lock_guard<std::mutex> lock(mu);
          saved = snapshot;
        }
        if (pg->rank() == 0) faulty->Arm({c.fault});
        const auto start = Clock::now();
        std::string error;
        try {
          if (c.in_state_dict) {
            GetFullStateDict(*model);
          } else {
            TrainSteps(model, opt, 1, 1, 2, pg->rank());
          }
        } catch (const c10::Error& e) {
          error = e.what_without_backtrace();
        }
        EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(5000)) << "rank " << pg->rank();
        EXPECT_TRUE(absl::StrContains(error, pg->rank() == 0 ? c.rank0_error : "timed out after 500 ms"))
            << "rank " << pg->rank() << ": " << error;
        if (c.in_state_dict) return;  // the model itself is untouched by a failed gather
        EXPECT_ERROR_CONTAINS(model(at::ones({2, 3})), "FSDP cannot continue after an earlier error on this rank");
        EXPECT_ERROR_CONTAINS(GetFullStateDict(*model),
                              "GetFullStateDict: FSDP cannot continue after an earlier error");
      },
      options);

  if (c.in_state_dict) return;
  // Restart from the snapshot on new groups; with SGD (no state) the parameters are all a
  // restart needs, so steps 1..3 must equal the reference trained by plain SGD.
  Net sgd_ref;
  InitDeterministic(*sgd_ref);
  torch::optim::SGD sgd_ref_opt(sgd_ref->parameters(), 1e-2);
  TrainSteps(sgd_ref, sgd_ref_opt, 0, 4, 1, 0);
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Net model;
    InitDeterministic(*model, /*seed=*/99);
    ShardNet(model, mesh::DeviceMesh::Create(pg, {2}));
    LoadFullStateDict(*model, saved);
    torch::optim::SGD opt(model->parameters(), 1e-2);
    TrainSteps(model, opt, 1, 3, 2, pg->rank());
    const FullStateDict full = GetFullStateDict(*model);
    for (const auto& item : sgd_ref->named_parameters()) {
      // SGD at lr 1e-2 of gradients that differ by a few float32 ulps (2^-23; their summation order),
      // over 3 steps: far below 1e-6 (8 ulps at scale 1), itself far below a lost step (1e-2 * |g|).
      EXPECT_LE((full[item.key()] - item.value()).abs().max().item<double>(), 1e-6) << item.key();
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Faults, FaultTest,
    ::testing::Values(FaultCase{"forward_all_gather_fails",
                                {.kind = comm::Fault::Kind::kFail, .index = 1, .op = "all_gather_into_tensor"},
                                false,
                                "injected fault"},
                      FaultCase{"backward_reduce_scatter_fails",
                                {.kind = comm::Fault::Kind::kFail, .index = 0, .op = "reduce_scatter_tensor"},
                                false,
                                "injected fault"},
                      FaultCase{"backward_reduce_scatter_hangs",
                                {.kind = comm::Fault::Kind::kHang, .index = 1, .op = "reduce_scatter_tensor"},
                                false,
                                "injected hang"},
                      FaultCase{"state_dict_gather_fails",
                                {.kind = comm::Fault::Kind::kFail, .index = 2, .op = "all_gather_into_tensor"},
                                true,
                                "injected fault"}),
    [](const ::testing::TestParamInfo<FaultCase>& info) { return std::string(info.param.name); });

// The non-finite sentinel (FullyShardOptions::detect_nonfinite_grads): a NaN put into rank
// 1's unreduced gradient of one parameter (a tensor hook on it, which runs before FSDP takes
// the gradient) fails both ranks' backward with one line naming the parameter, the rank and
// the step; a clean step before it passes, and without the option nothing is checked.
struct PairImpl : torch::nn::Module {
  PairImpl()
      : l0(register_module("l0", Hooked<torch::nn::LinearImpl>(4, 4))),
        l1(register_module("l1", Hooked<torch::nn::LinearImpl>(4, 4))) {}
  at::Tensor forward(const at::Tensor& x) { return l1(l0(x)); }
  Hooked<torch::nn::LinearImpl> l0, l1;
};
using Pair = Hooked<PairImpl>;

TEST(NonfiniteSentinel, NamesTheParameterTheRankAndTheStep) {
  for (const bool detect : {true, false}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
      Pair model;
      const FullyShardOptions options{.mesh = mesh::DeviceMesh::Create(pg, {2}), .detect_nonfinite_grads = detect};
      fully_shard(model->l0.ptr(), options);
      fully_shard(model->l1.ptr(), options);
      fully_shard(model.ptr(), options);
      const at::Tensor x = at::ones({2, 4});
      model(x).sum().backward();  // step 1: finite
      bool poison = false;
      model->l1->bias.register_hook([&](const at::Tensor& g) {
        if (!poison || pg->rank() != 1) return g;
        at::Tensor bad = g.clone();
        bad[0] = std::numeric_limits<float>::quiet_NaN();
        return bad;
      });
      poison = true;
      if (!detect) {
        model(x).sum().backward();  // nothing is checked
        return;
      }
      EXPECT_ERROR_CONTAINS(model(x).sum().backward(),
                            "'l1.bias' held NaN or Inf in its unreduced gradient on rank(s) 1 at backward step 2");
    });
  }
}

}  // namespace
}  // namespace fsdp::fsdp2
