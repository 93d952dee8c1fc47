// Fake backend semantics, argument validation (every backend shares it), the decorator base
// and CommTrace byte accounting, the torchrun environment contract and the multi-rank runner itself.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/c10d_process_group.h"
#include "comm/comm_trace.h"
#include "comm/fake_process_group.h"
#include "comm/forwarding_process_group.h"
#include "comm/internal/c10d_adapter.h"
#include "comm/main_guard.h"
#include "comm/process_group.h"
#include "comm/threaded_process_group.h"
#include "comm/torchrun_env.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::comm {
namespace {

using fsdp::testing::Backend;

// ------------------------------------------------------------------ Fake

TEST(FakeProcessGroup, AllGatherCopiesInputIntoEveryChunk) {
  auto pg = CreateFakeProcessGroup(/*rank=*/2, /*world_size=*/4);
  at::Tensor in = at::arange(3, at::kFloat);
  at::Tensor out = at::zeros({4, 3});
  auto work = pg->all_gather_into_tensor(out, in);
  EXPECT_TRUE(work->is_completed());
  work->wait();
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(at::equal(out[r], in)) << "chunk " << r;
  // Built on request only (no string per collective otherwise), then the same every time.
  EXPECT_EQ(work->description(), "all_gather_into_tensor Float (12 elements) on fake rank 2/4");
  EXPECT_EQ(work->description(), "all_gather_into_tensor Float (12 elements) on fake rank 2/4");
  // In place: this rank's input is its slot of the output.
  at::Tensor slot = out.view({-1}).narrow(0, 6, 3);
  slot.copy_(at::arange(3, 6, at::kFloat));
  pg->all_gather_into_tensor(out, slot)->wait();
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(at::equal(out[r], at::arange(3, 6, at::kFloat))) << "chunk " << r;
}

TEST(FakeProcessGroup, ReduceScatterTakesThisRanksChunkForAnyOp) {
  for (ReduceOp op : {ReduceOp::Sum(), ReduceOp::Avg(), ReduceOp::Max(), ReduceOp::PremulSum(3)}) {
    auto pg = CreateFakeProcessGroup(/*rank=*/1, /*world_size=*/3);
    at::Tensor in = at::arange(6, at::kFloat);
    at::Tensor out = at::zeros({2});
    pg->reduce_scatter_tensor(out, in, op)->wait();
    EXPECT_TRUE(at::equal(out, at::tensor({2.0f, 3.0f}))) << op.ToString();
  }
}

TEST(FakeProcessGroup, AllReduceBroadcastAllToAllLeaveDataAndSubgroupsWork) {
  auto pg = CreateFakeProcessGroup(3, 4);
  EXPECT_EQ(pg->backend_name(), "fake");
  at::Tensor t = at::arange(4, at::kFloat);
  pg->all_reduce(t, ReduceOp::Sum())->wait();
  pg->broadcast(t, 0)->wait();
  EXPECT_TRUE(at::equal(t, at::arange(4, at::kFloat)));
  at::Tensor out = at::full({4}, 7.0f);
  pg->all_to_all_single(out, t)->wait();
  EXPECT_TRUE(at::equal(out, at::full({4}, 7.0f)));
  pg->barrier()->wait();
  auto sub = pg->new_subgroup({1, 3});
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->rank(), 1);
  EXPECT_EQ(sub->size(), 2);
  EXPECT_EQ(pg->new_subgroup({0, 1}), nullptr);
}

// ------------------------------------------------------------------ bad input

class BadInput : public ::testing::TestWithParam<std::string> {
 protected:
  ProcessGroupPtr Group() {
    if (GetParam() == "fake") return CreateFakeProcessGroup(0, 4);
    groups_ = CreateThreadedProcessGroups(4);  // validation fails before any rendezvous
    return groups_[0];
  }
  std::vector<ProcessGroupPtr> groups_;
};

