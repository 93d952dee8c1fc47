// DTensor.redistribute against real PyTorch 2.15 (dtensor/testdata/golden_redistribute.txt,
// written by testing/golden/gen_dtensor.py on simulated ranks): values, collectives and
// refusals. One test per corpus case, named for its record line, e.g.
// --gtest_filter='Corpus/DTensorGoldenRedistribute.MatchesPyTorch/*_to_R_R_R'. A case's
// mismatches are counted per category (testing/golden_file.h), the first examples of each
// printed, and any mismatch fails it (zero tolerance: the data are integers or exact halves).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/comm_trace.h"
#include "comm/fake_process_group.h"
#include "dtensor/dtensor.h"
#include "dtensor/dtensor_spec.h"
#include "dtensor/golden_test_common.h"
#include "dtensor/redistribute.h"
#include "testing/multi_rank.h"

namespace fsdp::dtensor {
namespace {

// ------------------------------------------------------------------ redistribute

struct RankTensor {
  Ints shape;
  std::vector<double> values;
  bool known = true;  // false: `?`, a Partial leaves the values open
};
struct RedistributeCase {
  std::string torch;  // the PyTorch that wrote the file
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
      RedistributeCase c{*torch, line, ParseInts(t.at(1)), ParseInts(t.at(2))};
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

// One case on one threaded rank. `strided_plan_difference` gets rank 0's note where a
// StridedShard case's collectives differ from PyTorch's (a deliberate difference in planning;
// their values must still match): reported by the test, not failed on.
class CaseRun {
 public:
  CaseRun(const RedistributeCase& c, const comm::ProcessGroupPtr& pg, const mesh::DeviceMeshPtr& mesh, Mismatches& bad,
          std::string& strided_plan_difference)
      : c_(c),
        pg_(pg),
        mesh_(mesh),
        bad_(bad),
        strided_plan_difference_(strided_plan_difference),
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
      if (rank_ == 0) {
        strided_plan_difference_ = absl::StrCat("ours ", CommText(comms), ", PyTorch's ", CommText(c_.comms));
      }
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
    bad_.Add(absl::StrCat(what, detail, " [", cls_, "]"), example);
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
  const comm::ProcessGroupPtr& pg_;
  const mesh::DeviceMeshPtr& mesh_;
  Mismatches& bad_;
  std::string& strided_plan_difference_;
  const int rank_;
  const std::string cls_, where_;
};

// The redistribute corpus, read once (at test registration).
const std::vector<GoldenCase<RedistributeCase>>& RedistributeCorpus() {
  static const auto* corpus = new std::vector<GoldenCase<RedistributeCase>>(GoldenCases<RedistributeCase>(
      GoldenPath("golden_redistribute.txt"), 1000,
      [] {
        std::string torch;
        return ReadRedistributes(&torch);
      },
      [](const RedistributeCase& c) { return GoldenLineName(c.line); }));
  return *corpus;
}

// Whether a case has a record per rank wherever it needs one (the test asserts it).
bool WellFormed(const RedistributeCase& c) {
  const size_t world = Product(c.mesh);
  return c.in.size() == world && (c.outcome != "ok" || c.out.size() == world) &&
         (c.split.empty() || c.split.size() == world);
}

// One `redistribute` record: our redistribute of PyTorch's input, its outcome (or refusal),
// collectives and every rank's output. One threaded world per world size runs all of its
// selected cases (SetUpTestSuite: a world per case would cost thread starts and mesh
// creation ~2000 times, several times the comparisons); each case's test reports that case.
class DTensorGoldenRedistribute : public ::testing::TestWithParam<GoldenCase<RedistributeCase>> {
 public:
  struct Result {
    Mismatches bad;
    std::string strided_plan_difference;
    std::string world_failed;  // the world that ran this case failed (a rank threw or hung)
  };

