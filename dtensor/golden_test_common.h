// What the DTensor golden tests share (golden_layout_test.cc, golden_redistribute_test.cc):
// dtensor/testdata/golden_*.txt are written by testing/golden/gen_dtensor.py (`./x golden`),
// which runs torch.distributed.tensor itself (PyTorch 2.15). Here: reading the records, the
// test name of a case from its record line, PyTorch's placement tokens as ours, and the
// categories a case's mismatches are counted in. Test-only; internal linkage: one copy per
// test source.
#ifndef FSDP_DTENSOR_GOLDEN_TEST_COMMON_H_
#define FSDP_DTENSOR_GOLDEN_TEST_COMMON_H_

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "dtensor/placement.h"
#include "testing/golden_file.h"

namespace fsdp::dtensor {
namespace {

using P = Placement;
using Ints = std::vector<int64_t>;
using ::fsdp::testing::GoldenCase;
using ::fsdp::testing::GoldenCaseName;
using ::fsdp::testing::GoldenCases;
using ::fsdp::testing::Mismatches;

// ------------------------------------------------------------------ reading the files

// Bazel runs tests from the runfiles root, where the data files keep their workspace paths;
// FSDP_GOLDEN_DIR points at another directory (e.g. a freshly generated corpus).
std::string GoldenPath(const std::string& name) {
  const char* dir = std::getenv("FSDP_GOLDEN_DIR");
  return absl::StrCat(dir != nullptr ? dir : "dtensor/testdata", "/", name);
}

// The record lines (comments dropped); `torch` gets the version on line 1.
std::vector<std::string> ReadRecords(const std::string& path, std::string* torch) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path + " (regenerate with ./x golden)");
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(in, line)) {
    if (torch->empty() && absl::StartsWith(line, "# torch ")) *torch = line.substr(8);
    if (!line.empty() && line[0] != '#') lines.push_back(line);
  }
  return lines;
}

std::vector<absl::string_view> Tokens(absl::string_view line) { return absl::StrSplit(line, ' ', absl::SkipEmpty()); }

// A case's test name, from its record line without the first word: 2,2 -> 2x2, S(0) -> S0,
// _S(0,2) -> S0sf2, P(sum) -> Psum, -> -> to; e.g. `redistribute 2,2 4 _S(0,2) R -> R P(avg)`
// is 2x2_4_S0sf2_R_to_R_Pavg.
std::string GoldenLineName(absl::string_view line) {
  std::vector<std::string> parts;
  const auto t = Tokens(line);
  for (size_t i = 1; i < t.size(); ++i) {
    absl::string_view token = t[i];
    if (token == "->") {
      parts.push_back("to");
    } else if (absl::ConsumePrefix(&token, "_S(") && absl::ConsumeSuffix(&token, ")")) {
      parts.push_back(absl::StrCat("S", absl::StrReplaceAll(token, {{",", "sf"}})));
    } else {
      parts.push_back(absl::StrReplaceAll(t[i], {{",", "x"}, {"(", ""}, {")", ""}}));
    }
  }
  return absl::StrJoin(parts, "_");
}

Ints ParseInts(absl::string_view token) {
  Ints out;
  if (token == "-") return out;
  for (absl::string_view part : absl::StrSplit(token, ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(part, &v)) throw std::runtime_error(absl::StrCat("bad integer list '", token, "'"));
    out.push_back(v);
  }
  return out;
}

std::vector<double> ParseValues(absl::string_view token) {
  std::vector<double> out;
  if (token == "-") return out;
  for (absl::string_view part : absl::StrSplit(token, ',')) {
    double v = 0;
    if (!absl::SimpleAtod(part, &v)) throw std::runtime_error(absl::StrCat("bad value '", part, "'"));
    out.push_back(v);
  }
  return out;
}

// The one place that maps PyTorch's placement names (testing/golden/golden_common.py
// placement_token: str() of torch/distributed/tensor/placement_types.py without spaces)
// to ours: S(d) -> Shard(d), _S(d,sf) -> StridedShard(d, sf) (_StridedShard(dim=d, sf=sf)),
// R -> Replicate(), P(sum) / P(avg) -> Partial(Sum / Avg).
Placement ParsePlacement(absl::string_view token) {
  if (token == "R") return P::Replicate();
  if (token == "P(sum)") return P::Partial(comm::ReduceOp::Sum());
  if (token == "P(avg)") return P::Partial(comm::ReduceOp::Avg());
  const bool strided = absl::ConsumePrefix(&token, "_S(");
  if ((strided || absl::ConsumePrefix(&token, "S(")) && absl::ConsumeSuffix(&token, ")")) {
    const Ints args = ParseInts(token);
    if (!strided && args.size() == 1) return P::Shard(args[0]);
    if (strided && args.size() == 2) return P::StridedShard(args[0], args[1]);
  }
  throw std::runtime_error(absl::StrCat("unknown placement token '", token, "'"));
}

Placements ParsePlacements(const std::vector<absl::string_view>& tokens, size_t begin, size_t count) {
  Placements out;
  for (size_t i = begin; i < begin + count; ++i) out.push_back(ParsePlacement(tokens.at(i)));
  return out;
}

int64_t Product(const Ints& v) {
  int64_t p = 1;
  for (int64_t x : v) p *= x;
  return p;
}

std::vector<double> Flat(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

// A coarse class of a case for the categories: what the developer fixes per area.
std::string CaseClass(const Ints& mesh, const std::vector<Placements>& lists) {
  bool strided = false, partial = false;
  for (const Placements& ps : lists) {
    for (const Placement& p : ps) {
      strided |= p.is_strided_shard();
      partial |= p.is_partial();
    }
  }
  // PyTorch plans size-1 mesh dims like any other (they cost nothing when skipped).
  const bool unit = std::count(mesh.begin(), mesh.end(), 1) > 0;
  return absl::StrCat(mesh.size(), "-D mesh", unit ? " with a size-1 dim" : "", ", ",
                      strided   ? "strided"
                      : partial ? "partial"
                                : "shard/replicate");
}

// Our exception text grouped: the first line, digits masked, so one bug is one category.
std::string ErrorGist(const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  std::string text = c10 != nullptr ? c10->what_without_backtrace() : e.what();
  text = text.substr(0, std::min(text.find('\n'), size_t{90}));
  for (char& ch : text) {
    if (ch >= '0' && ch <= '9') ch = '#';
  }
  return text;
}

}  // namespace
}  // namespace fsdp::dtensor

#endif  // FSDP_DTENSOR_GOLDEN_TEST_COMMON_H_