TEST_P(BadInput, AllGatherOutputNotWorldTimesInput) {
  auto pg = Group();
  EXPECT_ERROR_CONTAINS(pg->all_gather_into_tensor(at::zeros({10}), at::zeros({3})),
                        "output must have world_size (4) x input numel (3) = 12 elements, got "
                        "output Float[10] with 10");
}

TEST_P(BadInput, ReduceScatterInputNotWorldTimesOutput) {
  auto pg = Group();
  EXPECT_ERROR_CONTAINS(pg->reduce_scatter_tensor(at::zeros({3}), at::zeros({11})),
                        "input must have world_size (4) x output numel (3) = 12 elements");
}

TEST_P(BadInput, DtypeMismatch) {
  auto pg = Group();
  EXPECT_ERROR_CONTAINS(pg->all_gather_into_tensor(at::zeros({8}, at::kDouble), at::zeros({2})),
                        "output and input dtypes differ: output Double[8], input Float[2]");
  EXPECT_ERROR_CONTAINS(pg->reduce_scatter_tensor(at::zeros({2}, at::kHalf), at::zeros({8})), "dtypes differ");
}

TEST_P(BadInput, DeviceMismatch) {
  auto pg = Group();
  at::Tensor meta = at::empty({8}, at::TensorOptions().device(at::kMeta));
  EXPECT_ERROR_CONTAINS(pg->all_gather_into_tensor(meta, at::zeros({2})),
                        "output and input devices differ: output on meta, input on cpu");
}

TEST_P(BadInput, RootOutOfRange) {
  auto pg = Group();
  EXPECT_ERROR_CONTAINS(pg->broadcast(at::zeros({2}), 4), "root must be in [0, 4), got 4");
  EXPECT_ERROR_CONTAINS(pg->broadcast(at::zeros({2}), -1), "root must be in [0, 4), got -1");
}

TEST_P(BadInput, PremulSumOnIntegers) {
  auto pg = Group();
  EXPECT_ERROR_CONTAINS(pg->all_reduce(at::zeros({2}, at::kLong), ReduceOp::PremulSum(0.5)),
                        "PREMUL_SUM(0.5) needs a floating-point tensor, got Long[2]");
}

TEST_P(BadInput, AvgOnIntegers) {
  auto pg = Group();
  EXPECT_ERROR_CONTAINS(pg->reduce_scatter_tensor(at::zeros({1}, at::kInt), at::zeros({4}, at::kInt), ReduceOp::Avg()),
                        "AVG needs a floating-point tensor (integer division would truncate), got Int[4]");
}

TEST_P(BadInput, NonContiguousAndUndefinedTensors) {
  auto pg = Group();
  at::Tensor strided = at::zeros({4, 4}).t();
  EXPECT_ERROR_CONTAINS(pg->all_reduce(strided), "all_reduce: tensor must be contiguous");
  EXPECT_ERROR_CONTAINS(pg->all_reduce(at::Tensor()), "all_reduce: tensor is an undefined tensor");
}

TEST_P(BadInput, AllToAllSplits) {
  auto pg = Group();
  EXPECT_ERROR_CONTAINS(pg->all_to_all_single(at::zeros({8}), at::zeros({6})),
                        "input dim 0 (6) must divide by world_size (4)");
  EXPECT_ERROR_CONTAINS(pg->all_to_all_single(at::zeros({4}), at::zeros({4}), {1, 1, 1, 1}, {1, 1}),
                        "input_split_sizes must have world_size (4) entries, got 2");
  EXPECT_ERROR_CONTAINS(pg->all_to_all_single(at::zeros({4}), at::zeros({4}), {1, 1, 1, 1}, {1, 1, 1, 2}),
                        "input_split_sizes sum to 5 but input dim 0 is 4");
  EXPECT_ERROR_CONTAINS(pg->all_to_all_single(at::zeros({4}), at::zeros({4}), {1, 1, 3, -1}, {1, 1, 1, 1}),
                        "output_split_sizes[3] must be >= 0, got -1");
}

