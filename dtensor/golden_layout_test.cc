// DTensor layouts against real PyTorch 2.15 (dtensor/testdata/golden_layouts.txt, written by
// testing/golden/gen_dtensor.py: the layout math of torch/distributed/tensor/_utils.py and
// placement_types.py). One test per corpus case, named for its record line, e.g.
// --gtest_filter='Corpus/DTensorGoldenLayout.MatchesPyTorch/2x2_8x8_S0sf2_S0' (the line
// `layout 2,2 8,8 _S(0,2) S(0)`). A case's mismatches are counted per category
// (testing/golden_file.h), the first examples of each printed, and any mismatch fails it
// (zero tolerance: the data are integers).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/fake_process_group.h"
#include "dtensor/dtensor.h"
#include "dtensor/dtensor_spec.h"
#include "dtensor/golden_test_common.h"

namespace fsdp::dtensor {
namespace {

// ------------------------------------------------------------------ layouts

struct LayoutAt {
  Ints coord, shape, offset;
  std::vector<double> values;
};
struct LayoutCase {
  std::string torch;  // the PyTorch that wrote the file
  std::string line;
  Ints mesh, shape;
  Placements placements;
  std::vector<LayoutAt> at;
};

std::vector<LayoutCase> ReadLayouts(std::string* torch) {
  std::vector<LayoutCase> cases;
  for (const std::string& line : ReadRecords(GoldenPath("golden_layouts.txt"), torch)) {
    const auto t = Tokens(line);
    if (t[0] == "layout") {
      LayoutCase c{*torch, line, ParseInts(t.at(1)), ParseInts(t.at(2)), {}, {}};
      c.placements = ParsePlacements(t, 3, c.mesh.size());
      cases.push_back(std::move(c));
    } else if (t[0] == "at" && !cases.empty()) {
      cases.back().at.push_back({ParseInts(t.at(1)), ParseInts(t.at(2)), ParseInts(t.at(3)), ParseValues(t.at(4))});
    } else {
      throw std::runtime_error("unexpected line: " + line);
    }
  }
  return cases;
}

// The global arange's values at the index runs LocalSegments reports, row-major.
std::vector<double> GatherSegments(const std::vector<std::vector<Segment>>& runs, const Ints& shape) {
  std::vector<Ints> index(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    for (const Segment& s : runs[d]) {
      for (int64_t i = 0; i < s.length; ++i) index[d].push_back(s.start + i);
    }
  }
  std::vector<double> out;
  Ints pos(shape.size(), 0);
  const Ints stride = ContiguousStride(shape);
  for (const auto& ix : index) {
    if (ix.empty()) return out;
  }
  while (true) {
    int64_t flat = 0;
    for (size_t d = 0; d < shape.size(); ++d) flat += index[d][pos[d]] * stride[d];
    out.push_back(static_cast<double>(flat));
    int d = static_cast<int>(shape.size()) - 1;
    while (d >= 0 && ++pos[d] == static_cast<int64_t>(index[d].size())) pos[d--] = 0;
    if (d < 0) return out;
  }
}

// One fake mesh per (mesh shape, rank) for all cases: DTensorSpec needs a mesh to know the
// coordinate.
mesh::DeviceMeshPtr FakeMesh(const Ints& shape, int rank) {
  static auto* meshes = new std::map<std::pair<Ints, int>, mesh::DeviceMeshPtr>;
  auto& mesh = (*meshes)[{shape, rank}];
  if (!mesh)
    mesh = mesh::DeviceMesh::Create(comm::CreateFakeProcessGroup(rank, static_cast<int>(Product(shape))), shape);
  return mesh;
}

// One `layout` record: every rank's local shape, offset and data through
// ComputeLocalShapeAndGlobalOffset, LocalSegments, DTensorSpec and distribute_tensor.
class DTensorGoldenLayout : public ::testing::TestWithParam<GoldenCase<LayoutCase>> {};

TEST_P(DTensorGoldenLayout, MatchesPyTorch) {
  ASSERT_GOLDEN_CASE_LOADED();
  const LayoutCase& c = *GetParam();
  const std::string cls = CaseClass(c.mesh, {c.placements});
  ASSERT_EQ(static_cast<int64_t>(c.at.size()), Product(c.mesh)) << c.line;
  Mismatches bad;
  const at::Tensor global = at::arange(Product(c.shape), at::kLong).view(c.shape);
  for (int rank = 0; rank < static_cast<int>(c.at.size()); ++rank) {
    const LayoutAt& want = c.at[rank];
    const std::string where = absl::StrCat(c.line, " at [", absl::StrJoin(want.coord, ","), "]");
    auto check = [&](const std::string& what, auto&& fn) {
      try {
        fn();
      } catch (const std::exception& e) {
        bad.Add(absl::StrCat(what, " throws: ", ErrorGist(e), " [", cls, "]"), where);
      }
    };
    check("ComputeLocalShapeAndGlobalOffset", [&] {
      const auto got = ComputeLocalShapeAndGlobalOffset(c.shape, c.mesh, want.coord, c.placements);
      if (got.shape != want.shape) {
        bad.Add("local shape [" + cls + "]", absl::StrCat(where, ": ours [", absl::StrJoin(got.shape, ","),
                                                          "], PyTorch's [", absl::StrJoin(want.shape, ","), "]"));
      } else if (got.offset != want.offset) {
        bad.Add("global offset [" + cls + "]", absl::StrCat(where, ": ours [", absl::StrJoin(got.offset, ","),
                                                            "], PyTorch's [", absl::StrJoin(want.offset, ","), "]"));
      }
    });
    check("LocalSegments", [&] {
      const auto got = GatherSegments(LocalSegments(c.shape, c.mesh, want.coord, c.placements), c.shape);
      if (got != want.values) {
        bad.Add(
            "local data via LocalSegments [" + cls + "]",
            absl::StrCat(where, ": ours ", absl::StrJoin(got, ","), ", PyTorch's ", absl::StrJoin(want.values, ",")));
      }
    });
    check("DTensorSpec", [&] {
      const mesh::DeviceMeshPtr mesh = FakeMesh(c.mesh, rank);
      const auto got = DTensorSpec::Make(mesh, c.placements, c.shape, at::kLong).local_shape_and_offset();
      if (got.shape != want.shape || got.offset != want.offset) {
        bad.Add("DTensorSpec local shape / offset [" + cls + "]",
                absl::StrCat(where, ": ours [", absl::StrJoin(got.shape, ","), "] at [", absl::StrJoin(got.offset, ","),
                             "]"));
      }
      // Our distribute_tensor without a source rank is a local split, as PyTorch's.
      Placements no_partial = c.placements;
      for (auto& p : no_partial) {
        if (p.is_partial()) p = P::Replicate();
      }
      const at::Tensor local = distribute_tensor(global, mesh, no_partial, std::nullopt).to_local();
      if (local.sizes().vec() != want.shape || Flat(local) != want.values) {
        bad.Add("local data via distribute_tensor [" + cls + "]",
                absl::StrCat(where, ": ours ", absl::StrJoin(Flat(local), ","), ", PyTorch's ",
                             absl::StrJoin(want.values, ",")));
      }
    });
  }
  EXPECT_EQ(bad.total(), 0) << "golden layouts from torch " << c.torch << ": " << c.line << "\n" << bad.Report();
}

INSTANTIATE_TEST_SUITE_P(Corpus, DTensorGoldenLayout,
                         ::testing::ValuesIn(GoldenCases<LayoutCase>(
                             GoldenPath("golden_layouts.txt"), 1000,
                             [] {
                               std::string torch;
                               return ReadLayouts(&torch);
                             },
                             [](const LayoutCase& c) { return GoldenLineName(c.line); })),
                         GoldenCaseName());

}  // namespace
}  // namespace fsdp::dtensor
