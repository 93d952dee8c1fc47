// FSDP1 deferred init (FSDPOptions::param_init_fn, PyTorch's param_init_fn): a model built on
// the meta device and auto-wrapped gets, on every rank, the values a single-rank init gives
// when the init runs on the same modules in the same order (each unit when it is wrapped,
// children first; breadth first inside a unit), bitwise, and then trains; without
// param_init_fn, wrap_fsdp refuses meta tensors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "fsdp/fsdp1/state_dict.h"
#include "fsdp/fsdp1/test_models.h"
#include "fsdp/meta/meta.h"
#include "mesh/device_mesh.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::fsdp1 {
namespace {

using fsdp::testing::Backend;
using test_models::NetOptions;
using testing::Net;

constexpr uint64_t kSeed = 9;

// The single-rank reference: the init on the modules that hold tensors, in the order
// wrap_fsdp with a per-block policy materializes them (block units first, each breadth
// first; then the root's unit breadth first, skipping the wrapped blocks).
std::map<std::string, at::Tensor> ReferenceParams() {
  Net ref(NetOptions{.tie = true});
  const auto init = test_models::SeededModuleInit(kSeed);
  for (auto& block : ref->layers) {
    init(*block);
    init(*block->fc1);
    init(*block->fc2);
  }
  for (torch::nn::Module* m : std::vector<torch::nn::Module*>{
           ref.ptr().get(), ref->in.ptr().get(), ref->head.ptr().get(), ref->mix.ptr().get(), ref->tied.ptr().get()}) {
    init(*m);
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& item : ref->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

TEST(Fsdp1MetaInit, ParamInitFnMatchesSingleRankInitBitwise) {
  const std::map<std::string, at::Tensor> want = ReferenceParams();
  for (int world : {2, 3}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
      Net model(NetOptions{.tie = true});
      ToMeta(*model);
      FSDPOptions options;
      options.process_group = pg;
      options.auto_wrap_policy = ModuleTypeWrapPolicy<test_models::BlockImpl>();
      options.param_init_fn = test_models::SeededModuleInit(kSeed);
      FullyShardedDataParallel root = wrap_fsdp(model.ptr(), options);
      EXPECT_FALSE(FindMetaTensor(*model).has_value());
      const FullStateDict got = GetFullStateDict(root);
      ASSERT_EQ(got.size(), want.size());
      for (const auto& [name, value] : want) {
        ASSERT_NE(got.find(name), nullptr) << name;
        EXPECT_TRUE(at::equal(got[name], value)) << "world " << world << ": " << name;
      }
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
      test_models::TrainSteps(model, opt, 0, 1, world, pg->rank());
    });
  }
}

TEST(Fsdp1MetaInit, MetaTensorsWithoutParamInitFnAreRefused) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    Net model(NetOptions{});
    ToMeta(*model);
    FSDPOptions options;
    options.process_group = pg;
    EXPECT_ERROR_CONTAINS(wrap_fsdp(model.ptr(), options), "has parameters or buffers on the meta device");
  });
}

}  // namespace
}  // namespace fsdp::fsdp1
