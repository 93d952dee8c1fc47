// The flight recorder (comm/flight_recorder.h) and its readers: what each rank issued, in
// PyTorch 2.15's dump format, read back by tools/fr_trace_lib and, for an injected hang of
// four Gloo processes, by PyTorch's own analyzer (the peer venv).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/nn/modules/linear.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "comm/fake_process_group.h"
#include "comm/faulty_process_group.h"
#include "comm/flight_recorder.h"
#include "comm/main_guard.h"
#include "comm/profiler_range.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "mesh/device_mesh.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"
#include "testing/peer_python.h"
#include "testing/test_dir.h"
#include "tools/fr_trace_lib.h"

namespace fsdp {
namespace {

using Linear = Hooked<torch::nn::LinearImpl>;

struct ThreeBlocksImpl : torch::nn::Module {
  ThreeBlocksImpl()
      : l0(register_module("l0", Linear(8, 8))),
        l1(register_module("l1", Linear(8, 8))),
        l2(register_module("l2", Linear(8, 8))) {}
  at::Tensor forward(const at::Tensor& x) { return l2(l1(l0(x))); }
  Linear l0, l1, l2;
};
using ThreeBlocks = Hooked<ThreeBlocksImpl>;

int64_t WallNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

tools::FlightDump Dumped(int rank) {
  return tools::ParseFlightDump(comm::FlightRecorder::ForRank(rank).Pickle(), rank);
}

TEST(FlightRecorder, RecordsWhatEachRankIssuedWithGroupsAndIssuer) {
  testing::RunOnRanks(testing::Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    comm::FlightRecorder::ForRank(pg->rank()).Reset();
    const comm::ProfilerLabel phase("FSDP::pre_forward (l0)"), collective("FSDP::all_gather (l0)");
    at::Tensor shard = at::ones({2, 3}), full = at::empty({4, 3});
    const int64_t before_ns = WallNs();
    {
      comm::ProfilerRange outer(phase);
      comm::ProfilerRange inner(collective);
      pg->all_gather_into_tensor(full, shard)->wait();
    }
    comm::WorkPtr pending = pg->reduce_scatter_tensor(shard, full);  // waited after the dump
    auto sub = pg->new_subgroup({0, 1}, "mesh_dp");
    at::Tensor d = at::ones({5}, at::kDouble);
    sub->all_reduce(d)->wait();
    const tools::FlightDump dump = Dumped(pg->rank());
    const int64_t after_ns = WallNs();
    pending->wait();

    EXPECT_EQ(dump.version, "2.10");
    ASSERT_EQ(dump.groups.count("0"), 1u);
    EXPECT_EQ(dump.groups.at("0").desc, "default_pg");
    EXPECT_EQ(dump.groups.at("0").ranks, (std::vector<int>{0, 1}));
    ASSERT_EQ(dump.groups.count("0.1"), 1u) << "the first subgroup of group 0";
    EXPECT_EQ(dump.groups.at("0.1").desc, "mesh_dp");
    ASSERT_EQ(dump.entries.size(), 3u);
    const tools::FlightEntry& ag = dump.entries[0];
    EXPECT_EQ(ag.profiling_name, "threaded:_all_gather_base");
    EXPECT_EQ(ag.group_name, "0");
    EXPECT_EQ(ag.seq, 1);
    EXPECT_EQ(ag.input_sizes, (std::vector<std::vector<int64_t>>{{2, 3}}));
    EXPECT_EQ(ag.output_sizes, (std::vector<std::vector<int64_t>>{{4, 3}}));
    EXPECT_EQ(ag.input_dtypes, std::vector<std::string>{"Float"});
    EXPECT_EQ(ag.state, "completed");
    EXPECT_EQ(ag.frames, (std::vector<std::string>{collective.str(), phase.str()})) << "innermost range first";
    const tools::FlightEntry& rs = dump.entries[1];
    EXPECT_EQ(rs.op(), "_reduce_scatter_base");
    EXPECT_EQ(rs.seq, 2);
    EXPECT_EQ(rs.state, "scheduled") << "not waited when dumped";
    EXPECT_TRUE(rs.frames.empty());
    const tools::FlightEntry& ar = dump.entries[2];
    EXPECT_EQ(ar.op(), "all_reduce");
    EXPECT_EQ(ar.group_name, "0.1");
    EXPECT_EQ(ar.group_desc, "mesh_dp");
    EXPECT_EQ(ar.seq, 1) << "sequence ids count per group";
    EXPECT_EQ(ar.input_dtypes, std::vector<std::string>{"Double"});
    // Wall-clock times inside the span they happened in. Entries may hold TSC ticks that the
    // dump converts through two (TSC, clock) pairs: exact but for the gap between the two reads
    // of a pair, which a preemption on a loaded machine stretches to a scheduler slice.
    constexpr int64_t kClockPairSlackNs = 50'000'000;
    EXPECT_GE(ag.time_created_ns, before_ns - kClockPairSlackNs);
    ASSERT_TRUE(ag.time_completed_ns.has_value());
    EXPECT_GE(*ag.time_completed_ns, ag.time_created_ns);
    EXPECT_LE(ag.time_created_ns, rs.time_created_ns);
    EXPECT_LE(rs.time_created_ns, ar.time_created_ns);
    EXPECT_FALSE(rs.time_completed_ns.has_value());
    ASSERT_TRUE(ar.time_completed_ns.has_value());
    EXPECT_LE(*ar.time_completed_ns, after_ns + kClockPairSlackNs);
  });
}

// Point-to-point ops are dumped as PyTorch's ProcessGroupNCCL dumps them: "send 0->1" /
// "recv 1<-0" (group ranks), is_p2p, their own p2p_seq_id, collective_seq_id 0; the group's
// collective sequence goes on without them.
TEST(FlightRecorder, RecordsSendsAndRecvsAsPointToPoint) {
  testing::RunOnRanks(testing::Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    comm::FlightRecorder::ForRank(pg->rank()).Reset();
    at::Tensor t = at::ones({3});
    if (pg->rank() == 0) {
      pg->send(t, 1, 4)->wait();
      pg->send(t, 1, 4)->wait();
    } else {
      pg->recv(t, 0, 4)->wait();
      pg->recv(t, 0, 4)->wait();
    }
    pg->all_reduce(t)->wait();
    const tools::FlightDump dump = Dumped(pg->rank());
    ASSERT_EQ(dump.entries.size(), 3u);
    const tools::FlightEntry& first = dump.entries[0];
    EXPECT_EQ(first.profiling_name, pg->rank() == 0 ? "threaded:send 0->1" : "threaded:recv 1<-0");
    EXPECT_EQ(first.op(), pg->rank() == 0 ? "send" : "recv");
    EXPECT_TRUE(first.is_p2p);
    EXPECT_EQ(first.p2p_seq, 1);
    EXPECT_EQ(first.seq, 0);
    EXPECT_EQ(dump.entries[1].p2p_seq, 2);
    EXPECT_EQ(pg->rank() == 0 ? first.input_sizes : first.output_sizes, (std::vector<std::vector<int64_t>>{{3}}));
    const tools::FlightEntry& ar = dump.entries[2];
    EXPECT_FALSE(ar.is_p2p);
    EXPECT_EQ(ar.seq, 1) << "the first collective of the group";
  });
  std::vector<tools::FlightDump> dumps = {Dumped(0), Dumped(1)};
  const std::string report = tools::DiagnoseFlightDumps(dumps);
  EXPECT_TRUE(absl::StrContains(report, "no mismatch")) << report;
}

