// The schedule IR (action.h, schedule_orders.h, lowering.h) against PyTorch 2.15's own
// torch/distributed/pipelining/schedules.py: pipelining/testdata/golden_schedules.txt, written
// by testing/golden/gen_pipelining.py (its header documents the records). One test per
// schedule case, format case, CSV case, custom schedule; then the errors of bad input.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "pipelining/action.h"
#include "pipelining/lowering.h"
#include "pipelining/schedule_orders.h"
#include "testing/expect_error.h"
#include "testing/golden_file.h"
#include "testing/test_dir.h"

namespace fsdp::pipelining {
namespace {

using ::fsdp::testing::GoldenCase;
using ::fsdp::testing::GoldenCaseName;
using ::fsdp::testing::GoldenCases;
using ::fsdp::testing::GoldenFields;
using ::fsdp::testing::GoldenInt;

constexpr char kGolden[] = "pipelining/testdata/golden_schedules.txt";

// --------------------------------------------------------------------- the golden corpus

struct GoldenError {
  std::string phase;  // "compute" or "lower"
  std::string type;   // PyTorch's exception type
  std::string message;
};

struct ScheduleCase {
  std::string name;
  std::string schedule;
  int ranks = 0, stages_per_rank = 0, n = 0;
  LoweringOptions options;
  std::map<int, std::string> compute, pipeline_order, lowered;  // rank -> the golden action list
  std::optional<GoldenError> error;
};

struct FormatCase {
  std::string name;  // the schedule case whose compute order is formatted
  std::optional<int> error_step;
  std::string text;
};

struct CsvCase {
  std::string name;
  std::string text;
};

struct CustomCase {
  std::string name;
  LoweringOptions options;
  int n = 0, num_stages = 0;
  std::string csv;
  std::map<int, std::string> compute, lowered;
  std::optional<GoldenError> error;
};

struct ParseCase {
  std::string text;
  std::vector<std::string> result;  // {repr} / {"None"} / {"error", type, message}
};

struct Corpus {
  std::vector<ScheduleCase> schedules;
  std::vector<FormatCase> formats;
  std::vector<CsvCase> csvs;
  std::vector<CustomCase> customs;
  std::vector<ParseCase> parses;
  std::map<std::string, const ScheduleCase*> by_name;
};

std::string Unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out += s[i];
      continue;
    }
    const char c = s[++i];
    out += c == 'r' ? '\r' : c == 'n' ? '\n' : c;
  }
  return out;
}

LoweringOptions OptionsOf(const GoldenFields& f, size_t at) {
  LoweringOptions o;
  o.max_active_stages = static_cast<int>(GoldenInt(f.at(at)));
  o.defer_reduce_grad_wait = GoldenInt(f.at(at + 1)) != 0;
  o.defer_pp_recv = GoldenInt(f.at(at + 2)) != 0;
  return o;
}