TEST_P(BadInput, SubgroupRanks) {
  auto pg = Group();
  EXPECT_ERROR_CONTAINS(pg->new_subgroup({0, 4}), "ranks[1] = 4 is not a rank of this group of size 4");
  EXPECT_ERROR_CONTAINS(pg->new_subgroup({2, 1}), "ranks must be sorted and unique, got [2, 1]");
}

INSTANTIATE_TEST_SUITE_P(Backends, BadInput, ::testing::Values("fake", "threaded"));

TEST(BadInput, GroupConstruction) {
  EXPECT_ERROR_CONTAINS(CreateFakeProcessGroup(4, 4), "rank must be in [0, 4), got 4");
  EXPECT_ERROR_CONTAINS(CreateFakeProcessGroup(0, 0), "size must be >= 1, got 0");
  EXPECT_ERROR_CONTAINS(CreateThreadedProcessGroups(0), "world_size must be >= 1, got 0");
  EXPECT_ERROR_CONTAINS(CreateFakeProcessGroup(0, 2, Timeout(0)), "timeout must be positive, got 0 ms");
}

TEST(BadInput, ThreadedRanksDisagreeAboutTheCollective) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const ProcessGroupPtr& pg) {
    at::Tensor t = at::zeros({4});
    WorkPtr work = pg->rank() == 0 ? pg->all_reduce(t) : pg->broadcast(t, 0);
    EXPECT_ERROR_CONTAINS(work->wait(),
                          "collective mismatch at #0: rank 0 called all_reduce(SUM) Float[4] but "
                          "rank 1 called broadcast(root=0) Float[4]");
  });
}

// ------------------------------------------------------------------ ForwardingProcessGroup

// A decorator that changes nothing: what every decorator inherits.
class PassThrough final : public ForwardingProcessGroup {
 public:
  explicit PassThrough(ProcessGroupPtr inner) : ForwardingProcessGroup(std::move(inner), "PassThrough") {}
  std::string backend_name() const override { return absl::StrCat("pass(", inner()->backend_name(), ")"); }
};

TEST(ForwardingProcessGroup, EveryHookReachesTheInnerGroup) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const ProcessGroupPtr& pg) {
    auto pass = std::make_shared<PassThrough>(pg);
    EXPECT_EQ(pass->rank(), pg->rank());
    EXPECT_EQ(pass->size(), 2);
    EXPECT_EQ(pass->timeout(), pg->timeout());
    EXPECT_EQ(pass->object_collective_device(), c10::Device(c10::kCPU));
    const float r = static_cast<float>(pg->rank());
    at::Tensor full = at::zeros({2});
    pass->all_gather_into_tensor(full, at::full({1}, r))->wait();
    EXPECT_TRUE(at::equal(full, at::arange(2, at::kFloat)));
    at::Tensor shard = at::zeros({1});
    pass->reduce_scatter_tensor(shard, at::arange(2, at::kFloat) + r)->wait();  // [0, 1] + [1, 2]
    EXPECT_EQ(shard.item<float>(), 2 * r + 1);
    at::Tensor t = at::full({3}, r + 1);
    pass->all_reduce(t, ReduceOp::Max())->wait();
    EXPECT_TRUE(at::equal(t, at::full({3}, 2.0f)));
    at::Tensor b = at::full({1}, r);
    pass->broadcast(b, 1)->wait();
    EXPECT_EQ(b.item<float>(), 1.0f);
    at::Tensor received = at::zeros({2});
    pass->all_to_all_single(received, at::full({2}, r))->wait();
    EXPECT_TRUE(at::equal(received, at::arange(2, at::kFloat)));
    pass->barrier()->wait();
    at::Tensor p2p = at::full({2}, r);
    if (pg->rank() == 0) {
      pass->send(p2p, 1, 7)->wait();
    } else {
      pass->recv(p2p, 0, 7)->wait();
      EXPECT_TRUE(at::equal(p2p, at::zeros({2})));
    }
    EXPECT_ERROR_CONTAINS(pass->broadcast(b, 2), "root must be in");
    // Subgroups are the inner group's, undecorated, unless a decorator overrides DoNewSubgroup.
    EXPECT_EQ(pass->new_subgroup({0, 1})->backend_name(), "threaded");
  });
  EXPECT_ERROR_CONTAINS(PassThrough(nullptr), "PassThrough: inner group is null");
}