// A hung pipeline: stage 1 forwards only the first of two microbatches to stage 2, which waits
// in its second recv; fr_trace names stage 1 as the rank that never sent.
TEST(FlightRecorder, FrTraceNamesThePipelineStageThatNeverSent) {
  std::vector<comm::WorkPtr> hung;  // stage 2's second recv, never completed
  testing::RunOnRanks(testing::Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
    comm::FlightRecorder::ForRank(pg->rank()).Reset();
    at::Tensor activation = at::ones({2, 4});
    if (pg->rank() == 0) {
      for (int mb = 0; mb < 2; ++mb) pg->send(activation, 1)->wait();
    } else if (pg->rank() == 1) {
      for (int mb = 0; mb < 2; ++mb) pg->recv(activation, 0)->wait();
      pg->send(activation, 2)->wait();  // the second microbatch is never sent on
    } else {
      pg->recv(activation, 1)->wait();
      at::Tensor second = at::zeros({2, 4});
      comm::WorkPtr pending = pg->recv(second, 1);
      EXPECT_FALSE(pending->is_completed());
      hung.push_back(pending);
    }
  });
  const std::string report = tools::DiagnoseFlightDumps({Dumped(0), Dumped(1), Dumped(2)});
  EXPECT_TRUE(absl::StrContains(report,
                                "group 0: rank 2 waits in threaded:recv 2<-1 (p2p #2, scheduled) for a send "
                                "rank 1 never issued: rank 1 sent 1 to rank 2, rank 2 posted 2 recvs from it"))
      << report;
  EXPECT_TRUE(absl::StrContains(report, "1 problem(s)")) << report;
  EXPECT_FALSE(absl::StrContains(report, "rank 0 waits")) << report;
}

