// One model type for every wrapper (the hooked-module layer, fsdp/hooked_module/hooked_module.h):
// the same fsdp::test_models::Net trained under FSDP2 (fully_shard) and under FSDP1
// (wrap_fsdp) on W ranks equals that type trained without any FSDP on one rank; a module with
// a `const` forward trains under both; a module takes one FSDP; handles outliving their
// module fail clearly.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <map>
#include <memory>
#include <string>
#include <type_traits>

#include "fsdp/common/test_models.h"
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"
#include "fsdp/fsdp1/state_dict.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "mesh/device_mesh.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp {
namespace {

using test_models::Batch;
using test_models::InitDeterministic;
using test_models::Net;
using test_models::NetImpl;
using test_models::TrainSteps;
using testing::Backend;

constexpr int kSteps = 3;

// The old wrapper names are the hooked-module layer's types.
static_assert(std::is_same_v<fsdp::HookedImpl<NetImpl>, HookedImpl<NetImpl>>);
static_assert(std::is_same_v<fsdp::HookedImpl<NetImpl>, HookedImpl<NetImpl>>);

// The reference: the same type, no FSDP, one rank, the whole batch.
std::map<std::string, at::Tensor> TrainReference(const test_models::NetOptions& options) {
  Net ref(options);
  InitDeterministic(*ref);
  torch::optim::Adam opt(test_models::UniqueParameters(*ref), torch::optim::AdamOptions(0.05));
  TrainSteps(ref, opt, 0, kSteps, /*world=*/1, /*rank=*/0);
  std::map<std::string, at::Tensor> out;
  for (const auto& item : ref->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

void ExpectEqualsReference(const std::map<std::string, at::Tensor>& got, const std::map<std::string, at::Tensor>& want,
                           const std::string& label) {
  ASSERT_EQ(got.size(), want.size()) << label;
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << label << ": no parameter " << name;
    // Sliced vs whole-batch gradient sums through a few steps: a few float32 ulps (2^-23) of a step per
    // step; 1e-5 relative (~80 ulps) and 1e-6 absolute, far below a whole step.
    EXPECT_TRUE(at::allclose(it->second, w, 1e-5, 1e-6))
        << label << " " << name << " max diff " << (it->second - w).abs().max().item<double>();
  }
}

class OneModelType : public ::testing::TestWithParam<int> {};

TEST_P(OneModelType, Fsdp2AndFsdp1TrainingEqualsOneRank) {
  const int world = GetParam();
  const test_models::NetOptions options{.blocks = 3};
  const auto want = TrainReference(options);
  // FSDP2: every block, then the root.
  testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
    Net model(options);
    InitDeterministic(*model);
    auto mesh = mesh::DeviceMesh::Create(pg, {world});
    for (auto& block : model->layers) fsdp2::fully_shard(block.ptr(), {.mesh = mesh});
    fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.05));
    TrainSteps(model, opt, 0, kSteps, world, pg->rank());
    std::map<std::string, at::Tensor> got;
    for (const auto& item : fsdp2::GetFullStateDict(*model)) got[item.key()] = item.value();
    ExpectEqualsReference(got, want, "FSDP2 rank " + std::to_string(pg->rank()));
  });
  // FSDP1: the same type, every block, then the root.
  testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
    Net model(options);
    InitDeterministic(*model);
    fsdp1::FSDPOptions fsdp_options{.process_group = pg};
    for (auto& block : model->layers) fsdp1::wrap_fsdp(block.ptr(), fsdp_options);
    fsdp1::FullyShardedDataParallel root = fsdp1::wrap_fsdp(model.ptr(), fsdp_options);
    torch::optim::Adam opt(root.parameters(), torch::optim::AdamOptions(0.05));
    TrainSteps(model, opt, 0, kSteps, world, pg->rank());
    std::map<std::string, at::Tensor> got;
    for (const auto& item : fsdp1::GetFullStateDict(root)) got[item.key()] = item.value();
    ExpectEqualsReference(got, want, "FSDP1 rank " + std::to_string(pg->rank()));
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, OneModelType, ::testing::Values(2, 3),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

// A block whose forward is const (it reads its parameters, changes nothing).
struct ConstBlockImpl : torch::nn::Module {
  ConstBlockImpl() : fc(register_module("fc", torch::nn::Linear(3, 3))) {}
  at::Tensor forward(const at::Tensor& x) const { return x + torch::nn::functional::relu(fc.ptr()->forward(x)); }
  torch::nn::Linear fc;
};
struct ConstNetImpl : torch::nn::Module {
  ConstNetImpl()
      : a(register_module("a", Hooked<ConstBlockImpl>())),
        b(register_module("b", Hooked<ConstBlockImpl>())),
        head(register_module("head", torch::nn::Linear(3, 1))) {}
  at::Tensor forward(const at::Tensor& x) const { return head.ptr()->forward(b.ptr()->forward(a.ptr()->forward(x))); }
  Hooked<ConstBlockImpl> a, b;
  torch::nn::Linear head;
};