const Corpus& GetCorpus() {
  static const Corpus* corpus = [] {
    auto* c = new Corpus;
    ScheduleCase* sc = nullptr;
    CustomCase* cc = nullptr;
    FormatCase* fc = nullptr;
    for (const GoldenFields& f : ::fsdp::testing::ReadGoldenFile(kGolden)) {
      const std::string& kind = f.at(0);
      if (kind == "case") {
        ScheduleCase s;
        s.name = f.at(1);
        s.schedule = f.at(2);
        s.ranks = static_cast<int>(GoldenInt(f.at(3)));
        s.stages_per_rank = static_cast<int>(GoldenInt(f.at(4)));
        s.n = static_cast<int>(GoldenInt(f.at(5)));
        s.options = OptionsOf(f, 6);
        c->schedules.push_back(std::move(s));
        sc = &c->schedules.back();
        cc = nullptr;
      } else if (kind == "custom") {
        CustomCase s;
        s.name = f.at(1);
        s.options = OptionsOf(f, 2);
        s.n = static_cast<int>(GoldenInt(f.at(5)));
        s.num_stages = static_cast<int>(GoldenInt(f.at(6)));
        s.csv = Unescape(f.at(7));
        c->customs.push_back(std::move(s));
        cc = &c->customs.back();
        sc = nullptr;
      } else if (kind == "compute" || kind == "pipeline_order" || kind == "lowered") {
        const int rank = static_cast<int>(GoldenInt(f.at(1)));
        const std::string& list = f.size() > 2 ? f[2] : "";
        if (cc != nullptr) {
          (kind == "compute" ? cc->compute : cc->lowered)[rank] = list;
        } else {
          if (sc == nullptr) throw std::runtime_error("an order record before any case");
          (kind == "compute" ? sc->compute : kind == "lowered" ? sc->lowered : sc->pipeline_order)[rank] = list;
        }
      } else if (kind == "error") {
        GoldenError e{f.at(1), f.at(2), f.at(3)};
        if (cc != nullptr) {
          cc->error = e;
        } else {
          sc->error = e;
        }
      } else if (kind == "format") {
        std::optional<int> step;
        if (f.at(2) != "-") step = static_cast<int>(GoldenInt(f.at(2)));
        c->formats.push_back({f.at(1), step, ""});
        fc = &c->formats.back();
      } else if (kind == "fline") {
        const std::string& line = f.at(1);
        if (fc == nullptr || line.empty() || line.back() != '|') throw std::runtime_error("bad fline " + line);
        fc->text += line.substr(0, line.size() - 1) + "\n";
      } else if (kind == "csv") {
        c->csvs.push_back({f.at(1), Unescape(f.at(2))});
      } else if (kind == "parse") {
        c->parses.push_back({f.at(1), GoldenFields(f.begin() + 2, f.end())});
      } else {
        throw std::runtime_error("unknown record " + kind);
      }
    }
    for (const ScheduleCase& s : c->schedules) c->by_name[s.name] = &s;
    return c;
  }();
  return *corpus;
}

// Reads a golden action list back: each action through Action::Parse, "-" an idle step.
std::vector<std::optional<Action>> ParseList(const std::string& list) {
  std::vector<std::optional<Action>> out;
  if (list.empty()) return out;
  for (absl::string_view item : absl::StrSplit(list, ',')) {
    if (item == "-") {
      out.emplace_back(std::nullopt);
    } else {
      std::optional<Action> a = Action::Parse(std::string(item));
      if (!a.has_value()) throw std::runtime_error("empty action in " + list);
      out.push_back(std::move(a));
    }
  }
  return out;
}

PipelineOrder ParseOrder(const std::map<int, std::string>& lists) {
  PipelineOrder order;
  for (const auto& [rank, list] : lists) order[rank] = ParseList(list);
  return order;
}

// A message as the golden file keeps it: whitespace runs squeezed to one space, 120 chars.
std::string Squeezed(const std::string& text) {
  std::vector<absl::string_view> words = absl::StrSplit(text, absl::ByAnyChar(" \t\r\n"), absl::SkipEmpty());
  return absl::StrJoin(words, " ").substr(0, 120);
}

// `fn` throws a c10::Error whose message is PyTorch's (as the golden file squeezes it).
template <class Fn>
void ExpectPyTorchError(Fn fn, const GoldenError& expected, const std::string& what) {
  try {
    fn();
    ADD_FAILURE() << what << ": PyTorch raised " << expected.type << " (" << expected.message << "), we did not";
  } catch (const c10::Error& e) {
    EXPECT_EQ(Squeezed(e.what_without_backtrace()), expected.message) << what;
  }
}

void ExpectOrder(const std::map<int, std::string>& golden, const PipelineOrder& ours, const std::string& what) {
  std::map<int, std::string> got;
  for (const auto& [rank, actions] : ours) got[rank] = ActionsToString(actions);
  EXPECT_EQ(got, golden) << what;
}

void ExpectLowered(const std::map<int, std::string>& golden, const LoweredOrder& ours, const std::string& what) {
  std::map<int, std::string> got;
  for (const auto& [rank, actions] : ours) got[rank] = ActionsToString(actions);
  EXPECT_EQ(got, golden) << what;
}

// ------------------------------------------------------------ one test per schedule case