TEST(FlightRecorder, DecoratorsRecordNothingTheirInnerGroupRecordsOnce) {
  auto inner = comm::CreateFakeProcessGroup(1, 2);
  auto faulty = std::make_shared<comm::FaultyProcessGroup>(inner, std::vector<comm::Fault>{});
  comm::FlightRecorder& recorder = comm::FlightRecorder::ForRank(1);
  recorder.Reset();
  at::Tensor t = at::ones({3});
  faulty->all_reduce(t)->wait();
  faulty->barrier()->wait();
  const tools::FlightDump dump = Dumped(1);
  ASSERT_EQ(dump.entries.size(), 2u);
  EXPECT_EQ(dump.entries[0].profiling_name, "fake:all_reduce");
  EXPECT_EQ(dump.entries[1].profiling_name, "fake:barrier");
  EXPECT_EQ(dump.entries[1].seq, 2);
}

TEST(FlightRecorder, RingKeepsTheLastCapacityEntries) {
  const int64_t capacity = comm::FlightRecorder::Capacity();
  ASSERT_EQ(capacity, 2000) << "PyTorch's default TORCH_FR_BUFFER_SIZE";
  auto pg = comm::CreateFakeProcessGroup(0, 1);
  comm::FlightRecorder::ForRank(0).Reset();
  at::Tensor t = at::ones({1});
  const int64_t issued = capacity + 5;
  for (int64_t i = 0; i < issued; ++i) pg->all_reduce(t)->wait();
  const tools::FlightDump dump = Dumped(0);
  ASSERT_EQ(static_cast<int64_t>(dump.entries.size()), capacity);
  EXPECT_EQ(dump.entries.front().record_id, issued - capacity) << "the oldest entries left the ring";
  EXPECT_EQ(dump.entries.front().seq, issued - capacity + 1);
  EXPECT_EQ(dump.entries.back().seq, issued);
  EXPECT_EQ(comm::FlightRecorder::ForRank(0).recorded(), issued);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// PyTorch's own dump (ProcessGroupGloo's recorder; tests/testdata/gen_pytorch_fr_dump.py):
// its pickler memoizes strings (BINPUT / BINGET), and it has no frames without stack traces.
TEST(FlightRecorderReader, ReadsPyTorchsOwnGlooDump) {
  const tools::FlightDump dump =
      tools::ParseFlightDump(ReadFile("tests/testdata/pytorch_gloo_fr_dump_rank_0"), 0, "pytorch_gloo_fr_dump_rank_0");
  EXPECT_EQ(dump.version, "2.10");
  ASSERT_EQ(dump.entries.size(), 4u);
  EXPECT_EQ(dump.entries[0].profiling_name, "gloo:all_reduce");
  EXPECT_EQ(dump.entries[1].op(), "all_gather");
  EXPECT_EQ(dump.entries[1].output_sizes, (std::vector<std::vector<int64_t>>{{2, 4, 3}}));
  EXPECT_EQ(dump.entries[2].group_name, "1");
  EXPECT_EQ(dump.entries[2].group_desc, "mesh_dp");
  EXPECT_EQ(dump.entries[2].input_dtypes, std::vector<std::string>{"Double"});
  EXPECT_EQ(dump.entries[3].op(), "barrier");
  EXPECT_TRUE(dump.entries[3].frames.empty());
}

// Dumps come from disk: every truncation is an error naming the dump, every byte flip an
// error or a dump that still parses; crafted opcodes that would run code, memo cycles and
// absurd lengths are errors.
TEST(FlightRecorderReader, BadBytesAreErrorsNeverCrashes) {
  auto pg = comm::CreateFakeProcessGroup(0, 2);
  comm::FlightRecorder::ForRank(0).Reset();
  at::Tensor t = at::ones({3});
  pg->all_reduce(t)->wait();
  pg->barrier();
  const std::string good = comm::FlightRecorder::ForRank(0).Pickle();
  ASSERT_EQ(tools::ParseFlightDump(good, 0).entries.size(), 2u);
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_ERROR_CONTAINS(tools::ParseFlightDump(good.substr(0, n), 0, "cut.dump"), "cut.dump");
  }
  for (size_t k = 0; k < good.size(); ++k) {
    std::string flipped = good;
    flipped[k] = static_cast<char>(flipped[k] ^ 0x5a);
    try {
      tools::ParseFlightDump(flipped, 0, "flipped.dump");
    } catch (const c10::Error& e) {
      EXPECT_TRUE(absl::StrContains(e.what(), "flipped.dump")) << e.what();
    }
  }
  // Sequence numbers are data: a dump with #1 and #2^62 is analyzed at once, not walked.
  std::string far = good;
  const std::string key = "collective_seq_id";
  const size_t at = far.rfind(key) + key.size();
  ASSERT_EQ(far[at], 'K') << "BININT1 (a small int, as PyTorch's pickler writes it) after the last entry's key";
  far.replace(at, 2, std::string("\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x40", 10));  // LONG1 2^62
  const tools::FlightDump far_dump = tools::ParseFlightDump(far, 0);
  EXPECT_EQ(far_dump.entries[1].seq, int64_t{1} << 62);
  EXPECT_TRUE(absl::StrContains(tools::DiagnoseFlightDumps({far_dump}), "no dump from ranks {1}"));
  EXPECT_ERROR_CONTAINS(tools::ParseFlightDump("\x80\x02"
                                               "cos\nsystem\n.",
                                               0, "global.dump"),
                        "global.dump: byte 2: unsupported pickle opcode 0x63");
  // A list holding itself.
  EXPECT_ERROR_CONTAINS(tools::ParseFlightDump(std::string("\x80\x02]q\x00h\x00"
                                                           "a.",
                                                           9),
                                               0, "cycle.dump"),
                        "cycle.dump: byte 7: the pickle puts a value into itself");
  EXPECT_ERROR_CONTAINS(tools::ParseFlightDump(std::string("\x80\x02X\xff\xff\xff\xff", 7), 0, "long.dump"),
                        "long.dump: byte 2: an operand of 4294967295 bytes runs past the end");
}