// ------------------------------------------------------------------ CommTrace

TEST(CommTrace, RecordsExactBytesOfEveryCollective) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [](const ProcessGroupPtr& pg) {
    auto trace = std::make_shared<CommTrace>(pg);
    EXPECT_EQ(trace->backend_name(), "trace(threaded)");
    at::Tensor shard = at::zeros({5}, at::kBFloat16);  // 10 bytes
    at::Tensor full = at::zeros({20}, at::kBFloat16);  // 40 bytes
    trace->all_gather_into_tensor(full, shard)->wait();
    trace->reduce_scatter_tensor(at::zeros({3}, at::kDouble), at::zeros({12}, at::kDouble),
                                 ReduceOp::Avg())
        ->wait();                                                           // 96 in, 24 out
    trace->all_reduce(at::zeros({7}, at::kLong), ReduceOp::Max())->wait();  // 56
    trace->broadcast(at::zeros({2, 3}), 1)->wait();                         // 24
    // Rank r sends r + 1 rows to everyone: in 4(r+1) rows, out 1+2+3+4 rows, 4 bytes a row.
    const int64_t r1 = pg->rank() + 1;
    trace
        ->all_to_all_single(at::zeros({10, 2}, at::kHalf), at::zeros({4 * r1, 2}, at::kHalf), {1, 2, 3, 4},
                            {r1, r1, r1, r1})
        ->wait();
    trace->barrier()->wait();
    EXPECT_ERROR_CONTAINS(trace->broadcast(at::zeros({1}), 9), "root must be in");
    auto records = trace->records();
    ASSERT_EQ(records.size(), 6u);
    EXPECT_EQ(records[0].op, "all_gather_into_tensor");
    EXPECT_EQ(records[0].dtype, at::kBFloat16);
    EXPECT_EQ(records[0].input_numel, 5);
    EXPECT_EQ(records[0].input_bytes, 10);
    EXPECT_EQ(records[0].output_bytes, 40);
    EXPECT_EQ(records[0].group_size, 4);
    EXPECT_EQ(records[1].reduce_op, "AVG");
    EXPECT_EQ(records[1].input_bytes, 96);
    EXPECT_EQ(records[1].output_bytes, 24);
    EXPECT_EQ(records[2].reduce_op, "MAX");
    EXPECT_EQ(records[2].input_bytes, 56);
    EXPECT_EQ(records[3].root, 1);
    EXPECT_EQ(records[3].input_bytes, 24);
    EXPECT_EQ(records[4].input_bytes, 16 * r1);
    EXPECT_EQ(records[4].output_bytes, 40);
    EXPECT_EQ(records[5].op, "barrier");
    EXPECT_EQ(records[5].input_bytes, 0);
    EXPECT_EQ(trace->total_input_bytes(), 10 + 96 + 56 + 24 + 16 * r1);
    EXPECT_EQ(trace->total_output_bytes("all_gather_into_tensor"), 40);
    EXPECT_TRUE(absl::StrContains(trace->ToTable(), "reduce_scatter_tensor")) << trace->ToTable();
    trace->clear();
    EXPECT_TRUE(trace->records().empty());
    // Point-to-point: rank 0 sends 12 bytes to rank 1 with tag 2.
    if (pg->rank() >= 2) return;
    at::Tensor p2p = at::zeros({3});
    (pg->rank() == 0 ? trace->send(p2p, 1, 2) : trace->recv(p2p, 0, 2))->wait();
    records = trace->records();
    ASSERT_EQ(records.size(), 1u);
    EXPECT_EQ(records[0].op, pg->rank() == 0 ? "send" : "recv");
    EXPECT_EQ(records[0].peer, 1 - pg->rank());
    EXPECT_EQ(records[0].tag, 2);
    EXPECT_EQ(pg->rank() == 0 ? records[0].input_bytes : records[0].output_bytes, 12);
    EXPECT_EQ(pg->rank() == 0 ? records[0].output_bytes : records[0].input_bytes, 0);
  });
}

