// Golden tests against real PyTorch 2.15: dtensor/testdata/golden_*.txt are written by
// testing/golden/gen_dtensor.py (`./x golden`), which runs torch.distributed.tensor itself
// (layout math of torch/distributed/tensor/_utils.py and placement_types.py, and
// DTensor.redistribute on simulated ranks). The formats are documented at the top of each
// file. Every mismatch is counted per category; the first examples of each are printed and
// any mismatch fails the test (zero tolerance: the data are integers or exact halves).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "comm/comm_trace.h"
#include "comm/fake_process_group.h"
#include "dtensor/dtensor.h"
#include "dtensor/dtensor_spec.h"
#include "dtensor/redistribute.h"
#include "testing/multi_rank.h"

namespace fsdp::dtensor {
namespace {

using P = Placement;
using Ints = std::vector<int64_t>;

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

// StridedShard cases whose collectives differ from PyTorch's (a deliberate difference in
// planning; their values must still match). Printed by the test, not failed on.
std::atomic<int64_t> strided_plan_differences{0};

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

// ------------------------------------------------------------------ mismatch report

// Mismatches per category, each counted once per case (threaded ranks add the same case);
// of one case's examples the smallest is kept (the lowest rank's), so the printout does
// not depend on thread timing.
class Mismatches {
 public:
  void Add(const std::string& category, int case_index, const std::string& example) {
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, added] = by_category_[category].emplace(case_index, example);
    if (!added && example < it->second) it->second = example;
  }
  int64_t total() const {
    int64_t n = 0;
    for (const auto& [category, cases] : by_category_) n += cases.size();
    return n;
  }
  std::string Report(int cases) const {
    std::string out = absl::StrCat(total(), " mismatches in ", cases, " cases\n");
    for (const auto& [category, examples] : by_category_) {
      absl::StrAppend(&out, "  ", examples.size(), " x ", category, "\n");
      int shown = 0;
      for (const auto& [index, example] : examples) {
        if (shown++ == 5) break;
        absl::StrAppend(&out, "      e.g. ", example, "\n");
      }
    }
    return out;
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::map<int, std::string>> by_category_;
};

// ------------------------------------------------------------------ layouts

struct LayoutAt {
  Ints coord, shape, offset;
  std::vector<double> values;
};
struct LayoutCase {
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
      LayoutCase c{line, ParseInts(t.at(1)), ParseInts(t.at(2)), {}, {}};
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

TEST(GoldenTest, LayoutsMatchPyTorch) {
  std::string torch;
  const std::vector<LayoutCase> cases = ReadLayouts(&torch);
  ASSERT_GT(cases.size(), 1000u) << "golden_layouts.txt is missing cases";
  Mismatches bad;
  // One fake mesh per (mesh shape, rank): DTensorSpec needs a mesh to know the coordinate.
  std::map<std::pair<Ints, int>, mesh::DeviceMeshPtr> meshes;
  for (int i = 0; i < static_cast<int>(cases.size()); ++i) {
    const LayoutCase& c = cases[i];
    const std::string cls = CaseClass(c.mesh, {c.placements});
    ASSERT_EQ(static_cast<int64_t>(c.at.size()), Product(c.mesh)) << c.line;
    const at::Tensor global = at::arange(Product(c.shape), at::kLong).view(c.shape);
    for (int rank = 0; rank < static_cast<int>(c.at.size()); ++rank) {
      const LayoutAt& want = c.at[rank];
      const std::string where = absl::StrCat(c.line, " at [", absl::StrJoin(want.coord, ","), "]");
      auto check = [&](const std::string& what, auto&& fn) {
        try {
          fn();
        } catch (const std::exception& e) {
          bad.Add(absl::StrCat(what, " throws: ", ErrorGist(e), " [", cls, "]"), i, where);
        }
      };
      check("ComputeLocalShapeAndGlobalOffset", [&] {
        const auto got = ComputeLocalShapeAndGlobalOffset(c.shape, c.mesh, want.coord, c.placements);
        if (got.shape != want.shape) {
          bad.Add("local shape [" + cls + "]", i,
                  absl::StrCat(where, ": ours [", absl::StrJoin(got.shape, ","), "], PyTorch's [",
                               absl::StrJoin(want.shape, ","), "]"));
        } else if (got.offset != want.offset) {
          bad.Add("global offset [" + cls + "]", i,
                  absl::StrCat(where, ": ours [", absl::StrJoin(got.offset, ","), "], PyTorch's [",
                               absl::StrJoin(want.offset, ","), "]"));
        }
      });
      check("LocalSegments", [&] {
        const auto got = GatherSegments(LocalSegments(c.shape, c.mesh, want.coord, c.placements), c.shape);
        if (got != want.values) {
          bad.Add(
              "local data via LocalSegments [" + cls + "]", i,
              absl::StrCat(where, ": ours ", absl::StrJoin(got, ","), ", PyTorch's ", absl::StrJoin(want.values, ",")));
        }
      });
      check("DTensorSpec", [&] {
        auto& mesh = meshes[{c.mesh, rank}];
        if (!mesh)
          mesh = mesh::DeviceMesh::Create(comm::CreateFakeProcessGroup(rank, static_cast<int>(c.at.size())), c.mesh);
        const auto got = DTensorSpec::Make(mesh, c.placements, c.shape, at::kLong).local_shape_and_offset();
        if (got.shape != want.shape || got.offset != want.offset) {
          bad.Add("DTensorSpec local shape / offset [" + cls + "]", i,
                  absl::StrCat(where, ": ours [", absl::StrJoin(got.shape, ","), "] at [",
                               absl::StrJoin(got.offset, ","), "]"));
        }
        // Our distribute_tensor without a source rank is a local split, as PyTorch's.
        Placements no_partial = c.placements;
        for (auto& p : no_partial) {
          if (p.is_partial()) p = P::Replicate();
        }
        const at::Tensor local = distribute_tensor(global, mesh, no_partial, std::nullopt).to_local();
        if (local.sizes().vec() != want.shape || Flat(local) != want.values) {
          bad.Add("local data via distribute_tensor [" + cls + "]", i,
                  absl::StrCat(where, ": ours ", absl::StrJoin(Flat(local), ","), ", PyTorch's ",
                               absl::StrJoin(want.values, ",")));
        }
      });
    }
  }
  std::cout << "golden layouts from torch " << torch << ": " << bad.Report(cases.size());
  EXPECT_EQ(bad.total(), 0) << bad.Report(cases.size());
}

// ------------------------------------------------------------------ redistribute

struct RankTensor {
  Ints shape;
  std::vector<double> values;
  bool known = true;  // false: `?`, a Partial leaves the values open
};
struct RedistributeCase {
  std::string line;
  Ints mesh, shape;
  Placements src, dst;
  std::vector<RankTensor> in, out;
  // PyTorch's own layout of the result where its redistribute's `out` is off it (see the
  // file's header); compared with instead of `out`.
  std::vector<RankTensor> split;
  std::string outcome;  // "ok", "error" (PyTorch refuses), "fails" (PyTorch trips itself)
  std::string steps, message;
  std::map<std::string, int64_t> comms;
};

std::vector<RedistributeCase> ReadRedistributes(std::string* torch) {
  std::vector<RedistributeCase> cases;
  for (const std::string& line : ReadRecords(GoldenPath("golden_redistribute.txt"), torch)) {
    const auto t = Tokens(line);
    if (t[0] == "redistribute") {
      RedistributeCase c{line, ParseInts(t.at(1)), ParseInts(t.at(2))};
      const size_t k = c.mesh.size();
      c.src = ParsePlacements(t, 3, k);
      if (t.at(3 + k) != "->") throw std::runtime_error("expected '->' in " + line);
      c.dst = ParsePlacements(t, 4 + k, k);
      cases.push_back(std::move(c));
      continue;
    }
    if (cases.empty()) throw std::runtime_error("record before the first case: " + line);
    RedistributeCase& c = cases.back();
    if (t[0] == "in" || t[0] == "out" || t[0] == "split") {
      const bool known = t.at(3) != "?";
      (t[0] == "in"    ? c.in
       : t[0] == "out" ? c.out
                       : c.split)
          .push_back({ParseInts(t.at(2)), known ? ParseValues(t.at(3)) : std::vector<double>{}, known});
    } else if (t[0] == "steps") {
      c.outcome = "ok";
      c.steps = line.substr(6);
    } else if (t[0] == "comms") {
      for (size_t i = 1; i < t.size() && t[i] != "-"; ++i) {
        const std::vector<std::string> kv = absl::StrSplit(t[i], '=');
        if (kv.size() != 2 || !absl::SimpleAtoi(kv[1], &c.comms[kv[0]])) throw std::runtime_error("bad " + line);
      }
    } else if (t[0] == "error" || t[0] == "fails") {
      c.outcome = std::string(t[0]);
      c.message = line.substr(t[0].size() + 1);
    } else {
      throw std::runtime_error("unexpected line: " + line);
    }
  }
  return cases;
}

// Our CommTrace op names -> the golden file's kinds (gen_dtensor.py COMM_KINDS).
std::string CommKind(const std::string& op) {
  if (op == "all_gather_into_tensor") return "all_gather";
  if (op == "reduce_scatter_tensor") return "reduce_scatter";
  if (op == "all_to_all_single") return "all_to_all";
  return op;  // all_reduce, broadcast, barrier
}

std::string CommText(const std::map<std::string, int64_t>& comms) {
  std::vector<std::string> parts;
  for (const auto& [kind, n] : comms) {
    if (n != 0) parts.push_back(absl::StrCat(kind, "=", n));
  }
  return parts.empty() ? "-" : absl::StrJoin(parts, " ");
}

at::Tensor ToTensor(const RankTensor& t) {
  return at::tensor(at::ArrayRef<double>(t.values), at::kDouble).view(t.shape).clone();
}

// The traced groups a mesh's collectives go through (the world may serve several dims).
std::vector<std::shared_ptr<comm::CommTrace>> TracedGroups(const mesh::DeviceMesh& mesh) {
  std::set<comm::CommTrace*> seen;
  std::vector<std::shared_ptr<comm::CommTrace>> out;
  for (int d = 0; d < mesh.ndim(); ++d) {
    auto traced = std::dynamic_pointer_cast<comm::CommTrace>(mesh.group(d));
    if (traced && seen.insert(traced.get()).second) out.push_back(traced);
  }
  return out;
}

// Whether every rank of `pg` passes `ok` (an all-reduce on the untraced world): a rank that
// fails locally must not leave the others waiting in the collectives that follow.
bool AllRanks(const comm::ProcessGroupPtr& pg, bool ok) {
  at::Tensor flag = at::full({1}, ok ? 0 : 1, at::kLong);
  pg->all_reduce(flag)->wait();
  return flag.item<int64_t>() == 0;
}

// Collectives recorded so far on the mesh's groups, by golden kind.
std::map<std::string, int64_t> CountCollectives(const mesh::DeviceMesh& mesh) {
  std::map<std::string, int64_t> counts;
  for (const auto& g : TracedGroups(mesh)) {
    for (const auto& r : g->records()) ++counts[CommKind(r.op)];
  }
  return counts;
}

// One case on one threaded rank (every rank runs the same cases in the same order).
class CaseRun {
 public:
  CaseRun(const RedistributeCase& c, int index, const comm::ProcessGroupPtr& pg, const mesh::DeviceMeshPtr& mesh,
          Mismatches& bad)
      : c_(c),
        index_(index),
        pg_(pg),
        mesh_(mesh),
        bad_(bad),
        rank_(pg->rank()),
        cls_(CaseClass(c.mesh, {c.src, c.dst})),
        where_(absl::StrCat(c.line, " (rank ", rank_, ")")) {}