// How long a dump on request may take to appear: generous, a named bound, never a timing check.
constexpr auto kDumpDeadline = std::chrono::seconds(60);

bool WaitForFile(const std::string& path) {
  const auto deadline = std::chrono::steady_clock::now() + kDumpDeadline;
  while (::access(path.c_str(), R_OK) != 0) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// On request: SIGUSR1 (the handler RunMain installs) and the API write every rank's dump.
TEST(FlightRecorder, SignalAndApiDumpEveryRankOfTheProcess) {
  const std::string prefix = testing::NewTestPath("fr_signal") + "_rank_";
  ::setenv("TORCH_FR_DUMP_TEMP_FILE", prefix.c_str(), 1);
  auto pg = comm::CreateFakeProcessGroup(3, 4);
  comm::FlightRecorder::ForRank(3).Reset();
  at::Tensor t = at::ones({2});
  pg->all_reduce(t)->wait();
  ASSERT_TRUE(comm::InstallFlightRecorderDumpSignal(SIGUSR1)) << "SIGUSR1 had its default action";
  ASSERT_EQ(::raise(SIGUSR1), 0);
  ASSERT_TRUE(WaitForFile(prefix + "3")) << "no dump at " << prefix << "3";
  const tools::FlightDump dump = tools::ParseFlightDump(ReadFile(prefix + "3"), 3);
  ASSERT_FALSE(dump.entries.empty());
  EXPECT_EQ(dump.entries.back().profiling_name, "fake:all_reduce");
  std::remove((prefix + "3").c_str());
  const std::vector<std::string> paths = comm::DumpFlightRecorders();
  EXPECT_NE(std::find(paths.begin(), paths.end(), prefix + "3"), paths.end());
  EXPECT_TRUE(WaitForFile(prefix + "3"));
  ::unsetenv("TORCH_FR_DUMP_TEMP_FILE");
}

// RunMain's error exit writes the dump before its one line.
TEST(FlightRecorderDeathTest, RunMainErrorExitDumps) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // The same path in the death test's child, which runs this body again in another process.
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string prefix = std::string(tmp != nullptr ? tmp : "/tmp") + "/fr_exit_rank_";
  ::setenv("TORCH_FR_DUMP_TEMP_FILE", prefix.c_str(), 1);
  ::setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1", 1);
  EXPECT_EXIT(comm::RunMain([]() -> int {
                auto pg = comm::CreateFakeProcessGroup(1, 2);
                at::Tensor t = at::ones({2});
                pg->broadcast(t, 0)->wait();
                TORCH_CHECK(false, "the body failed");
              }),
              ::testing::ExitedWithCode(1), "flight recorder: error exit; wrote .*fr_exit.*_rank_1");
  ::setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0", 1);
  ::unsetenv("TORCH_FR_DUMP_TEMP_FILE");
  const tools::FlightDump dump = tools::ParseFlightDump(ReadFile(prefix + "1"), 1);
  ASSERT_FALSE(dump.entries.empty());
  EXPECT_EQ(dump.entries.back().profiling_name, "fake:broadcast");
}