// CommTrace::all_records(): a world's records and those of the subgroups made from it, at any
// depth ({0, 1}, then its {1}).
TEST(CommTrace, AllRecordsGatherTheSubgroups) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [](const ProcessGroupPtr& pg) {
    auto trace = std::make_shared<CommTrace>(pg);
    trace->barrier()->wait();
    auto pair = trace->new_subgroup({0, 1});
    if (pair == nullptr) {
      EXPECT_EQ(trace->all_records().size(), 1u);
      return;
    }
    pair->all_reduce(at::zeros({2}), ReduceOp::Sum())->wait();
    auto one = pair->new_subgroup({1});
    if (one != nullptr) one->broadcast(at::zeros({1}), 0)->wait();
    const auto records = trace->all_records();
    ASSERT_EQ(records.size(), pg->rank() == 1 ? 3u : 2u);
    EXPECT_EQ(records[0].op, "barrier");
    EXPECT_EQ(records[1].op, "all_reduce");
    EXPECT_EQ(records[1].group_size, 2);
    if (pg->rank() == 1) {
      EXPECT_EQ(records[2].op, "broadcast");
    }
    EXPECT_EQ(trace->records().size(), 1u);  // its own
  });
}

// ------------------------------------------------------------------ torchrun env

std::function<std::optional<std::string>(const std::string&)> Env(std::map<std::string, std::string> vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

std::map<std::string, std::string> GoodEnv() {
  return {
      {"RANK", "2"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29500"}};
}

TEST(TorchrunEnv, ParsesValidEnvironment) {
  TorchrunEnv env = ReadTorchrunEnv(Env(GoodEnv()));
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 4);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_FALSE(env.use_agent_store);
  EXPECT_EQ(env.restart_count, 0);
}

// torchrun's elastic agent serves the store (every rank a client) and counts restarts.
TEST(TorchrunEnv, ReadsTheElasticAgentsVariables) {
  auto vars = GoodEnv();
  vars["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  vars["TORCHELASTIC_RESTART_COUNT"] = "2";
  TorchrunEnv env = ReadTorchrunEnv(Env(vars));
  EXPECT_TRUE(env.use_agent_store);
  EXPECT_EQ(env.restart_count, 2);
  vars["TORCHELASTIC_USE_AGENT_STORE"] = "False";  // Python compares with str(True) exactly
  EXPECT_FALSE(ReadTorchrunEnv(Env(vars)).use_agent_store);
  vars["TORCHELASTIC_RESTART_COUNT"] = "x";
  EXPECT_ERROR_CONTAINS(ReadTorchrunEnv(Env(vars)), "TORCHELASTIC_RESTART_COUNT must be an integer, got 'x'");
}

TEST(TorchrunEnv, InvalidValuesAreNamed) {
  const std::vector<std::tuple<std::string, std::optional<std::string>, std::string>> cases = {
      {"RANK", std::nullopt, "RANK is not set"},
      {"RANK", "two", "RANK must be an integer, got 'two'"},
      {"RANK", "4", "RANK (4) must be < WORLD_SIZE (4)"},
      {"RANK", "-1", "RANK must be in [0, 1048576], got -1"},
      {"WORLD_SIZE", "0", "WORLD_SIZE must be in [1, 1048576], got 0"},
      {"WORLD_SIZE", "", "WORLD_SIZE is set but empty"},
      {"LOCAL_RANK", "9", "LOCAL_RANK must be in [0, 3], got 9"},
      {"MASTER_ADDR", std::nullopt, "MASTER_ADDR is not set"},
      {"MASTER_PORT", "70000", "MASTER_PORT must be in [1, 65535], got 70000"},
      {"MASTER_PORT", "29500x", "MASTER_PORT must be an integer, got '29500x'"},
  };
  for (const auto& [name, value, message] : cases) {
    auto vars = GoodEnv();
    if (value)
      vars[name] = *value;
    else
      vars.erase(name);
    EXPECT_ERROR_CONTAINS(ReadTorchrunEnv(Env(vars)), message);
  }
}

// ------------------------------------------------------------------ RunMain

TEST(RunMain, ReturnsWhatTheBodyReturns) {
  EXPECT_EQ(RunMain([] { return 7; }), 7);
}

TEST(RunMain, ErrorLineIsOneLineWithoutTheBacktrace) {
  std::exception_ptr error;
  try {
    TORCH_CHECK_WITH(DistBackendError, false, "all_reduce(SUM) Float[4] failed\nsecond line");
  } catch (...) {
    error = std::current_exception();
  }
  const std::string line = ErrorLine("3", error);
  EXPECT_EQ(line, "[rank 3] error: all_reduce(SUM) Float[4] failed | second line");
  EXPECT_EQ(ErrorLine("?", std::make_exception_ptr(std::runtime_error("plain"))), "[rank ?] error: plain");
}

// A failure ends the process with one line and exit status 1: no abort, no core, no stack.
TEST(RunMainDeathTest, AnErrorEndsTheProcessWithOneLineAndStatusOne) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  setenv("RANK", "2", 1);
  EXPECT_EXIT(RunMain([]() -> int { TORCH_CHECK(false, "cannot open 'x'"); }), ::testing::ExitedWithCode(1),
              "^\\[rank 2\\] error: cannot open 'x'\n$");
  // An exception escaping another thread (std::terminate) is reported the same way.
  EXPECT_EXIT(RunMain([] {
                std::thread([] { throw std::runtime_error("from a worker thread"); }).join();
                return 0;
              }),
              ::testing::ExitedWithCode(1), "^\\[rank 2\\] error: from a worker thread\n$");
  unsetenv("RANK");
}

// ------------------------------------------------------------------ the runner

TEST(MultiRankRunner, RankThatThrowsFailsEveryRankWithItsMessage) {
  auto outcomes = fsdp::testing::RunOnRanksCollect(Backend::kThreaded, 3, [](const ProcessGroupPtr& pg) {
    if (pg->rank() == 1) throw std::runtime_error("boom from rank 1");
    at::Tensor t = at::ones({2});
    pg->all_reduce(t)->wait();
  });
  ASSERT_EQ(outcomes.size(), 3u);
  for (const auto& outcome : outcomes) {
    EXPECT_FALSE(outcome.ok) << "rank " << outcome.rank;
    EXPECT_TRUE(absl::StrContains(outcome.message, "boom from rank 1"))
        << "rank " << outcome.rank << ": " << outcome.message;
  }
}

TEST(MultiRankRunner, ProcessModeReportsEachRanksFailure) {
  if (fsdp::testing::IsRankProcess()) {
    // Inside a child the call below runs only this rank's body.
  }
  auto outcomes = fsdp::testing::RunOnRanksCollect(Backend::kGlooProcesses, 2, [](const ProcessGroupPtr& pg) {
    at::Tensor t = at::full({2}, static_cast<float>(pg->rank()));
    pg->all_reduce(t)->wait();
    if (pg->rank() == 1) throw std::runtime_error(absl::StrCat("rank 1 saw ", t[0].item<float>()));
  });
  ASSERT_EQ(outcomes.size(), 2u);
  EXPECT_TRUE(outcomes[0].ok) << outcomes[0].message;
  EXPECT_FALSE(outcomes[1].ok);
  EXPECT_EQ(outcomes[1].message, "rank 1 saw 1");
}

TEST(MultiRankRunner, ProcessModeKillsRanksPastTheDeadline) {
  fsdp::testing::RunOptions options;
  // Long enough for rank 0 to start, join the Gloo group and exit under TSan on a loaded
  // 2-core machine (3 s was not: ./x check killed rank 0 too once); rank 1 sleeps far longer.
  options.deadline = std::chrono::milliseconds(10000);
  auto outcomes = fsdp::testing::RunOnRanksCollect(
      Backend::kGlooProcesses, 2,
      [](const ProcessGroupPtr& pg) {
        if (pg->rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(60));
      },
      options);
  ASSERT_EQ(outcomes.size(), 2u);
  EXPECT_TRUE(outcomes[0].ok) << outcomes[0].message;
  EXPECT_FALSE(outcomes[1].ok);
  EXPECT_TRUE(absl::StrContains(outcomes[1].message, "still running after the deadline of 10000 ms"))
      << outcomes[1].message;
}

TEST(MultiRankRunnerDeathTest, ThreadModeDeadlockExitsWithStuckRanksNamed) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        fsdp::testing::RunOptions options;
        options.deadline = std::chrono::milliseconds(300);
        fsdp::testing::RunOnRanks(
            Backend::kThreaded, 2,
            [](const ProcessGroupPtr& pg) {
              if (pg->rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(60));
            },
            options);
      },
      ::testing::ExitedWithCode(1), "rank\\(s\\) \\[1\\] still running after the deadline of 300 ms");
}