  void Run() {
    CheckInputRule();
    // Local phase: wrap PyTorch's input and plan; no collectives yet.
    DTensor input;
    std::string local_error;
    try {
      input = DTensor::from_local(ToTensor(c_.in[rank_]), mesh_, c_.src, c_.shape);
      PlanRedistribute(input.spec(), c_.dst);
    } catch (const std::exception& e) {
      local_error = ErrorGist(e);
    }
    if (!AllRanks(pg_, local_error.empty())) {
      if (c_.outcome == "ok" && !local_error.empty()) {
        Add(input.defined() ? "we refuse, PyTorch redistributes: " : "from_local rejects PyTorch's input: ",
            local_error, where_);
      }
      return;  // where PyTorch refuses, any rank refusing is the expected outcome
    }
    // Collective phase.
    const auto before = CountCollectives(*mesh_);
    at::Tensor output;
    std::string run_error;
    try {
      output = input.redistribute(c_.dst).to_local();
    } catch (const std::exception& e) {
      run_error = ErrorGist(e);
    }
    const bool all_ok = AllRanks(pg_, run_error.empty());
    if (c_.outcome == "error") {
      if (all_ok) Add("we redistribute, PyTorch refuses", "", c_.line + " -- PyTorch: " + c_.message);
      return;
    }
    if (!run_error.empty()) Add("we throw, PyTorch redistributes: ", run_error, where_);
    if (!all_ok) return;
    auto comms = CountCollectives(*mesh_);
    for (const auto& [kind, n] : before) comms[kind] -= n;
    // Deliberate difference (README, "Where we follow PyTorch 2.15"): with a StridedShard on
    // either side PyTorch plans by a min-cost graph search that reads the _StridedShard as a
    // shard order; we plan it with the same greedy walks as plain shards. The values are
    // compared all the same (below); the collectives of those cases are only counted.
    const bool strided_plan = absl::StrContains(cls_, "strided");
    if (strided_plan && CommText(comms) != CommText(c_.comms)) {
      if (rank_ == 0) strided_plan_differences.fetch_add(1);  // once per case
    } else if (CommText(comms) != CommText(c_.comms)) {
      Add("collectives", Off(),
          absl::StrCat(c_.line, ": ours ", CommText(comms), ", PyTorch's ", CommText(c_.comms), " (PyTorch's steps ",
                       c_.steps, ")"));
    }
    CompareOutput(output);
  }

