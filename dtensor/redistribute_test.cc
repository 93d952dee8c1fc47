// DTensor round trips, every placement pair on every mesh dimension, the planner's printout,
// gradients through DTensor vs plain autograd, and bad input. Expected values are the
// original global tensor, torch.chunk of it, or plain autograd on the global tensor.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "dtensor/dtensor.h"
#include "dtensor/redistribute.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::dtensor {
namespace {

using fsdp::testing::Backend;
using P = Placement;

struct MeshCase {
  Backend backend;
  std::vector<int64_t> shape;
};

std::string CaseName(const ::testing::TestParamInfo<MeshCase>& info) {
  std::string name = fsdp::testing::BackendName(info.param.backend);
  for (int64_t s : info.param.shape) absl::StrAppend(&name, "_", s);
  return name;
}

int64_t WorldOf(const std::vector<int64_t>& shape) {
  int64_t w = 1;
  for (int64_t s : shape) w *= s;
  return w;
}

// Integer-valued data so that sums of Partial terms are exact in f32.
at::Tensor GlobalTensor(const std::vector<int64_t>& shape, at::ScalarType dtype, int seed) {
  return (at::arange(WorldOf(shape), at::kLong).view(shape) * 7 + seed).remainder(23).to(dtype);
}

// Ranks are threads: each draws from its own generator so all ranks see the same data.
at::Tensor Randn(at::IntArrayRef shape, uint64_t seed) {
  return at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed), at::kDouble);
}

// A DTensor of `global` with `placements`: shards/replicas from distribute_tensor, then each
// Partial mesh dim splits the values into integer terms (3 on every rank but coordinate 0).
DTensor MakeSource(const at::Tensor& global, const mesh::DeviceMeshPtr& mesh, const Placements& placements) {
  Placements no_partial = placements;
  for (auto& p : no_partial) {
    if (p.is_partial()) p = P::Replicate();
  }
  at::Tensor local = distribute_tensor(global, mesh, no_partial).to_local();
  for (int m = 0; m < mesh->ndim(); ++m) {
    if (!placements[m].is_partial()) continue;
    const int64_t n = mesh->size(m);
    local = mesh->coordinate()[m] == 0 ? local - 3 * (n - 1) : at::full_like(local, 3);
  }
  return DTensor::from_local(local, mesh, placements, global.sizes().vec());
}

std::vector<Placements> AllPlacementTuples(int ndim) {
  const std::vector<P> single = {P::Shard(0), P::Shard(1), P::Replicate(), P::Partial(), P::StridedShard(0, 2)};
  std::vector<Placements> tuples = {{}};
  for (int m = 0; m < ndim; ++m) {
    std::vector<Placements> next;
    for (const auto& t : tuples) {
      for (const P& p : single) {
        Placements longer = t;
        longer.push_back(p);
        next.push_back(longer);
      }
    }
    tuples = std::move(next);
  }
  return tuples;
}

class RedistributeTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(RedistributeTest, DistributeThenFullTensorIsBitwiseAndLocalIsTorchChunk) {
  const MeshCase c = GetParam();
  fsdp::testing::RunOnRanks(c.backend, static_cast<int>(WorldOf(c.shape)), [c](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, c.shape);
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kDouble, at::kLong}) {
      // Every rank passes different data: src_data_rank 0 must make rank 0's the truth.
      const at::Tensor truth = Randn({5, 3}, 0).to(dtype);
      const at::Tensor mine = pg->rank() == 0 ? truth : truth + 1;
      const DTensor d = distribute_tensor(mine, mesh, Placements(mesh->ndim(), P::Shard(0)));
      EXPECT_TRUE(at::equal(d.full_tensor(), truth));
      // Local = torch.chunk applied mesh dim by mesh dim (row-major coordinates).
      at::Tensor expected = truth;
      for (int m = 0; m < mesh->ndim(); ++m) {
        const auto chunks = expected.chunk(mesh->size(m), 0);
        const int64_t i = mesh->coordinate()[m];
        expected = i < static_cast<int64_t>(chunks.size()) ? chunks[i] : expected.narrow(0, 0, 0);
      }
      EXPECT_TRUE(at::equal(d.to_local(), expected));
    }
  });
}

