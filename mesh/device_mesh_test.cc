// DeviceMesh on real multi-rank backends: every group's membership is checked by reducing
// world ranks over it and comparing with a brute-force enumeration of the mesh.
#include "mesh/device_mesh.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <utility>

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

// World ranks on `me`'s line along `dims`, ordered row-major over `dims` in the given
// order (brute force: filter every rank, sort by its coordinates along `dims`).
std::vector<int> ExpectedLine(int me, const std::vector<int64_t>& shape, const std::vector<int>& dims) {
  int64_t world = 1;
  for (auto s : shape) world *= s;
  const auto mine = Coord(me, shape);
  std::vector<std::pair<std::vector<int64_t>, int>> members;
  for (int r = 0; r < world; ++r) {
    const auto c = Coord(r, shape);
    bool same_line = true;
    std::vector<int64_t> key;
    for (int d : dims) key.push_back(c[d]);
    for (size_t d = 0; d < shape.size(); ++d) {
      const bool free = std::find(dims.begin(), dims.end(), static_cast<int>(d)) != dims.end();
      if (!free && c[d] != mine[d]) same_line = false;
    }
    if (same_line) members.emplace_back(key, r);
  }
  std::sort(members.begin(), members.end());
  std::vector<int> ranks;
  for (const auto& [key, r] : members) ranks.push_back(r);
  return ranks;
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

INSTANTIATE_TEST_SUITE_P(Shapes, MeshShapes,
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
    EXPECT_TRUE(absl::StrContains(mesh->ToString(), "dp_replicate=2, dp_shard=2, tp=2")) << mesh->ToString();
  });
}

class MeshBackends : public ::testing::TestWithParam<Backend> {};

// HSDP's dp = dp_replicate x dp_shard, flattened from the 2-D slice each rank holds: every
// rank must get the group of its own slice line although it only sees that line.
TEST_P(MeshBackends, FlattenOfASliceGroupsEachSliceLine) {
  fsdp::testing::RunOnRanks(GetParam(), 8, [](const comm::ProcessGroupPtr& pg) {
    const std::vector<int64_t> shape = {2, 2, 2};
    auto mesh = DeviceMesh::Create(pg, shape, {"dp_replicate", "dp_shard", "tp"});
    const int me = pg->rank();
    const auto c = Coord(me, shape);
    auto hsdp = mesh->slice({"dp_replicate", "dp_shard"});
    auto dp = hsdp->flatten({"dp_replicate", "dp_shard"}, "dp");
    EXPECT_EQ(dp->shape(), (std::vector<int64_t>{4}));
    EXPECT_EQ(dp->dim_names(), (std::vector<std::string>{"dp"}));
    EXPECT_EQ(dp->ranks(), ExpectedLine(me, shape, {0, 1}));
    EXPECT_EQ(dp->coordinate(), (std::vector<int64_t>{c[0] * 2 + c[1]}));
    ASSERT_NE(dp->group(0), nullptr);
    EXPECT_EQ(dp->group(0)->size(), 4);
    EXPECT_EQ(dp->group(0)->rank(), dp->coordinate()[0]);
    EXPECT_EQ(SumOverGroup(dp->group(0), me), ExpectedSum(me, shape, {0, 1}));

    // Root dimensions that are not adjacent in the root.
    auto rep_tp = mesh->slice({"dp_replicate", "tp"})->flatten({"dp_replicate", "tp"}, "rep_tp");
    EXPECT_EQ(rep_tp->ranks(), ExpectedLine(me, shape, {0, 2}));
    EXPECT_EQ(rep_tp->coordinate(), (std::vector<int64_t>{c[0] * 2 + c[2]}));
    EXPECT_EQ(rep_tp->group(0)->rank(), rep_tp->coordinate()[0]);
    EXPECT_EQ(SumOverGroup(rep_tp->group(0), me), ExpectedSum(me, shape, {0, 2}));

    // The same root dimensions again, from any mesh of the root and under any name: the
    // cached group, no new one.
    EXPECT_EQ(hsdp->flatten({"dp_replicate", "dp_shard"}, "dp")->group(0), dp->group(0));
    EXPECT_EQ(mesh->flatten({"dp_replicate", "dp_shard"}, "fsdp")->group(0), dp->group(0));
    EXPECT_EQ(dp->flatten({"dp"}, "dp2")->group(0), dp->group(0));

    // A flattened dimension flattens further: (dp, tp) spans the world, whose group is reused.
    auto all = Concatenate({dp, (*mesh)["tp"]})->flatten({"dp", "tp"}, "all");
    EXPECT_EQ(all->group(0), mesh->world());
    EXPECT_EQ(all->ranks(), ExpectedLine(me, shape, {0, 1, 2}));
    EXPECT_EQ(all->coordinate(), (std::vector<int64_t>{me}));
  });
}