TEST(Subgroups, ThreadedSubgroupsReduceIndependently) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 4, [](const ProcessGroupPtr& pg) {
    // Rows of a 2x2 mesh: {0,1} and {2,3}; every rank creates both, in the same order.
    auto row0 = pg->new_subgroup({0, 1});
    auto row1 = pg->new_subgroup({2, 3});
    auto mine = pg->rank() < 2 ? row0 : row1;
    ASSERT_NE(mine, nullptr);
    EXPECT_EQ(pg->rank() < 2 ? row1 : row0, nullptr);
    EXPECT_EQ(mine->rank(), pg->rank() % 2);
    at::Tensor t = at::full({3}, static_cast<float>(pg->rank()));
    mine->all_reduce(t)->wait();
    const float expected = pg->rank() < 2 ? 0 + 1 : 2 + 3;
    EXPECT_TRUE(at::equal(t, at::full({3}, expected)));
  });
}

// The transport address, as PyTorch's ProcessGroupGloo picks it: GLOO_SOCKET_IFNAME's
// interfaces when set (multi-host runs name e.g. eth0; here loopback, "lo"), else this host's
// name. An interface without an address is an error naming it.
TEST(GlooTransport, PicksTheInterfaceFromGlooSocketIfnameOrTheHostName) {
  const auto sum_of_ranks = [](const ProcessGroupPtr& pg) {
    at::Tensor t = at::full({4}, pg->rank() + 1.0, at::kFloat);
    pg->all_reduce(t)->wait();
    EXPECT_TRUE(at::equal(t, at::full({4}, 3.0, at::kFloat)));
  };
  ASSERT_EQ(::setenv("GLOO_SOCKET_IFNAME", "lo", 1), 0);
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kGlooThreads, 2, sum_of_ranks);
  ASSERT_EQ(::unsetenv("GLOO_SOCKET_IFNAME"), 0);
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kGlooThreads, 2, sum_of_ranks);
  ASSERT_EQ(::setenv("GLOO_SOCKET_IFNAME", "no_such_interface0", 1), 0);
  const auto outcomes =
      fsdp::testing::RunOnRanksCollect(fsdp::testing::Backend::kGlooThreads, 2, [](const ProcessGroupPtr&) {});
  ASSERT_EQ(::unsetenv("GLOO_SOCKET_IFNAME"), 0);
  for (const auto& o : outcomes) {
    EXPECT_FALSE(o.ok);
    EXPECT_TRUE(absl::StrContains(o.message, "no_such_interface0")) << o.message;
  }
}