 private:
  // Categories of cases where PyTorch's result is off its own layout say so: there its
  // collectives are no model either.
  std::string Off() const { return c_.split.empty() ? "" : " (PyTorch's own result is off its layout here)"; }

  void Add(const std::string& what, const std::string& detail, const std::string& example) {
    bad_.Add(absl::StrCat(what, detail, " [", cls_, "]"), index_, example);
  }

  // Our input rule (our own distribute_tensor, Partial dims scaled) vs the file's inputs.
  void CheckInputRule() {
    Placements no_partial = c_.src;
    double factor = 1;
    for (int m = 0; m < mesh_->ndim(); ++m) {
      if (!c_.src[m].is_partial()) continue;
      no_partial[m] = P::Replicate();
      factor *= mesh_->coordinate()[m] + 1;
    }
    try {
      const at::Tensor global = at::arange(Product(c_.shape), at::kDouble).view(c_.shape);
      const at::Tensor mine = distribute_tensor(global, mesh_, no_partial, std::nullopt).to_local() * factor;
      if (mine.sizes().vec() != c_.in[rank_].shape || Flat(mine) != c_.in[rank_].values) {
        Add("input: our distribute_tensor differs from PyTorch's", "", where_);
      }
    } catch (const std::exception& e) {
      Add("input: our distribute_tensor throws: ", ErrorGist(e), where_);
    }
  }