// FSDP2 + TP rebuilds its (dp, tp) mesh from the two 1-D slices.
TEST_P(MeshBackends, ConcatenateRebuildsTheRootLayout) {
  fsdp::testing::RunOnRanks(GetParam(), 4, [](const comm::ProcessGroupPtr& pg) {
    const std::vector<int64_t> shape = {2, 2};
    auto mesh = DeviceMesh::Create(pg, shape, {"dp", "tp"});
    const int me = pg->rank();
    auto dp = (*mesh)["dp"];
    auto tp = (*mesh)["tp"];
    auto again = Concatenate({dp, tp});
    EXPECT_EQ(again->shape(), mesh->shape());
    EXPECT_EQ(again->dim_names(), mesh->dim_names());
    EXPECT_EQ(again->ranks(), mesh->ranks());
    EXPECT_EQ(again->coordinate(), mesh->coordinate());
    EXPECT_EQ(again->group(0), mesh->group(0));
    EXPECT_EQ(again->group(1), mesh->group(1));
    EXPECT_EQ(again->ToString(), mesh->ToString());
    CheckEveryDimGroup(again, shape);

    // The other order is the transposed mesh: ranks row-major over (tp, dp).
    auto swapped = Concatenate({tp, dp});
    EXPECT_EQ(swapped->dim_names(), (std::vector<std::string>{"tp", "dp"}));
    EXPECT_EQ(swapped->ranks(), ExpectedLine(me, shape, {1, 0}));
    EXPECT_EQ(swapped->ranks(), (std::vector<int>{0, 2, 1, 3}));
    EXPECT_EQ(swapped->coordinate(), (std::vector<int64_t>{me % 2, me / 2}));
    EXPECT_EQ(swapped->group("tp"), mesh->group("tp"));
    EXPECT_EQ(swapped->group("dp"), mesh->group("dp"));
  });
}

// HSDP + TP: the flattened dp stays one dimension of the concatenation.
TEST_P(MeshBackends, ConcatenateAFlattenedDimension) {
  fsdp::testing::RunOnRanks(GetParam(), 8, [](const comm::ProcessGroupPtr& pg) {
    const std::vector<int64_t> shape = {2, 2, 2};
    auto mesh = DeviceMesh::Create(pg, shape, {"dp_replicate", "dp_shard", "tp"});
    const int me = pg->rank();
    const auto c = Coord(me, shape);
    auto dp = mesh->slice({"dp_replicate", "dp_shard"})->flatten({"dp_replicate", "dp_shard"}, "dp");
    auto dp_tp = Concatenate({dp, (*mesh)["tp"]});
    EXPECT_EQ(dp_tp->shape(), (std::vector<int64_t>{4, 2}));
    EXPECT_EQ(dp_tp->dim_names(), (std::vector<std::string>{"dp", "tp"}));
    EXPECT_EQ(dp_tp->ranks(), ExpectedLine(me, shape, {0, 1, 2}));
    EXPECT_EQ(dp_tp->group(0), dp->group(0));
    EXPECT_EQ(dp_tp->group(1), mesh->group("tp"));
    CheckEveryDimGroup(dp_tp, {4, 2});

    // A concatenation inside my replica, out of root order: (tp, dp_shard).
    auto tp_shard = Concatenate({(*mesh)["tp"], (*mesh)["dp_shard"]});
    EXPECT_EQ(tp_shard->shape(), (std::vector<int64_t>{2, 2}));
    EXPECT_EQ(tp_shard->ranks(), ExpectedLine(me, shape, {2, 1}));
    EXPECT_EQ(tp_shard->coordinate(), (std::vector<int64_t>{c[2], c[1]}));
    EXPECT_EQ(SumOverGroup(tp_shard->group(0), me), ExpectedSum(me, shape, {2}));
    EXPECT_EQ(SumOverGroup(tp_shard->group(1), me), ExpectedSum(me, shape, {1}));
  });
}

INSTANTIATE_TEST_SUITE_P(Backends, MeshBackends, ::testing::Values(Backend::kThreaded, Backend::kGlooThreads),
                         [](const auto& info) { return fsdp::testing::BackendName(info.param); });

TEST(DeviceMesh, ConcatenateAndFlattenBadInput) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 8, [](const comm::ProcessGroupPtr& pg) {
    auto mesh = DeviceMesh::Create(pg, {2, 2, 2}, {"dp_replicate", "dp_shard", "tp"});
    auto other = DeviceMesh::Create(pg, {4, 2}, {"dp", "tp"});
    auto dp = mesh->slice({"dp_replicate", "dp_shard"})->flatten({"dp_replicate", "dp_shard"}, "dp");
    EXPECT_ERROR_CONTAINS((Concatenate({(*mesh)["dp_shard"], (*other)["tp"]})),
                          "come from different root meshes; only meshes derived from one "
                          "DeviceMesh::Create can be concatenated");
    EXPECT_ERROR_CONTAINS((Concatenate({(*mesh)["dp_shard"], (*other)["tp"]})), "and 1 (DeviceMesh((tp=2)");
    EXPECT_ERROR_CONTAINS((Concatenate({(*mesh)["tp"], (*mesh)["tp"]})),
                          "meshes 0 and 1 overlap: both span root dimension tp");
    EXPECT_ERROR_CONTAINS((Concatenate({(*mesh)["tp"], dp, (*mesh)["dp_shard"]})),
                          "meshes 1 and 2 overlap: both span root dimension dp_shard");
    EXPECT_ERROR_CONTAINS((Concatenate({mesh->flatten({"tp"}, "dp"), dp})),
                          "dimension name 'dp' appears twice in [dp, dp]");
    EXPECT_ERROR_CONTAINS((Concatenate({})), "needs at least one mesh");
    EXPECT_ERROR_CONTAINS((Concatenate({dp, DeviceMeshPtr()})), "mesh 1 is null");
    auto swapped = Concatenate({(*mesh)["tp"], (*mesh)["dp_shard"]});
    EXPECT_ERROR_CONTAINS((swapped->flatten({"tp", "dp_shard"}, "x")),
                          "span root dimensions [tp, dp_shard], out of the root mesh's order");
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
    // PyTorch 2.15 refuses names out of mesh order: KeyError "Invalid mesh_dim_names ('tp',
    // 'dp') specified. Mesh dim indices should be in ascending order."
    EXPECT_ERROR_CONTAINS((mesh->slice({"tp", "dp"})),
                          "invalid mesh_dim_names [tp, dp] specified; mesh dim indices should be in ascending order");
  });
}

}  // namespace
}  // namespace fsdp::mesh