// A one-rank c10d::ProcessGroupGloo on loopback, with its FileStore (fresh, under the test's
// temporary directory).
std::pair<c10::intrusive_ptr<c10d::Store>, c10::intrusive_ptr<c10d::ProcessGroupGloo>> OneRankC10dGloo(
    const std::string& store_name) {
  const std::string store_path = ::testing::TempDir() + "/" + store_name;
  std::remove(store_path.c_str());
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::FileStore>(store_path, 1);
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(kDefaultTimeout);
  gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  return {store, c10::make_intrusive<c10d::ProcessGroupGloo>(store, 0, 1, gloo_options)};
}

// The NCCL backend's device check lives in the c10d adapter (comm/nccl_process_group.cc sets
// tensor_device_type = CUDA), so it is tested here on the CPU with a c10d Gloo backend that
// is told to expect CUDA tensors: a CPU tensor is refused before the backend sees it, naming
// the collective, the argument, the backend and the tensor.
TEST(C10dAdapter, ABackendForCudaTensorsRefusesCpuTensorsNamingThem) {
  auto [store, gloo] = OneRankC10dGloo("c10d_adapter_device_store");
  internal::C10dAdapterOptions options;
  options.tensor_device_type = c10::DeviceType::CUDA;
  ProcessGroupPtr pg = internal::MakeC10dProcessGroup(gloo, options);
  const at::Tensor t = at::ones({4});
  EXPECT_ERROR_CONTAINS(pg->all_reduce(t), "all_reduce: tensor must be a CUDA tensor (gloo), got Float[4] on cpu");
  EXPECT_ERROR_CONTAINS(pg->broadcast(t, 0), "broadcast: tensor must be a CUDA tensor (gloo)");
  EXPECT_ERROR_CONTAINS(pg->all_gather_into_tensor(at::empty({4}), t),
                        "all_gather_into_tensor: output must be a CUDA tensor (gloo), got Float[4] on cpu");
  EXPECT_ERROR_CONTAINS(pg->reduce_scatter_tensor(at::empty({4}), t),
                        "reduce_scatter_tensor: output must be a CUDA tensor (gloo)");
  EXPECT_ERROR_CONTAINS(pg->all_to_all_single(at::empty({4}), t),
                        "all_to_all_single: output must be a CUDA tensor (gloo)");
  // Without the option the same backend takes CPU tensors.
  ProcessGroupPtr plain = internal::MakeC10dProcessGroup(gloo, {});
  at::Tensor u = at::ones({4});
  plain->all_reduce(u)->wait();
  EXPECT_TRUE(at::equal(u, at::ones({4})));
}