TEST_P(RedistributeTest, EveryPlacementPairPreservesTheGlobalTensor) {
  const MeshCase c = GetParam();
  fsdp::testing::RunOnRanks(c.backend, static_cast<int>(WorldOf(c.shape)), [c](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, c.shape);
    const auto tuples = AllPlacementTuples(mesh->ndim());
    for (const std::vector<int64_t>& shape : {std::vector<int64_t>{5, 3}, std::vector<int64_t>{1, 7}}) {
      // Gloo runs f32 only: the dtype paths are the same code, already covered on Threaded.
      std::vector<at::ScalarType> dtypes = {at::kFloat};
      if (c.backend == Backend::kThreaded) dtypes.push_back(at::kLong);
      for (auto dtype : dtypes) {
        const at::Tensor global = GlobalTensor(shape, dtype, 1);
        for (const Placements& src : tuples) {
          const DTensor from = MakeSource(global, mesh, src);
          ASSERT_TRUE(at::equal(from.full_tensor(), global)) << ToString(src);
          for (const Placements& dst : tuples) {
            const std::string what =
                absl::StrCat(ToString(src), " -> ", ToString(dst), " shape [", shape[0], ", ", shape[1], "]");
            // PyTorch 2.15 makes a Partial only out of a plain Shard (and refuses the rest).
            bool refused = false;
            for (size_t m = 0; m < dst.size(); ++m) {
              refused |= dst[m].is_partial() && src[m] != dst[m] && src[m].kind() != dtensor::PlacementKind::kShard;
            }
            if (refused) {
              EXPECT_ERROR_CONTAINS(from.redistribute(dst), "only Shard to Partial(sum) redistribution is supported");
              continue;
            }
            const DTensor to = from.redistribute(dst);
            ASSERT_EQ(to.to_local().sizes().vec(), to.spec().local_shape()) << what;
            ASSERT_TRUE(at::equal(to.full_tensor(), global)) << what;
            if (!to.spec().has_partial()) {
              ASSERT_TRUE(at::equal(to.to_local(), distribute_tensor(global, mesh, dst).to_local())) << what;
            }
          }
        }
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, RedistributeTest,
                         ::testing::Values(MeshCase{Backend::kThreaded, {1}}, MeshCase{Backend::kThreaded, {2}},
                                           MeshCase{Backend::kThreaded, {3}}, MeshCase{Backend::kThreaded, {4}},
                                           MeshCase{Backend::kThreaded, {2, 2}}, MeshCase{Backend::kThreaded, {1, 4}},
                                           MeshCase{Backend::kThreaded, {4, 1}}, MeshCase{Backend::kGlooThreads, {1}},
                                           MeshCase{Backend::kGlooThreads, {2}}, MeshCase{Backend::kGlooThreads, {3}},
                                           MeshCase{Backend::kGlooThreads, {4}},
                                           MeshCase{Backend::kGlooThreads, {2, 2}},
                                           MeshCase{Backend::kGlooThreads, {1, 4}},
                                           MeshCase{Backend::kGlooThreads, {4, 1}}),
                         CaseName);

TEST(RedistributePlan, PrintsStepsInnerMeshDimFirstWithBytes) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2, 2}, {"dp", "tp"});
    const DTensorSpec spec = DTensorSpec::Make(mesh, {P::Shard(0), P::Shard(0)}, {10, 3}, at::kFloat);
    const auto plan = PlanRedistribute(spec, {P::Replicate(), P::Replicate()});
    ASSERT_EQ(plan->steps.size(), 2u);
    // 10 rows: dp halves to 5, tp cuts 5 into 3 + 2, gathered padded to 2 * 3 rows of 3 floats.
    EXPECT_EQ(plan->steps[0].mesh_dim, 1);
    EXPECT_EQ(plan->steps[0].bytes, 2 * 3 * 3 * 4);
    EXPECT_EQ(plan->steps[1].bytes, 2 * 5 * 3 * 4);
    const std::string text = plan->ToString(*mesh);
    EXPECT_TRUE(absl::StrContains(
        text, "mesh dim 1 (tp): Shard(dim=0) -> Replicate(): all_gather over 2 ranks, logical [5, 3], 72 B"))
        << text;
    EXPECT_TRUE(absl::StrContains(text, "mesh dim 0 (dp): Shard(dim=0) -> Replicate(): all_gather")) << text;
    // Cached: the same object comes back.
    EXPECT_EQ(PlanRedistribute(spec, {P::Replicate(), P::Replicate()}).get(), plan.get());
    // Partial -> Shard is one reduce-scatter; Shard(0) -> Shard(1) one all-to-all.
    const auto rs =
        PlanRedistribute(spec.WithPlacements({P::Partial(), P::Replicate()}), {P::Shard(0), P::Replicate()});
    ASSERT_EQ(rs->steps.size(), 1u);
    EXPECT_EQ(rs->steps[0].kind, TransformKind::kReduceScatter);
    const auto a2a =
        PlanRedistribute(spec.WithPlacements({P::Shard(0), P::Replicate()}), {P::Shard(1), P::Replicate()});
    ASSERT_EQ(a2a->steps.size(), 1u);
    EXPECT_EQ(a2a->steps[0].kind, TransformKind::kAllToAll);
    EXPECT_TRUE(absl::StrContains(PlanRedistribute(spec, spec.placements)->ToString(*mesh), "no-op"));
  });
}