class ScheduleGoldenTest : public ::testing::TestWithParam<GoldenCase<ScheduleCase>> {};

TEST_P(ScheduleGoldenTest, ComputeOrderAndLoweringMatchPyTorch) {
  ASSERT_GOLDEN_CASE_LOADED();
  const ScheduleCase& c = *GetParam();
  const ScheduleKind kind = ScheduleKindFromName(c.schedule);
  EXPECT_EQ(ScheduleName(kind), c.schedule);
  if (c.error.has_value() && c.error->phase == "compute") {
    ExpectPyTorchError([&] { ComputeOrder(kind, c.ranks, c.stages_per_rank, c.n); }, *c.error, "ComputeOrder");
    return;
  }
  const PipelineOrder compute = ComputeOrder(kind, c.ranks, c.stages_per_rank, c.n);
  ExpectOrder(c.compute, compute, "compute order");
  if (IsSingleStageSchedule(kind)) {
    // _get_pipeline_order() is the compute order through _add_reduce_grad.
    std::map<int, std::string> whole;
    for (const auto& [rank, actions] : compute) whole[rank] = ActionsToString(AddReduceGrad(actions, c.n));
    EXPECT_EQ(whole, c.pipeline_order);
  }
  const int num_stages = c.ranks * c.stages_per_rank;
  auto stage_to_rank = [&](int s) { return StageRank(kind, s, c.ranks); };
  if (c.error.has_value()) {
    ExpectPyTorchError([&] { LowerWithComms(compute, c.n, stage_to_rank, num_stages, c.options); }, *c.error,
                       "LowerWithComms");
    return;
  }
  ExpectLowered(c.lowered, LowerWithComms(compute, c.n, stage_to_rank, num_stages, c.options), "lowered order");
}

INSTANTIATE_TEST_SUITE_P(Golden, ScheduleGoldenTest,
                         ::testing::ValuesIn(GoldenCases<ScheduleCase>(
                             kGolden, 400, [] { return GetCorpus().schedules; },
                             [](const ScheduleCase& c) { return c.name; })),
                         GoldenCaseName());

// Every schedule has cases, accepted and rejected ones, in the corpus.
TEST(ScheduleGoldenCoverage, EveryScheduleHasCases) {
  for (ScheduleKind kind : kAllScheduleKinds) {
    int accepted = 0, lowered = 0;
    for (const ScheduleCase& c : GetCorpus().schedules) {
      if (c.schedule != ScheduleName(kind)) continue;
      if (!c.error.has_value() || c.error->phase == "lower") ++accepted;
      if (!c.lowered.empty()) ++lowered;
    }
    EXPECT_GT(accepted, 5) << ScheduleName(kind);
    // PyTorch's own 1F1B order never validates (see ComputeOrder).
    if (kind != ScheduleKind::k1F1B) {
      EXPECT_GT(lowered, 5) << ScheduleName(kind);
    }
  }
}

// ------------------------------------------------------------- _format_pipeline_order

class FormatGoldenTest : public ::testing::TestWithParam<GoldenCase<FormatCase>> {};

TEST_P(FormatGoldenTest, ByteIdentical) {
  ASSERT_GOLDEN_CASE_LOADED();
  const FormatCase& f = *GetParam();
  const ScheduleCase& c = *GetCorpus().by_name.at(f.name);
  EXPECT_EQ(FormatPipelineOrder(ParseOrder(c.compute), f.error_step), f.text);
}

INSTANTIATE_TEST_SUITE_P(Golden, FormatGoldenTest,
                         ::testing::ValuesIn(GoldenCases<FormatCase>(
                             kGolden, 5, [] { return GetCorpus().formats; },
                             [](const FormatCase& c) { return c.name + (c.error_step ? "_error_step" : ""); })),
                         GoldenCaseName());