// Where host data (lengths, flags, pickled bytes) goes for a collective: the CPU for every
// backend here, the configured device for a wrapped c10d backend (NCCL's factory sets its
// CUDA device), kept by sub-groups and reported through CommTrace. (The NCCL path itself
// needs GPUs: tools/gpu_check.sh.)
TEST(C10dAdapter, ObjectCollectiveDeviceIsTheConfiguredOneAndSubgroupsAndWrappersKeepIt) {
  EXPECT_EQ(CreateFakeProcessGroup(0, 4)->object_collective_device(), c10::Device(c10::kCPU));
  auto [store, gloo] = OneRankC10dGloo("c10d_adapter_object_device_store");
  EXPECT_EQ(WrapC10dBackend(gloo)->object_collective_device(), c10::Device(c10::kCPU));
  C10dOptions options;
  options.store = store;
  options.object_collective_device = c10::Device(c10::kCUDA, 1);  // a value: no GPU is touched
  ProcessGroupPtr pg = WrapC10dBackend(gloo, options);
  EXPECT_EQ(pg->object_collective_device(), c10::Device(c10::kCUDA, 1));
  EXPECT_EQ(std::make_shared<CommTrace>(pg)->object_collective_device(), c10::Device(c10::kCUDA, 1));
  ProcessGroupPtr sub = pg->new_subgroup({0});
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->object_collective_device(), c10::Device(c10::kCUDA, 1));
  // On the CPU the host tensor itself goes into the collective (no copy).
  const at::Tensor host = at::arange(3);
  EXPECT_TRUE(ToObjectCollectiveDevice(*CreateFakeProcessGroup(0, 2), host).is_same(host));
}
}  // namespace
}  // namespace fsdp::comm