  // Runs the cases this run selects (--gtest_filter, sharding), one RunOnRanks per world size.
  static void SetUpTestSuite() {
    results_ = new std::map<const RedistributeCase*, Result>;
    std::set<std::string> selected;
    const ::testing::TestSuite* suite = ::testing::UnitTest::GetInstance()->current_test_suite();
    for (int i = 0; i < suite->total_test_count(); ++i) {
      const ::testing::TestInfo* info = suite->GetTestInfo(i);
      if (info->should_run() && info->value_param() != nullptr) selected.insert(info->value_param());
    }
    std::map<int, std::vector<const RedistributeCase*>> by_world;
    for (const auto& c : RedistributeCorpus()) {
      if (c.value && selected.count(c.name) && WellFormed(*c) && c->outcome != "fails") {
        by_world[static_cast<int>(Product(c->mesh))].push_back(c.value.get());
        (*results_)[c.value.get()];
      }
    }
    for (const auto& [world, cases] : by_world) RunWorld(world, cases);
  }
  static void TearDownTestSuite() {
    delete results_;
    results_ = nullptr;
  }

 protected:
  static std::map<const RedistributeCase*, Result>* results_;

 private:
  static void RunWorld(int world, const std::vector<const RedistributeCase*>& cases) {
    fsdp::testing::RunOptions options;
    options.deadline = std::chrono::milliseconds(600000);
    const auto outcomes = fsdp::testing::RunOnRanksCollect(
        fsdp::testing::Backend::kThreaded, world,
        [&](const comm::ProcessGroupPtr& pg) {
          // Meshes are made in case order, the same on every rank (creation is collective);
          // their groups record collectives, the world itself only runs AllRanks.
          auto traced_world = std::make_shared<comm::CommTrace>(pg);
          std::map<Ints, mesh::DeviceMeshPtr> meshes;
          for (const RedistributeCase* c : cases) {
            auto& mesh = meshes[c->mesh];
            if (!mesh) mesh = mesh::DeviceMesh::Create(traced_world, c->mesh);
          }
          for (const RedistributeCase* c : cases) {
            Result& r = results_->at(c);
            CaseRun(*c, pg, meshes[c->mesh], r.bad, r.strided_plan_difference).Run();
          }
        },
        options);
    for (const auto& o : outcomes) {
      if (o.ok) continue;
      for (const RedistributeCase* c : cases) {
        absl::StrAppend(&results_->at(c).world_failed, "rank ", o.rank, " of the W=", world, " world: ", o.message,
                        "\n");
      }
    }
  }
};

std::map<const RedistributeCase*, DTensorGoldenRedistribute::Result>* DTensorGoldenRedistribute::results_ = nullptr;

TEST_P(DTensorGoldenRedistribute, MatchesPyTorch) {
  ASSERT_GOLDEN_CASE_LOADED();
  const RedistributeCase& c = *GetParam();
  const int world = static_cast<int>(Product(c.mesh));
  ASSERT_EQ(static_cast<int>(c.in.size()), world) << c.line;
  ASSERT_TRUE(c.outcome != "ok" || static_cast<int>(c.out.size()) == world) << c.line;
  ASSERT_TRUE(c.split.empty() || static_cast<int>(c.split.size()) == world) << c.line;
  // `fails`: PyTorch trips its own checks, on some ranks only (real Gloo ranks then hang or
  // abort); nothing to compare with.
  if (c.outcome == "fails") GTEST_SKIP() << "PyTorch itself fails on this case: " << c.message;
  auto it = results_->find(GetParam().value.get());
  ASSERT_NE(it, results_->end()) << c.line << ": not run by SetUpTestSuite";
  const Result& result = it->second;
  // Any rank failing leaves every case of its world unproven (which case it was is not known).
  ASSERT_EQ(result.world_failed, "") << c.line;
  if (!result.strided_plan_difference.empty()) {
    RecordProperty("strided_plan_difference", result.strided_plan_difference);
    std::cout << "StridedShard case planned with other collectives than PyTorch's graph search, values equal: "
              << result.strided_plan_difference << "\n";
  }
  EXPECT_EQ(result.bad.total(), 0) << "golden redistributes from torch " << c.torch << ": " << c.line << "\n"
                                   << result.bad.Report();
}

INSTANTIATE_TEST_SUITE_P(Corpus, DTensorGoldenRedistribute, ::testing::ValuesIn(RedistributeCorpus()),
                         GoldenCaseName());

}  // namespace
}  // namespace fsdp::dtensor