// Three FSDP2 blocks on four Gloo processes; rank 2's all-gather of block l1 in the first
// forward fails at once (FaultyProcessGroup: its Gloo group never sees it), so ranks 0, 1
// and 3 wait on it until their collective timeout.
TEST(FlightRecorder, HangOfFourGlooRanksNamesTheRankThatSkippedTheAllGather) {
  std::string dir;
  if (!testing::IsRankProcess()) {
    dir = testing::NewTestPath("fr_hang");
    ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0) << dir;
    // The rank processes inherit these (the suite turns the dumps after failures off).
    ::setenv("TORCH_FR_DUMP_TEMP_FILE", (dir + "/nccl_trace_rank_").c_str(), 1);
    ::setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1", 1);
  }
  testing::RunOptions options;
  options.collective_timeout = comm::Timeout(5000);
  const auto outcomes = testing::RunOnRanksCollect(
      testing::Backend::kGlooProcesses, 4,
      [](const comm::ProcessGroupPtr& gloo) {
        std::vector<comm::Fault> faults;
        if (gloo->rank() == 2)
          faults.push_back({.kind = comm::Fault::Kind::kFail, .index = 1, .op = "all_gather_into_tensor"});
        auto pg = std::make_shared<comm::FaultyProcessGroup>(gloo, faults);
        auto mesh = mesh::DeviceMesh::Create(pg, {4});
        ThreeBlocks model;
        for (const auto& block : {model->l0.ptr(), model->l1.ptr(), model->l2.ptr()}) {
          fsdp2::fully_shard(block, {.mesh = mesh});
        }
        fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
        try {
          model(at::ones({2, 8})).sum().backward();
        } catch (...) {
          // What RunMain does before it ends a program after an error (comm/main_guard.h).
          comm::DumpFlightRecordersAfterFailure("error exit");
          throw;
        }
      },
      options);
  if (testing::IsRankProcess()) return;
  ASSERT_EQ(outcomes.size(), 4u);
  EXPECT_FALSE(outcomes[2].ok);
  EXPECT_TRUE(absl::StrContains(outcomes[2].message, "injected fault")) << outcomes[2].message;
  for (int r : {0, 1, 3}) EXPECT_FALSE(outcomes[r].ok) << "rank " << r << " waits on an all-gather rank 2 never joins";

  const std::vector<tools::FlightDump> dumps = tools::ReadFlightDumps(dir);
  ASSERT_EQ(dumps.size(), 4u) << "one dump per rank";
  const std::string ours = tools::DiagnoseFlightDumps(dumps);
  EXPECT_TRUE(absl::StrContains(ours, "Not all ranks joining collective")) << ours;
  EXPECT_TRUE(absl::StrContains(ours, "missing ranks: {2}")) << ours;
  EXPECT_TRUE(absl::StrContains(ours, "collective: gloo:_all_gather_base")) << ours;
  EXPECT_TRUE(absl::StrContains(ours, "FSDP::all_gather (l1)")) << "the issuer: block 1's all-gather\n" << ours;

  std::string why_not;
  const std::string python = testing::PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << "PyTorch's fr_trace not run: " << why_not;
  std::string theirs;
  const int status = testing::RunCommand(
      python + " -m torch.distributed.flight_recorder.fr_trace --print_stack_trace " + dir, &theirs);
  ASSERT_EQ(status, 0) << theirs;
  EXPECT_TRUE(absl::StrContains(theirs, "Not all ranks joining collective")) << theirs;
  EXPECT_TRUE(absl::StrContains(theirs, "missing ranks: {2}")) << theirs;
  EXPECT_TRUE(absl::StrContains(theirs, "collective: gloo:_all_gather_base")) << theirs;
  EXPECT_TRUE(absl::StrContains(theirs, "FSDP::all_gather (l1)")) << theirs;
}

}  // namespace
}  // namespace fsdp