// loss = sum(tanh(x) * weight): d loss / d x = (1 - tanh(x)^2) * weight.
at::Tensor Loss(const at::Tensor& x, const at::Tensor& weight) { return (at::tanh(x) * weight).sum(); }

at::Tensor ReferenceGrad(const at::Tensor& global, const at::Tensor& weight) {
  at::Tensor x = global.clone().requires_grad_(true);
  Loss(x, weight).backward();
  return x.grad();
}

at::Tensor Chunk(const at::Tensor& t, int64_t pieces, int64_t index, int64_t dim) {
  const auto chunks = t.chunk(pieces, dim);
  return index < static_cast<int64_t>(chunks.size()) ? chunks[index] : t.narrow(dim, 0, 0);
}

TEST(DTensorAutograd, GradientsMatchPlainAutogradOnTheGlobalTensor) {
  for (int world : {2, 3, 4}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, world, [world](const comm::ProcessGroupPtr& pg) {
      auto mesh = mesh::DeviceMesh::Create(pg, {world});
      const int64_t me = pg->rank();
      const at::Tensor global = Randn({5, 3}, 3);
      const at::Tensor weight = Randn({5, 3}, 4);
      const at::Tensor expected = ReferenceGrad(global, weight);

      // Shard -> Replicate: every rank computes the whole (same) loss.
      DTensor sharded = distribute_tensor(global.clone().requires_grad_(true), mesh, {P::Shard(0)});
      EXPECT_TRUE(sharded.to_local().is_leaf());
      Loss(sharded.redistribute({P::Replicate()}).to_local(), weight).backward();
      EXPECT_TRUE(at::allclose(sharded.to_local().grad(), Chunk(expected, world, me, 0)));

      // Replicate -> Shard: each rank computes its part of the loss.
      at::Tensor replica = global.clone().requires_grad_(true);
      DTensor rep = DTensor::from_local(replica, mesh, {P::Replicate()});
      Loss(rep.redistribute({P::Shard(0)}).to_local(), Chunk(weight, world, me, 0)).backward();
      EXPECT_TRUE(at::allclose(replica.grad(), expected));

      // Partial -> Replicate: each partial term gets the whole gradient.
      at::Tensor term = (me == 0 ? global - (world - 1) : at::ones_like(global)).requires_grad_(true);
      Loss(DTensor::from_local(term, mesh, {P::Partial()}).full_tensor(), weight).backward();
      EXPECT_TRUE(at::allclose(term.grad(), expected));

      // Shard(0) -> Shard(1): all-to-all forward and backward.
      DTensor rows = distribute_tensor(global.clone().requires_grad_(true), mesh, {P::Shard(0)});
      Loss(rows.redistribute({P::Shard(1)}).to_local(), Chunk(weight, world, me, 1)).backward();
      EXPECT_TRUE(at::allclose(rows.to_local().grad(), Chunk(expected, world, me, 0)));
    });
  }
}

