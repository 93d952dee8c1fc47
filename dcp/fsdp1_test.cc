// DCP checkpoints of FSDP1 (wrap_fsdp) models: each rank writes the boxes of its flat-shard
// pieces of the original parameters (internal::FlatRangeBoxes), and of its flat optimizer
// state, and reads back only those, so a checkpoint moves between FSDP1 and FSDP2 and
// between world sizes. Checked bitwise against the saving model's full state dict, by
// continued AdamW training against one rank, and the box decomposition by direct indexing.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dcp/dcp.h"
#include "dcp/plan.h"
#include "fsdp/common/test_models.h"
#include "fsdp/fsdp1/fsdp_state.h"  // GetState: the runtime behind the handle
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"
#include "fsdp/fsdp1/state_dict.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::dcp {
namespace {

using fsdp::testing::Backend;
using test_models::Net;
using test_models::NetOptions;

std::string Dir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/dcp_fsdp1_", name, "_", getpid());
}

// Every element of [start, start + n) exactly once, in flat order, from the boxes.
TEST(FlatRangeBoxes, CoverTheRangeInOrder) {
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{7}, {3, 5}, {2, 3, 4}, {4, 1, 3, 2}}) {
    int64_t total = 1;
    for (int64_t s : shape) total *= s;
    const at::Tensor global = at::arange(total, at::kLong).view(shape);
    for (int64_t start = 0; start <= total; ++start) {
      for (int64_t n = 0; start + n <= total; ++n) {
        const std::vector<internal::Box> boxes = internal::FlatRangeBoxes(shape, start, n);
        EXPECT_LE(boxes.size(), 2 * shape.size());
        at::Tensor local = at::full({n}, -1, at::kLong);
        for (const internal::Box& b : boxes) {
          at::Tensor part = global;
          for (size_t d = 0; d < shape.size(); ++d) part = part.narrow(d, b.global_offsets[d], b.sizes[d]);
          internal::BoxOf(local, b).copy_(part);
        }
        EXPECT_TRUE(at::equal(local, at::arange(start, start + n, at::kLong)))
            << "shape " << global.sizes() << " [" << start << ", " << start + n << ")";
      }
    }
  }
  EXPECT_ERROR_CONTAINS(internal::FlatRangeBoxes({3, 2}, 4, 3), "outside a tensor of size [3, 2]");
}

// Net (tied weights, uneven shapes) wrapped with FSDP1, one unit per block, seeded values.
Net Fsdp1Net(const comm::ProcessGroupPtr& pg, uint64_t seed) {
  Net model(NetOptions{.tie = true});
  test_models::InitDeterministic(*model, seed);
  fsdp1::FSDPOptions options;
  options.process_group = pg;
  options.auto_wrap_policy = fsdp1::ModuleTypeWrapPolicy<test_models::BlockImpl>();
  fsdp1::wrap_fsdp(model.ptr(), options);
  return model;
}

Net Fsdp2Net(const comm::ProcessGroupPtr& pg, uint64_t seed) {
  Net model(NetOptions{.tie = true});
  test_models::InitDeterministic(*model, seed);
  auto mesh = mesh::DeviceMesh::Create(pg, {pg->size()});
  for (auto& b : model->layers) fsdp2::fully_shard(b.ptr(), {.mesh = mesh});
  fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
  return model;
}

fsdp1::FullStateDict Fsdp1Full(Net& model) {
  return fsdp1::GetFullStateDict(fsdp1::FullyShardedDataParallel(fsdp1::GetState(*model)));
}

void ExpectEqual(const checkpoint::TensorDict& got, const checkpoint::TensorDict& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& item : want) {
    ASSERT_NE(got.find(item.key()), nullptr) << what << ": " << item.key();
    EXPECT_TRUE(at::equal(got[item.key()], item.value())) << what << ": " << item.key();
  }
}