// Trains `model` kSteps with Adam on this rank's rows of the batch; `params` for the optimizer.
void TrainConst(Hooked<ConstNetImpl>& model, const std::vector<at::Tensor>& params, int world, int rank) {
  torch::optim::Adam opt(params, torch::optim::AdamOptions(0.05));
  const int64_t local = 12 / world;
  for (int step = 0; step < kSteps; ++step) {
    const at::Tensor x = Batch(step, 12, 3, 1), y = Batch(step, 12, 1, 2);
    const HookedImpl<ConstNetImpl>& const_model = *model;
    torch::nn::functional::mse_loss(const_model.forward(x.narrow(0, rank * local, local)),
                                    y.narrow(0, rank * local, local))
        .backward();
    opt.step();
    opt.zero_grad();
  }
}

TEST(OneModelType, ConstForwardTrainsUnderBothFsdps) {
  Hooked<ConstNetImpl> ref;
  InitDeterministic(*ref);
  TrainConst(ref, ref->parameters(), 1, 0);
  std::map<std::string, at::Tensor> want;
  for (const auto& item : ref->named_parameters()) want[item.key()] = item.value().detach().clone();
  constexpr int kWorld = 2;
  testing::RunOnRanks(Backend::kThreaded, kWorld, [&](const comm::ProcessGroupPtr& pg) {
    Hooked<ConstNetImpl> model;
    InitDeterministic(*model);
    auto mesh = mesh::DeviceMesh::Create(pg, {kWorld});
    fsdp2::fully_shard(model->a.ptr(), {.mesh = mesh});
    fsdp2::fully_shard(model->b.ptr(), {.mesh = mesh});
    fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
    TrainConst(model, model->parameters(), kWorld, pg->rank());
    std::map<std::string, at::Tensor> got;
    for (const auto& item : fsdp2::GetFullStateDict(*model)) got[item.key()] = item.value();
    ExpectEqualsReference(got, want, "FSDP2 const forward");
  });
  testing::RunOnRanks(Backend::kThreaded, kWorld, [&](const comm::ProcessGroupPtr& pg) {
    Hooked<ConstNetImpl> model;
    InitDeterministic(*model);
    fsdp1::FSDPOptions options{.process_group = pg};
    fsdp1::wrap_fsdp(model->a.ptr(), options);
    auto root = fsdp1::wrap_fsdp(model.ptr(), options);
    TrainConst(model, root.parameters(), kWorld, pg->rank());
    std::map<std::string, at::Tensor> got;
    for (const auto& item : fsdp1::GetFullStateDict(root)) got[item.key()] = item.value();
    ExpectEqualsReference(got, want, "FSDP1 const forward");
  });
}

TEST(OneModelType, AModuleTakesOneFsdp) {
  testing::RunOnRanks(Backend::kThreaded, 1, [&](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {1});
    Net a(test_models::NetOptions{.blocks = 1});
    fsdp2::fully_shard(a->layers[0].ptr(), {.mesh = mesh});
    EXPECT_ERROR_CONTAINS(fsdp1::wrap_fsdp(a->layers[0].ptr(), {.process_group = pg}),
                          "is already managed by FSDP2 (fully_shard); a module takes one FSDP");
    Net b(test_models::NetOptions{.blocks = 1});
    fsdp1::wrap_fsdp(b->layers[0].ptr(), {.process_group = pg});
    EXPECT_ERROR_CONTAINS(fsdp2::fully_shard(b->layers[0].ptr(), {.mesh = mesh}),
                          "is already managed by FSDP1 (wrap_fsdp); a module takes one FSDP");
    torch::nn::Linear plain(3, 3);
    EXPECT_ERROR_CONTAINS(fsdp2::fully_shard(plain.ptr(), {.mesh = mesh}), "cannot run forward hooks");
  });
}

TEST(OneModelType, HandlesFailClearlyAfterTheirModuleIsDestroyed) {
  testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    fsdp2::FSDPModule fsdp2;
    fsdp1::FullyShardedDataParallel fsdp1;
    {
      Net a(test_models::NetOptions{.blocks = 1});
      fsdp2 = fsdp2::fully_shard(a.ptr(), {.mesh = mesh});
      Net b(test_models::NetOptions{.blocks = 1});
      fsdp1 = fsdp1::wrap_fsdp(b.ptr(), {.process_group = pg});
      EXPECT_NO_THROW(fsdp2.reshard());
      EXPECT_FALSE(fsdp1.parameters().empty());
    }
    EXPECT_ERROR_CONTAINS(fsdp2.unshard(), "FSDPModule: the module this handle was returned for has been destroyed");
    EXPECT_ERROR_CONTAINS(fsdp1.parameters(),
                          "FullyShardedDataParallel: the module this handle was returned for has been destroyed");
    EXPECT_ERROR_CONTAINS(fsdp2::FSDPModule().reshard(), "FSDPModule: empty handle");
  });
}

}  // namespace
}  // namespace fsdp