// --------------------------------------------------------------------------- CSV files

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteAll(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

class CsvGoldenTest : public ::testing::TestWithParam<GoldenCase<CsvCase>> {};

TEST_P(CsvGoldenTest, DumpIsPyTorchsAndReadsBack) {
  ASSERT_GOLDEN_CASE_LOADED();
  const CsvCase& c = *GetParam();
  const PipelineOrder order = ParseOrder(GetCorpus().by_name.at(c.name)->compute);
  const std::string path = ::fsdp::testing::NewTestPath("schedule") + ".csv";
  WriteScheduleCsv(order, path);
  EXPECT_EQ(ReadAll(path), c.text);
  EXPECT_EQ(ReadScheduleCsv(path), order);
}

INSTANTIATE_TEST_SUITE_P(Golden, CsvGoldenTest,
                         ::testing::ValuesIn(GoldenCases<CsvCase>(
                             kGolden, 3, [] { return GetCorpus().csvs; }, [](const CsvCase& c) { return c.name; })),
                         GoldenCaseName());

// A user's compute-only schedule from a CSV file, lowered as PyTorch's _load_csv lowers it
// (the stage mapping is the one the schedule implies).
class CustomGoldenTest : public ::testing::TestWithParam<GoldenCase<CustomCase>> {};

TEST_P(CustomGoldenTest, ReadAndLoweredAsPyTorch) {
  ASSERT_GOLDEN_CASE_LOADED();
  const CustomCase& c = *GetParam();
  const std::string path = ::fsdp::testing::NewTestPath("custom") + ".csv";
  WriteAll(path, c.csv);
  const PipelineOrder compute = ReadScheduleCsv(path);
  ExpectOrder(c.compute, compute, "compute order read from CSV");
  auto lower = [&] {
    const std::map<int, int> mapping = ValidateSchedule(compute, static_cast<int>(compute.size()), c.num_stages, c.n);
    return LowerWithComms(
        compute, c.n, [&](int s) { return mapping.at(s); }, c.num_stages, c.options);
  };
  if (c.error.has_value()) {
    ExpectPyTorchError(lower, *c.error, "LowerWithComms");
  } else {
    ExpectLowered(c.lowered, lower(), "lowered order");
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, CustomGoldenTest,
                         ::testing::ValuesIn(GoldenCases<CustomCase>(
                             kGolden, 3, [] { return GetCorpus().customs; },
                             [](const CustomCase& c) { return c.name; })),
                         GoldenCaseName());

// ------------------------------------------------------------------- _Action.from_str

TEST(ActionParseGolden, AsPyTorchFromStr) {
  ASSERT_GE(GetCorpus().parses.size(), 20u);
  for (const ParseCase& p : GetCorpus().parses) {
    SCOPED_TRACE("text '" + p.text + "'");
    ASSERT_FALSE(p.result.empty());
    if (p.result[0] == "error") {
      ExpectPyTorchError([&] { Action::Parse(p.text); }, GoldenError{"parse", p.result.at(1), p.result.at(2)}, "Parse");
      continue;
    }
    const std::optional<Action> a = Action::Parse(p.text);
    EXPECT_EQ(a.has_value() ? a->ToString() : "None", p.result[0]);
  }
}

TEST(Action, ToStringParseRoundTripOverEveryType) {
  for (ActionType type : kAllActionTypes) {
    EXPECT_EQ(ActionTypeFromName(ActionTypeName(type)), type);
    if (type == ActionType::kOverlapFB) continue;
    for (std::optional<int> mb : {std::optional<int>(), std::optional<int>(0), std::optional<int>(17)}) {
      const Action a{12, type, mb, {}};
      const std::string text = a.ToString();
      EXPECT_EQ(text, absl::StrCat(12, std::string(ActionTypeName(type)), mb ? std::to_string(*mb) : ""));
      EXPECT_EQ(Action::Parse(text), a) << text;
    }
  }
  const Action overlap{-1,
                       ActionType::kOverlapFB,
                       std::nullopt,
                       {Action{0, ActionType::kForward, 3, {}}, Action{1, ActionType::kFullBackward, 2, {}}}};
  EXPECT_EQ(overlap.ToString(), "(0F3;1B2)OVERLAP_F_B");
  EXPECT_EQ(Action::Parse(overlap.ToString()), overlap);
  EXPECT_TRUE(overlap.IsCompute());
  EXPECT_EQ(ActionTypeName(ActionType::kWaitReduceGrad), "WAIT_REDUCE_GRAD");
}

TEST(Action, IsComputeIsPyTorchsIsComputeOp) {
  for (ActionType type : kAllActionTypes) {
    const bool compute = type == ActionType::kForward || type == ActionType::kBackwardInput ||
                         type == ActionType::kBackwardWeight || type == ActionType::kFullBackward ||
                         type == ActionType::kOverlapFB;
    EXPECT_EQ((Action{0, type, 0, {}}.IsCompute()), compute) << ActionTypeName(type);
  }
}

TEST(Action, BadTextIsAnErrorNamingIt) {
  EXPECT_ERROR_CONTAINS(Action::Parse("Q7"), "Invalid action string: Q7");
  EXPECT_ERROR_CONTAINS(Action::Parse("3"), "Invalid action string: 3");
  EXPECT_ERROR_CONTAINS(Action::Parse("99999999999F0"), "Invalid action string: 99999999999F0");
  EXPECT_ERROR_CONTAINS(Action::Parse("0F99999999999"), "0F99999999999");
  EXPECT_ERROR_CONTAINS(Action::Parse("(0F1;1B0)NOPE"), "Invalid computation type NOPE");
  EXPECT_ERROR_CONTAINS(Action::Parse("(0F1;zz)OVERLAP_F_B"), "Invalid action string: zz");
  EXPECT_ERROR_CONTAINS(ActionTypeFromName("f"), "Invalid computation type f");
  EXPECT_FALSE(Action::Parse(" \t ").has_value());
}

// ------------------------------------------------------------------ CSV round trips, errors

TEST(ScheduleCsv, RoundTripKeepsIdleStepsAndEmptyRanks) {
  PipelineOrder order;
  order[0] = {Action{0, ActionType::kForward, 0, {}}, std::nullopt, std::nullopt};
  order[1] = {std::nullopt};
  order[2] = {};
  order[3] = ParseList("(1F1;2B0)OVERLAP_F_B,-,3UNSHARD");
  EXPECT_EQ(ScheduleCsvText(order), "0F0,,\r\n\"\"\r\n\r\n(1F1;2B0)OVERLAP_F_B,,3UNSHARD\r\n");
  const std::string path = ::fsdp::testing::NewTestPath("roundtrip") + ".csv";
  WriteScheduleCsv(order, path);
  EXPECT_EQ(ReadScheduleCsv(path), order);
}

TEST(ScheduleCsv, ReadsPythonCsvQuotingAndLineEnds) {
  const std::string path = ::fsdp::testing::NewTestPath("quoted") + ".csv";
  WriteAll(path, "\"0F0\", 0B0 ,\"\"\n1F0\r1B0\n");
  PipelineOrder expected;
  expected[0] = ParseList("0F0,0B0,-");
  expected[1] = ParseList("1F0");
  expected[2] = ParseList("1B0");
  EXPECT_EQ(ReadScheduleCsv(path), expected);
}

TEST(ScheduleCsv, BadCellNamesFileLineAndCell) {
  const std::string path = ::fsdp::testing::NewTestPath("bad") + ".csv";
  WriteAll(path, "0F0,0B0\r\n1F0,1X0,1B0\r\n");
  EXPECT_ERROR_CONTAINS(ReadScheduleCsv(path), path + ":2: cell 2 (rank 1, step 1): Invalid action string: 1X0");
  WriteAll(path, "0F0,\"0B0\r\n");
  EXPECT_ERROR_CONTAINS(ReadScheduleCsv(path), path + ":1: unexpected end of data");
  EXPECT_ERROR_CONTAINS(ReadScheduleCsv(path + ".missing"), "cannot open the schedule CSV file " + path + ".missing");
  EXPECT_ERROR_CONTAINS(WriteScheduleCsv({}, ::fsdp::testing::NewTestPath("no_dir") + "/x.csv"),
                        "cannot write the schedule CSV file");
}

// --------------------------------------------------------- names, mappings, arguments

TEST(ScheduleKind, NamesAsGetScheduleClass) {
  for (ScheduleKind kind : kAllScheduleKinds) {
    EXPECT_EQ(ScheduleKindFromName(ScheduleName(kind)), kind);
    EXPECT_EQ(ScheduleKindFromName(absl::AsciiStrToLower(std::string(ScheduleName(kind)))), kind);
  }
  EXPECT_EQ(ScheduleKindFromName("zbvzerobubble"), ScheduleKind::kZBVZeroBubble);
  EXPECT_ERROR_CONTAINS(ScheduleKindFromName("Bogus"),
                        "Unknown schedule name 'Bogus'. The valid options are ['1F1B', 'Interleaved1F1B', 'GPipe'");
  EXPECT_ERROR_CONTAINS(ScheduleKindFromName("PipelineScheduleMulti"), "base class");
  EXPECT_TRUE(IsSingleStageSchedule(ScheduleKind::kGPipe));
  EXPECT_FALSE(IsSingleStageSchedule(ScheduleKind::kLoopedBFS));
}

TEST(ScheduleKind, StageRankLoopAndV) {
  // 3 ranks, 6 stages: loop 0 1 2 0 1 2; v 0 1 2 2 1 0.
  const std::vector<int> loop = {0, 1, 2, 0, 1, 2}, v = {0, 1, 2, 2, 1, 0};
  for (int s = 0; s < 6; ++s) {
    EXPECT_EQ(StageRank(ScheduleKind::kInterleaved1F1B, s, 3), loop[s]);
    EXPECT_EQ(StageRank(ScheduleKind::kDualPipeV, s, 3), v[s]);
  }
  EXPECT_ERROR_CONTAINS(StageRank(ScheduleKind::kGPipe, 0, 0), "num_ranks must be positive, got 0");
}

TEST(ComputeOrder, ArgumentErrorsNameTheArgument) {
  EXPECT_ERROR_CONTAINS(ComputeOrder(ScheduleKind::kGPipe, 0, 1, 4), "num_ranks must be positive, got 0");
  EXPECT_ERROR_CONTAINS(ComputeOrder(ScheduleKind::kLoopedBFS, 2, 0, 4), "stages_per_rank must be positive, got 0");
  EXPECT_ERROR_CONTAINS(ComputeOrder(ScheduleKind::kGPipe, 2, 1, 0), "n_microbatches must be positive, got 0");
  EXPECT_ERROR_CONTAINS(ComputeOrder(ScheduleKind::k1F1B, 2, 2, 4), "stages_per_rank is 2");
  EXPECT_ERROR_CONTAINS(ComputeOrder(ScheduleKind::kZBVZeroBubble, 2, 3, 4),
                        "ZBV requires exactly 2 stages per rank, but got 3.");
  EXPECT_ERROR_CONTAINS(ComputeOrder(ScheduleKind::kDualPipeV, 2, 1, 4),
                        "ZBV requires exactly 2 stages per rank, but got 1.");
}

// ------------------------------------------------------------------------ the passes

TEST(Lowering, RejectsBadOrdersAsPyTorch) {
  PipelineOrder order;
  order[0] = ParseList("0F0,0B0");
  order[1] = ParseList("1F0,1B0");
  auto loop = [](int s) { return s % 2; };
  EXPECT_EQ(LowerWithComms(order, 1, loop, 2).size(), 2u);
  EXPECT_ERROR_CONTAINS(LowerWithComms(
                            order, 1, [](int) { return 0; }, 2),
                        "the schedule runs stage 1 on rank 1, but stage_to_rank(1) is 0");
  EXPECT_ERROR_CONTAINS(LowerWithComms(order, 2, loop, 2), "Got 1 _ComputationType.FORWARD microbatches for stage 0");
  LoweringOptions zero;
  zero.max_active_stages = 0;
  EXPECT_ERROR_CONTAINS(LowerWithComms(order, 1, loop, 2, zero), "max_active_stages must be a positive integer, got 0");
  PipelineOrder missing = order;
  missing.erase(1);
  missing[2] = ParseList("1F0,1B0");
  EXPECT_ERROR_CONTAINS(ValidateSchedule(missing, 2, 2, 1), "Schedule is missing actions for rank 1");
  PipelineOrder twice = order;
  twice[1] = ParseList("1F0,0B0,1B0");
  EXPECT_ERROR_CONTAINS(ValidateSchedule(twice, 2, 2, 1), "Stage 0 is assigned to both rank 1 and rank 0");
  PipelineOrder deadlock;
  deadlock[0] = ParseList("0F0,0B0");
  deadlock[1] = ParseList("1B0,1F0");
  EXPECT_ERROR_CONTAINS(LowerWithComms(deadlock, 1, loop, 2), "Running Full Backward for stage 1, microbatch 0");
}

TEST(Lowering, SendRecvDeadlockAndWaitErrors) {
  LoweredOrder stuck;
  stuck[0] = {*Action::Parse("0B0"), *Action::Parse("0F0")};
  stuck[1] = {*Action::Parse("1F0"), *Action::Parse("1B0")};
  EXPECT_ERROR_CONTAINS(AddSendRecv(
                            stuck, [](int s) { return s; }, 2),
                        "Malformed compute schedule, can't schedule sends/recvs");
  LoweredOrder unwaited;
  unwaited[0] = {*Action::Parse("0SEND_F0"), *Action::Parse("0SEND_B1")};
  EXPECT_ERROR_CONTAINS(ValidateSendWaits(unwaited),
                        "Pipeline sends at rank 0 have no matching wait: 0SEND_F0, 0SEND_B1");
  LoweredOrder stray;
  stray[1] = {*Action::Parse("1WAIT_SEND_F0")};
  EXPECT_ERROR_CONTAINS(ValidateSendWaits(stray), "Pipeline wait 1WAIT_SEND_F0 at rank 1 has no pending send");
  LoweredOrder leftover;
  leftover[0] = {*Action::Parse("1RECV_F0"), *Action::Parse("0F0")};
  EXPECT_ERROR_CONTAINS(DeferRecvOps(leftover, [](int s) { return s; }),
                        "leftover RECV ops with no consumer found: [1RECV_F0]");
  const std::vector<std::optional<Action>> overlap = ParseList("(0F0;1B0)OVERLAP_F_B");
  EXPECT_ERROR_CONTAINS(AddUnshardReshard(overlap, 1),
                        "Atomic action (0F0;1B0)OVERLAP_F_B requires 2 stages, exceeding max_active_stages=1");
}

TEST(Lowering, ReduceGradDeferredWait) {
  const auto actions = ParseList("0B0,-,1B0,0B1,1B1");
  EXPECT_EQ(ActionsToString(AddReduceGrad(actions, 2)),
            "0B0,1B0,0B1,0REDUCE_GRAD,0WAIT_REDUCE_GRAD,1B1,1REDUCE_GRAD,1WAIT_REDUCE_GRAD");
  EXPECT_EQ(ActionsToString(AddReduceGrad(actions, 2, /*defer_reduce_grad_wait=*/true)),
            "0B0,1B0,0B1,0REDUCE_GRAD,1B1,0WAIT_REDUCE_GRAD,1REDUCE_GRAD,1WAIT_REDUCE_GRAD");
}

TEST(FormatPipelineOrder, ErrorsAndPadding) {
  EXPECT_ERROR_CONTAINS(FormatPipelineOrder({}), "no ranks");
  PipelineOrder empty;
  empty[0] = {};
  EXPECT_ERROR_CONTAINS(FormatPipelineOrder(empty), "no rank of the pipeline order has a step");
  PipelineOrder wide;
  wide[0] = ParseList("0F0");
  wide[1] = ParseList("1F0");
  EXPECT_ERROR_CONTAINS(FormatPipelineOrder(wide), "IndexError");
  PipelineOrder one;
  one[5] = ParseList("5F0,-");
  EXPECT_EQ(FormatPipelineOrder(one, 1), "        Rank 0\nStep 0: 5F0   \nStep 1:        <-- ERROR HERE\n");
}

}  // namespace
}  // namespace fsdp::pipelining
