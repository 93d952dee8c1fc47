// DeviceMesh on real multi-rank backends: every group's membership is checked by reducing
// world ranks over it and comparing with a brute-force enumeration of the mesh.
#include "mesh/device_mesh.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <functional>

#include "absl/strings/match.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::mesh {
namespace {

using fsdp::testing::Backend;


// Coordinate of world rank r in a row-major mesh, by repeated division.
std::vector<int64_t> Coord(int64_t r, const std::vector<int64_t>& shape) {
  std::vector<int64_t> c(shape.size());
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    c[d] = r % shape[d];
    r /= shape[d];
  }
  return c;
}

// Sum of world ranks whose coordinates equal `me`'s outside `dims` (brute force).
int64_t ExpectedSum(int me, const std::vector<int64_t>& shape, const std::vector<int>& dims) {
  int64_t world = 1;
  for (auto s : shape) world *= s;
  const auto mine = Coord(me, shape);
  int64_t sum = 0;
  for (int r = 0; r < world; ++r) {
    const auto c = Coord(r, shape);
    bool same_line = true;
    for (size_t d = 0; d < shape.size(); ++d) {
      const bool free = std::find(dims.begin(), dims.end(), static_cast<int>(d)) != dims.end();
      if (!free && c[d] != mine[d]) same_line = false;
    }
    if (same_line) sum += r;
  }
  return sum;
}

int64_t SumOverGroup(const comm::ProcessGroupPtr& group, int world_rank) {
  at::Tensor t = at::full({1}, world_rank, at::kLong);
  group->all_reduce(t)->wait();
  return t.item<int64_t>();
}

void CheckEveryDimGroup(const DeviceMeshPtr& mesh, const std::vector<int64_t>& shape) {
  const int me = mesh->world_rank();
  EXPECT_EQ(mesh->coordinate(), Coord(me, shape));
  for (int d = 0; d < mesh->ndim(); ++d) {
    ASSERT_NE(mesh->group(d), nullptr);
    EXPECT_EQ(mesh->group(d)->size(), shape[d]);
    EXPECT_EQ(mesh->group(d)->rank(), mesh->coordinate()[d]);
    EXPECT_EQ(SumOverGroup(mesh->group(d), me), ExpectedSum(me, shape, {d})) << "dim " << d;
  }
}

class MeshShapes : public ::testing::TestWithParam<std::tuple<Backend, std::vector<int64_t>>> {};

TEST_P(MeshShapes, GroupsAreTheLinesOfTheMesh) {
  const auto [backend, shape] = GetParam();
  int64_t world = 1;
  for (auto s : shape) world *= s;
  fsdp::testing::RunOnRanks(backend, static_cast<int>(world), [shape = shape](const comm::ProcessGroupPtr& pg) {
    auto mesh = DeviceMesh::Create(pg, shape);
    EXPECT_EQ(mesh->ndim(), static_cast<int>(shape.size()));
    EXPECT_EQ(mesh->size(), pg->size());
    CheckEveryDimGroup(mesh, shape);
  });
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MeshShapes,
    ::testing::Values(std::make_tuple(Backend::kThreaded, std::vector<int64_t>{4}),
                      std::make_tuple(Backend::kThreaded, std::vector<int64_t>{2, 3}),
                      std::make_tuple(Backend::kThreaded, std::vector<int64_t>{2, 2, 2}),
                      std::make_tuple(Backend::kThreaded, std::vector<int64_t>{2, 1, 2, 2}),
                      std::make_tuple(Backend::kThreaded, std::vector<int64_t>{1}),
                      std::make_tuple(Backend::kGlooThreads, std::vector<int64_t>{2, 2}),
                      std::make_tuple(Backend::kGlooProcesses, std::vector<int64_t>{2, 2})));

TEST(DeviceMesh, NamedSlicingFlattenAndConcatenation) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 8, [](const comm::ProcessGroupPtr& pg) {
    const std::vector<int64_t> shape = {2, 2, 2};
    auto mesh = DeviceMesh::Create(pg, shape, {"dp_replicate", "dp_shard", "tp"});
    const int me = pg->rank();
    EXPECT_EQ(mesh->dim_index("tp"), 2);

    auto shard = (*mesh)["dp_shard"];
    EXPECT_EQ(shard->ndim(), 1);
    EXPECT_EQ(shard->group(0), mesh->group("dp_shard"));
    EXPECT_EQ(shard->ranks().size(), 2u);

    // HSDP's 2-D slice keeps both groups.
    auto hsdp = mesh->slice({"dp_replicate", "dp_shard"});
    EXPECT_EQ(hsdp->shape(), (std::vector<int64_t>{2, 2}));
    EXPECT_EQ(hsdp->group("dp_replicate"), mesh->group(0));
    EXPECT_EQ(hsdp->ranks().size(), 4u);
    for (int r : hsdp->ranks()) EXPECT_EQ(r % 2, me % 2) << "slice must keep my tp coordinate";

    // Flattened dp = dp_replicate x dp_shard: 4 ranks sharing my tp coordinate.
    auto dp = mesh->flatten({"dp_replicate", "dp_shard"}, "dp");
    EXPECT_EQ(dp->shape(), (std::vector<int64_t>{4}));
    EXPECT_EQ(dp->dim_names(), (std::vector<std::string>{"dp"}));
    EXPECT_EQ(SumOverGroup(dp->group(0), me), ExpectedSum(me, shape, {0, 1}));
    EXPECT_EQ(dp->group(0)->rank(), me / 2);

    // FSDP2's TP path concatenates the DP and TP dimensions of one root mesh.
    auto dp_tp = mesh->slice({"dp_shard", "tp"});
    EXPECT_EQ(dp_tp->group("tp"), mesh->group("tp"));
    EXPECT_TRUE(absl::StrContains(mesh->ToString(), "dp_replicate=2, dp_shard=2, tp=2"))
        << mesh->ToString();
  });
}

TEST(DeviceMesh, BadInput) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [](const comm::ProcessGroupPtr& pg) {
    EXPECT_ERROR_CONTAINS((DeviceMesh::Create(pg, {3, 2})),
                          "mesh shape [3, 2] holds 6 ranks but the world group has 4");
    EXPECT_ERROR_CONTAINS((DeviceMesh::Create(pg, {4, 0})), "shape[1] must be >= 1, got 0");
    EXPECT_ERROR_CONTAINS((DeviceMesh::Create(pg, {2, 2}, {"dp"})), "dim_names has 1 names for 2 dimensions");
    EXPECT_ERROR_CONTAINS((DeviceMesh::Create(pg, {2, 2}, {"dp", "dp"})), "dim name 'dp' is repeated");
    auto mesh = DeviceMesh::Create(pg, {2, 2}, {"dp", "tp"});
    EXPECT_ERROR_CONTAINS((*mesh)["pp"], "no dimension named 'pp'; the mesh has [dp, tp]");
    EXPECT_ERROR_CONTAINS(mesh->group(2), "dim must be in [0, 2), got 2");
    EXPECT_ERROR_CONTAINS((mesh->flatten({"tp", "dp"}, "x")), "must be adjacent and in mesh order");
    EXPECT_ERROR_CONTAINS((mesh->slice({"dp", "dp"})), "dimension 'dp' named twice");
  });
}

}  // namespace
}  // namespace fsdp::mesh
