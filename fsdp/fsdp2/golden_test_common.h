// What the FSDP2 golden tests share (golden_layout_test.cc, golden_reduce_test.cc): reading
// the files real PyTorch 2.15 wrote (testing/golden/gen_fsdp.py) and the per-category mismatch
// report of a case (each case is its own test: fsdp::testing::GoldenCases). Test-only;
// internal linkage: one copy per test source.
#ifndef FSDP_FSDP_FSDP2_GOLDEN_TEST_COMMON_H_
#define FSDP_FSDP_FSDP2_GOLDEN_TEST_COMMON_H_

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "comm/comm_trace.h"
#include "fsdp/fsdp2/fsdp_state.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/fsdp2/test_models.h"
#include "testing/golden_file.h"
#include "testing/multi_rank.h"

namespace fsdp::fsdp2 {
namespace {

using Fields = std::vector<std::string>;
using Shape = std::vector<int64_t>;

// ------------------------------------------------------------------ reading the files

// The records of a golden file of this package (testing/golden_file.h).
inline std::vector<Fields> ReadGolden(const std::string& name) {
  return fsdp::testing::ReadGoldenFile("fsdp/fsdp2/testdata/" + name);
}

int64_t Int(const std::string& s) { return fsdp::testing::GoldenInt(s); }
inline double Num(const std::string& s) { return fsdp::testing::GoldenNum(s); }

inline std::optional<double> OptNum(const std::string& s) { return s == "None" ? std::nullopt : std::optional(Num(s)); }

// "3x5" -> {3, 5}; "7" -> {7}; "scalar" -> {}.
inline Shape ShapeOf(const std::string& s) {
  Shape out;
  if (s == "scalar") return out;
  for (absl::string_view d : absl::StrSplit(s, 'x')) out.push_back(Int(std::string(d)));
  return out;
}

inline std::string ShapeStr(at::IntArrayRef shape) { return shape.empty() ? "scalar" : absl::StrJoin(shape, "x"); }

inline std::vector<double> ValuesOf(const std::string& s) { return fsdp::testing::GoldenNums(s); }

inline std::vector<double> ValuesOf(const at::Tensor& t) {
  const at::Tensor d = t.detach().to(at::kDouble).contiguous().view(-1);
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

// Values for a message, exactly (%.17g): all of them, or 12 from `from` with "..." around.
inline std::string Join(const std::vector<double>& v, size_t from = 0, size_t count = SIZE_MAX) {
  std::vector<std::string> parts;
  for (size_t i = from; i < v.size() && i - from < count; ++i) parts.push_back(absl::StrFormat("%.17g", v[i]));
  return absl::StrCat(from > 0 ? "...," : "", absl::StrJoin(parts, ","), from + count < v.size() ? ",..." : "");
}

// Where two value lists first differ, with a few values of each from just before it.
inline std::string Diff(const std::vector<double>& want, const std::vector<double>& got) {
  size_t i = 0;
  while (i < want.size() && i < got.size() && want[i] == got[i]) ++i;
  const size_t from = i > 3 ? i - 3 : 0;
  return absl::StrCat("first difference at element ", i, " (", want.size(), " vs ", got.size(), " elements): PyTorch [",
                      Join(want, from, 12), "], ours [", Join(got, from, 12), "]");
}

// PyTorch's dtype names (str(torch.float32) without "torch.").
inline const std::map<std::string, c10::ScalarType>& Dtypes() {
  static const auto* dtypes = new std::map<std::string, c10::ScalarType>{{"float32", at::kFloat},
                                                                         {"bfloat16", at::kBFloat16},
                                                                         {"float16", at::kHalf},
                                                                         {"float64", at::kDouble},
                                                                         {"uint8", at::kByte}};
  return *dtypes;
}
c10::ScalarType DtypeOf(const std::string& s) { return Dtypes().at(s); }
inline std::optional<c10::ScalarType> OptDtype(const std::string& s) {
  return s == "None" ? std::nullopt : std::optional(DtypeOf(s));
}
inline std::string DtypeName(c10::ScalarType t) {
  for (const auto& [name, type] : Dtypes()) {
    if (type == t) return name;
  }
  return c10::toString(t);
}

// ------------------------------------------------------------------ mismatch report

using fsdp::testing::Mismatches;  // testing/golden_file.h

// Fails the test with every mismatch of the case `label` (one golden test per case).
inline void ExpectNone(const Mismatches& m, const std::string& label) {
  EXPECT_EQ(m.total(), 0) << m.total() << " mismatches in " << label << ":\n" << m.Report();
}

// PyTorch's str() of a placements tuple, from ours: the one place where the two spellings
// meet (torch/distributed/tensor/placement_types.py; a 1-tuple keeps Python's trailing comma).
inline std::string PyTorchPlacements(const dtensor::Placements& placements) {
  std::vector<std::string> parts;
  for (const dtensor::Placement& p : placements) {
    switch (p.kind()) {
      case dtensor::PlacementKind::kShard: parts.push_back(absl::StrCat("Shard(dim=", p.dim(), ")")); break;
      case dtensor::PlacementKind::kStridedShard:
        parts.push_back(absl::StrCat("_StridedShard(dim=", p.dim(), ", sf=", p.split_factor(), ")"));
        break;
      case dtensor::PlacementKind::kReplicate: parts.push_back("Replicate()"); break;
      case dtensor::PlacementKind::kPartial: parts.push_back("Partial(sum)"); break;
    }
  }
  return absl::StrCat("(", absl::StrJoin(parts, ", "), parts.size() == 1 ? ",)" : ")");
}

}  // namespace
}  // namespace fsdp::fsdp2

#endif  // FSDP_FSDP_FSDP2_GOLDEN_TEST_COMMON_H_