// The PyTorch 2.15 examples (values and counts printed by PyTorch 2.15 with
// CommDebugMode on a 2 x 2 x 2 mesh; the golden corpus in dtensor/testdata covers the rest).
std::vector<std::string> CollectiveKinds(const RedistributePlan& plan) {
  std::vector<std::string> kinds;
  for (const TransformStep& s : plan.steps) {
    if (s.kind != TransformKind::kLocalChunk && s.kind != TransformKind::kLocalPartition &&
        s.kind != TransformKind::kLocalZeroFill) {
      kinds.push_back(TransformKindName(s.kind));
    }
  }
  return kinds;
}

TEST(PyTorchConformance, ThreeDimensionalMeshRedistributes) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 8, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2, 2, 2});
    const at::Tensor global = GlobalTensor({6, 5, 7}, at::kFloat, 2);
    struct Case {
      Placements src, dst;
      std::vector<std::string> collectives;
    };
    const std::vector<Case> cases = {
        {{P::Shard(0), P::Shard(0), P::Shard(0)},
         {P::Shard(1), P::Shard(1), P::Shard(1)},
         {"all_gather", "all_gather", "all_to_all"}},
        {{P::Shard(0), P::Shard(1), P::Shard(0)},
         {P::Shard(1), P::Shard(0), P::Shard(0)},
         {"all_gather", "all_gather", "all_to_all"}},
        {{P::Shard(0), P::Shard(1), P::Shard(2)},
         {P::Shard(2), P::Shard(1), P::Shard(0)},
         {"all_gather", "all_to_all"}},
    };
    for (const Case& c : cases) {
      const std::string what = absl::StrCat(ToString(c.src), " -> ", ToString(c.dst));
      const DTensor from = distribute_tensor(global, mesh, c.src);
      EXPECT_EQ(CollectiveKinds(*PlanRedistribute(from.spec(), c.dst)), c.collectives) << what;
      const DTensor to = from.redistribute(c.dst);
      EXPECT_TRUE(at::equal(to.to_local(), distribute_tensor(global, mesh, c.dst).to_local())) << what;
      EXPECT_TRUE(at::equal(to.full_tensor(), global)) << what;
    }
  });
}