TEST(DcpFsdp1, ReshardsBetweenFsdp1AndFsdp2AndWorldSizes) {
  const std::string dir1 = Dir("from_fsdp1"), dir2 = Dir("from_fsdp2");
  checkpoint::TensorDict saved1, saved2;
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
    Net model = Fsdp1Net(pg, 21);
    const auto full = Fsdp1Full(model);
    if (pg->rank() == 0) saved1 = full;
    Save(*model, nullptr, dir1);
  });
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
    Net model = Fsdp2Net(pg, 22);
    const auto full = fsdp2::GetFullStateDict(*model);
    if (pg->rank() == 0) saved2 = full;
    Save(*model, nullptr, dir2);
  });
  // FSDP1 W=3 -> FSDP2 W=2; FSDP2 W=4 -> FSDP1 W=2; FSDP1 W=3 -> FSDP1 W=2 and W=4.
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Net fsdp2 = Fsdp2Net(pg, 1);
    Load(*fsdp2, nullptr, dir1);
    ExpectEqual(fsdp2::GetFullStateDict(*fsdp2), saved1, "FSDP1 W=3 -> FSDP2 W=2");
    Net fsdp1 = Fsdp1Net(pg, 2);
    Load(*fsdp1, nullptr, dir2);
    ExpectEqual(Fsdp1Full(fsdp1), saved2, "FSDP2 W=4 -> FSDP1 W=2");
    Net again = Fsdp1Net(pg, 3);
    Load(*again, nullptr, dir1);
    ExpectEqual(Fsdp1Full(again), saved1, "FSDP1 W=3 -> FSDP1 W=2");
  });
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
    Net fsdp1 = Fsdp1Net(pg, 4);
    Load(*fsdp1, nullptr, dir1);
    ExpectEqual(Fsdp1Full(fsdp1), saved1, "FSDP1 W=3 -> FSDP1 W=4");
  });
}

// Model + AdamW: 3 steps under one FSDP at one world size, save, load under the other FSDP
// at another world size, 3 more steps: equal (float tolerance) to 6 uninterrupted steps on
// one rank.
TEST(DcpFsdp1, TrainingContinuesAcrossFsdp1AndFsdp2WithAdamW) {
  Net reference(NetOptions{.tie = true});
  test_models::InitDeterministic(*reference, 31);
  torch::optim::AdamW ref_opt(test_models::UniqueParameters(*reference), torch::optim::AdamWOptions(1e-2));
  test_models::TrainSteps(reference, ref_opt, 0, 6, 1, 0);
  const auto want = reference->named_parameters();
  const auto check = [&](const checkpoint::TensorDict& got, const std::string& what) {
    for (const auto& item : want) {
      ASSERT_NE(got.find(item.key()), nullptr) << what << ": " << item.key();
      // Sliced vs whole-batch gradient sums through 6 AdamW steps: a few float32 ulps (2^-23) of a step
      // per step; 1e-5 relative (~80 ulps) and 1e-6 absolute, far below one step's lr.
      EXPECT_TRUE(at::allclose(got[item.key()], item.value(), 1e-5, 1e-6)) << what << ": " << item.key();
    }
  };
  // FSDP1 (use_orig_params false): the optimizer holds the flat parameters.
  const auto adamw = [](Net& m) {
    fsdp1::FSDPState* fsdp1 = fsdp1::GetState(*m);
    return torch::optim::AdamW(
        fsdp1 ? fsdp1::FullyShardedDataParallel(fsdp1).parameters() : test_models::UniqueParameters(*m),
        torch::optim::AdamWOptions(1e-2));
  };
  for (bool fsdp1_first : {true, false}) {
    const std::string dir = Dir(fsdp1_first ? "adamw_1to2" : "adamw_2to1");
    const int first_world = fsdp1_first ? 3 : 4, second_world = 2;
    fsdp::testing::RunOnRanks(Backend::kThreaded, first_world, [&](const comm::ProcessGroupPtr& pg) {
      Net model = fsdp1_first ? Fsdp1Net(pg, 31) : Fsdp2Net(pg, 31);
      auto opt = adamw(model);
      test_models::TrainSteps(model, opt, 0, 3, first_world, pg->rank());
      Save(*model, &opt, dir);
    });
    fsdp::testing::RunOnRanks(Backend::kThreaded, second_world, [&](const comm::ProcessGroupPtr& pg) {
      Net model = fsdp1_first ? Fsdp2Net(pg, 7) : Fsdp1Net(pg, 7);
      auto opt = adamw(model);
      Load(*model, &opt, dir);
      test_models::TrainSteps(model, opt, 3, 3, second_world, pg->rank());
      const auto full = fsdp1_first ? fsdp2::GetFullStateDict(*model) : Fsdp1Full(model);
      if (pg->rank() == 0) check(full, fsdp1_first ? "FSDP1 W=3 -> FSDP2 W=2" : "FSDP2 W=4 -> FSDP1 W=2");
    });
  }
}

TEST(DcpFsdp1, FullKindsAreRefusedClearly) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    Net model = Fsdp1Net(pg, 5);
    EXPECT_ERROR_CONTAINS(Save(*model, nullptr, Dir("full"), {.kind = StateDictKind::kFull}),
                          "full state dicts (kFull, kFullRank0) of FSDP1");
  });
}

}  // namespace
}  // namespace fsdp::dcp