  void CompareOutput(const at::Tensor& output) {
    // Where PyTorch's result is off its own layout (StridedShard redistributes PyTorch gets
    // wrong, also on real Gloo ranks), its layout is the answer; such categories say so.
    const RankTensor& want = c_.split.empty() ? c_.out[rank_] : c_.split[rank_];
    if (output.sizes().vec() != want.shape) {
      Add("output shape", Off(),
          absl::StrCat(where_, ": ours [", absl::StrJoin(output.sizes(), ","), "], PyTorch's [",
                       absl::StrJoin(want.shape, ","), "]"));
    } else if (want.known && Flat(output) != want.values) {
      Add("output values", Off(),
          absl::StrCat(where_, ": ours ", absl::StrJoin(Flat(output), ","), ", PyTorch's ",
                       absl::StrJoin(want.values, ",")));
    }
  }

  const RedistributeCase& c_;
  const int index_;
  const comm::ProcessGroupPtr& pg_;
  const mesh::DeviceMeshPtr& mesh_;
  Mismatches& bad_;
  const int rank_;
  const std::string cls_, where_;
};

// Runs the cases of one world size on threaded ranks, one RunOnRanks for all of them.
void RunWorld(int world, const std::vector<RedistributeCase>& cases, const std::vector<int>& indices, Mismatches& bad) {
  fsdp::testing::RunOptions options;
  options.deadline = std::chrono::milliseconds(600000);
  fsdp::testing::RunOnRanks(
      fsdp::testing::Backend::kThreaded, world,
      [&](const comm::ProcessGroupPtr& pg) {
        // Meshes are made in case order, the same on every rank (creation is collective);
        // their groups record collectives, the world itself only runs AllRanks.
        auto traced_world = std::make_shared<comm::CommTrace>(pg);
        std::map<Ints, mesh::DeviceMeshPtr> meshes;
        for (int i : indices) {
          auto& mesh = meshes[cases[i].mesh];
          if (!mesh) mesh = mesh::DeviceMesh::Create(traced_world, cases[i].mesh);
        }
        for (int i : indices) {
          if (cases[i].outcome != "fails") CaseRun(cases[i], i, pg, meshes[cases[i].mesh], bad).Run();
        }
      },
      options);
}

TEST(GoldenTest, RedistributesMatchPyTorch) {
  std::string torch;
  const std::vector<RedistributeCase> cases = ReadRedistributes(&torch);
  ASSERT_GT(cases.size(), 1000u) << "golden_redistribute.txt is missing cases";
  std::map<int, std::vector<int>> by_world;  // one RunOnRanks per world size
  for (int i = 0; i < static_cast<int>(cases.size()); ++i) {
    const RedistributeCase& c = cases[i];
    const int world = static_cast<int>(Product(c.mesh));
    ASSERT_EQ(static_cast<int>(c.in.size()), world) << c.line;
    ASSERT_TRUE(c.outcome != "ok" || static_cast<int>(c.out.size()) == world) << c.line;
    ASSERT_TRUE(c.split.empty() || static_cast<int>(c.split.size()) == world) << c.line;
    by_world[world].push_back(i);
  }
  Mismatches bad;
  for (const auto& [world, indices] : by_world) RunWorld(world, cases, indices, bad);
  // `fails`: PyTorch trips its own checks, on some ranks only (real Gloo ranks then hang or
  // abort); nothing to compare with.
  const int64_t skipped = std::count_if(cases.begin(), cases.end(), [](const auto& c) { return c.outcome == "fails"; });
  std::cout << "golden redistributes from torch " << torch << " (" << skipped
            << " skipped: PyTorch itself fails on them; " << strided_plan_differences.load()
            << " StridedShard cases planned with other collectives than PyTorch's graph search, values equal): "
            << bad.Report(cases.size());
  EXPECT_EQ(bad.total(), 0) << bad.Report(cases.size());
}

}  // namespace
}  // namespace fsdp::dtensor