TEST(PyTorchConformance, ShardToPartialSumIsLocalAndPartialRefusals) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {4});
    const at::Tensor global = GlobalTensor({6, 3}, at::kFloat, 1);
    const DTensor sharded = distribute_tensor(global, mesh, {P::Shard(0)});
    const auto plan = PlanRedistribute(sharded.spec(), {P::Partial()});
    EXPECT_TRUE(CollectiveKinds(*plan).empty()) << plan->ToString(*mesh);
    const DTensor partial = sharded.redistribute({P::Partial()});
    // Zero-filled: this rank's rows in place, zeros elsewhere; the sum is the tensor.
    const at::Tensor mine = Chunk(global, 4, pg->rank(), 0);
    at::Tensor expected = at::zeros_like(global);
    if (mine.size(0) > 0) expected.narrow(0, 2 * pg->rank(), mine.size(0)).copy_(mine);
    EXPECT_TRUE(at::equal(partial.to_local(), expected));
    EXPECT_TRUE(at::equal(partial.full_tensor(), global));
    const DTensor replicated = distribute_tensor(global, mesh, {P::Replicate()});
    EXPECT_ERROR_CONTAINS(replicated.redistribute({P::Partial()}),
                          "can not redistribute from Replicate() to Partial(SUM) on mesh dim 0; only Shard to "
                          "Partial(sum) redistribution is supported");
    EXPECT_ERROR_CONTAINS(partial.redistribute({P::Partial(comm::ReduceOp::Avg())}),
                          "can not redistribute from Partial(SUM) to Partial(AVG)");
    EXPECT_ERROR_CONTAINS(sharded.redistribute({P::Partial(comm::ReduceOp::Max())}),
                          "can not redistribute from Shard(dim=0) to Partial(MAX)");
  });
}

TEST(PyTorchConformance, FromLocalInfersTheGlobalStrideFromTheLocalLayout) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {4});
    // A permuted local (8, 4, 8) with strides (8, 1, 32); PyTorch 2.15's from_local gives
    // S(0): (8, 1, 128), S(1): (32, 1, 128), S(2): (8, 1, 32), Replicate: (8, 1, 32).
    const at::Tensor local = at::empty_strided({8, 4, 8}, {8, 1, 32});
    const std::vector<std::pair<P, std::vector<int64_t>>> expected = {{P::Shard(0), {8, 1, 128}},
                                                                      {P::Shard(1), {32, 1, 128}},
                                                                      {P::Shard(2), {8, 1, 32}},
                                                                      {P::Replicate(), {8, 1, 32}}};
    for (const auto& [placement, stride] : expected) {
      EXPECT_EQ(DTensor::from_local(local, mesh, {placement}).spec().stride, stride) << placement.ToString();
    }
  });
}

TEST(DTensorErrors, BadInputIsNamed) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = mesh::DeviceMesh::Create(pg, {2}, {"dp"});
    const at::Tensor t = at::ones({4, 3});
    EXPECT_ERROR_CONTAINS(
        distribute_tensor(t, mesh, {P::Shard(2)}),
        "distribute_tensor: shard dim 2 of placement 0 (Shard(dim=2)) is out of range for a 2-D tensor");
    EXPECT_ERROR_CONTAINS(DTensor::from_local(t, mesh, {P::Shard(0), P::Replicate()}),
                          "got 2 placements (Shard(dim=0), Replicate()) for a 1-D mesh");
    EXPECT_ERROR_CONTAINS(DTensor::from_local(at::ones({3, 3}), mesh, {P::Shard(0)}, std::vector<int64_t>{4, 3}),
                          "local tensor of shape [3, 3] does not match the spec: global shape [4, 3]");
    EXPECT_ERROR_CONTAINS(distribute_tensor(t, mesh, {P::Partial()}), "Partial cannot be distributed");
    EXPECT_ERROR_CONTAINS(distribute_tensor(t, mesh, {P::Replicate()}, 5), "src_data_rank 5 is not a rank");
    EXPECT_ERROR_CONTAINS((*mesh)["tp"], "no dimension named 'tp'");
    EXPECT_ERROR_CONTAINS(mesh::DeviceMesh::Create(pg, {3}), "holds 3 ranks but the world group has 2");
    auto other = mesh::DeviceMesh::Create(pg, {1, 2});
    const DTensor d = distribute_tensor(t, mesh, {P::Shard(0)});
    EXPECT_ERROR_CONTAINS(d.redistribute(other, {P::Replicate(), P::Replicate()}),
                          "cannot redistribute across different meshes");
    EXPECT_ERROR_CONTAINS(d.redistribute({P::Shard(0), P::Shard(1)}), "for a 1-D mesh");
  });
}

}  // namespace
}  // namespace fsdp::dtensor
