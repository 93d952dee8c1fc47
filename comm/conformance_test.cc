// Conformance: every collective and ReduceOp on every real backend, world sizes 1-4,
// dtypes f32/f64/bf16/f16/i64, sizes including 0 and uneven splits, each compared with a
// direct computation in double precision. The NCCL backend runs the same bodies with the
// tensors on the rank's GPU (fsdp::testing::RankDevice; results copied to the CPU to
// compare); it skips, saying why, without a CUDA build, without W GPUs or without
// LibTorch's CUDA backend (testing/multi_rank.h).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/process_group.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::comm {
namespace {

using fsdp::testing::Backend;
using fsdp::testing::RankDevice;
using fsdp::testing::RunOnRanks;

// Small integers, exact in every dtype, distinct per rank and index.
double Value(int rank, int64_t i) { return static_cast<double>((rank * 7 + i * 3) % 11) - 5.0; }

// On `device` (the rank's: the CPU, or its GPU for NCCL).
at::Tensor RankTensor(int rank, int64_t numel, at::ScalarType dtype, c10::Device device, int64_t offset = 0) {
  std::vector<double> values(numel);
  for (int64_t i = 0; i < numel; ++i) values[i] = Value(rank, i + offset);
  return at::tensor(values, at::kDouble).to(dtype).to(device);
}

std::vector<double> ToDoubles(const at::Tensor& t) {
  at::Tensor d = t.to(at::kDouble).cpu().contiguous().view({-1});
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

// A reduction adds a few ranks' values in its own order, each rounding once to `dtype` (unit roundoff
// u: 2^-8 bf16, 2^-11 fp16, 2^-24 f32, 2^-53 f64), against a double expectation: a few u. bf16 2e-2 ~ 5u,
// fp16 2e-3 ~ 4u, f32 1e-6 ~ 17u; f64 1e-12 is generous (a wrong rank's value is off by order 1).
double Tolerance(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return 2e-2;
    case at::kHalf: return 2e-3;
    case at::kFloat: return 1e-6;
    case at::kDouble: return 1e-12;
    default: return 0.0;
  }
}

void ExpectValues(const at::Tensor& actual, const std::vector<double>& expected, const std::string& what) {
  std::vector<double> got = ToDoubles(actual);
  ASSERT_EQ(got.size(), expected.size()) << what;
  const double tol = Tolerance(actual.scalar_type());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], expected[i], tol * std::max(1.0, std::abs(expected[i]))) << what << " at element " << i;
  }
}

// Direct reduction of value(r, index) over ranks.
double Reduce(ReduceOp op, int world, const std::function<double(int)>& value_of_rank) {
  double acc = value_of_rank(0) * (op.kind() == ReduceOpKind::kPremulSum ? op.factor() : 1.0);
  for (int r = 1; r < world; ++r) {
    const double v = value_of_rank(r);
    switch (op.kind()) {
      case ReduceOpKind::kSum:
      case ReduceOpKind::kAvg: acc += v; break;
      case ReduceOpKind::kPremulSum: acc += v * op.factor(); break;
      case ReduceOpKind::kMax: acc = std::max(acc, v); break;
      case ReduceOpKind::kMin: acc = std::min(acc, v); break;
    }
  }
  return op.kind() == ReduceOpKind::kAvg ? acc / world : acc;
}

std::vector<ReduceOp> OpsFor(at::ScalarType dtype) {
  std::vector<ReduceOp> ops = {ReduceOp::Sum(), ReduceOp::Max(), ReduceOp::Min()};
  if (at::isFloatingType(dtype)) {
    ops.push_back(ReduceOp::Avg());
    ops.push_back(ReduceOp::PremulSum(0.5));
  }
  return ops;
}

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kLong};
const std::vector<int64_t> kNumels = {0, 1, 5, 7};

class Conformance : public ::testing::TestWithParam<std::tuple<Backend, int>> {
 protected:
  Backend backend() const { return std::get<0>(GetParam()); }
  int world() const { return std::get<1>(GetParam()); }
};

// Every test starts with this: NCCL skips (with the reason) where it cannot run.
#define SKIP_IF_UNAVAILABLE() FSDP_SKIP_IF_BACKEND_UNAVAILABLE(backend(), world())

TEST_P(Conformance, AllGatherIntoTensor) {
  SKIP_IF_UNAVAILABLE();
  RunOnRanks(backend(), world(), [b = backend()](const ProcessGroupPtr& pg) {
    const int W = pg->size();
    const c10::Device device = RankDevice(b, pg->rank());
    for (auto dtype : kDtypes) {
      for (int64_t n : kNumels) {
        at::Tensor in = RankTensor(pg->rank(), n, dtype, device);
        // Both output layouts FSDP uses: flat and [W, n].
        for (bool stacked : {false, true}) {
          at::Tensor out = stacked ? at::full({W, n}, 99, in.options()) : at::full({W * n}, 99, in.options());
          pg->all_gather_into_tensor(out, in)->wait();
          std::vector<double> expected;
          for (int r = 0; r < W; ++r) {
            for (int64_t i = 0; i < n; ++i) expected.push_back(Value(r, i));
          }
          ExpectValues(out, expected, absl::StrCat("all_gather ", c10::toString(dtype), " n=", n));
        }
      }
    }
  });
}

TEST_P(Conformance, ReduceScatterTensorEveryOp) {
  SKIP_IF_UNAVAILABLE();
  RunOnRanks(backend(), world(), [b = backend()](const ProcessGroupPtr& pg) {
    const int W = pg->size();
    const int me = pg->rank();
    const c10::Device device = RankDevice(b, me);
    for (auto dtype : kDtypes) {
      for (int64_t n : kNumels) {
        for (ReduceOp op : OpsFor(dtype)) {
          at::Tensor in = RankTensor(me, W * n, dtype, device);
          at::Tensor in_copy = in.clone();
          at::Tensor out = at::full({n}, 99, in.options());
          pg->reduce_scatter_tensor(out, in, op)->wait();
          std::vector<double> expected(n);
          for (int64_t i = 0; i < n; ++i) {
            expected[i] = Reduce(op, W, [&](int r) { return Value(r, me * n + i); });
          }
          const std::string what = absl::StrCat("reduce_scatter ", op.ToString(), " ", c10::toString(dtype), " n=", n);
          ExpectValues(out, expected, what);
          EXPECT_TRUE(at::equal(in, in_copy)) << what << ": input was modified";
        }
      }
    }
  });
}

// Whether `t` becomes the only reference to its tensor within 10 s: a backend's worker
// thread may drop its own reference to a finished collective just after wait() returned.
bool BecomesUnique(const at::Tensor& t) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (t.use_count() > 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return t.use_count() == 1;
}

// A waited collective keeps none of its tensors (nor a copy of them) while its Work lives:
// streams and events may list a finished Work for a while, and PyTorch drops its Work after
// wait(). (Before, a Gloo reduce-scatter kept its copy of the whole input until then.)
TEST_P(Conformance, AWaitedCollectiveHoldsNoTensors) {
  SKIP_IF_UNAVAILABLE();
  if (backend() == Backend::kNcclProcesses) {
    GTEST_SKIP() << "CPU backends only: a CUDA collective's c10d work keeps its tensors until it is destroyed, so "
                    "that the device can still read them after the host's wait (ProcessGroupNCCL's contract)";
  }
  RunOnRanks(backend(), world(), [b = backend()](const ProcessGroupPtr& pg) {
    const int W = pg->size();
    const c10::Device device = RankDevice(b, pg->rank());
    at::Tensor full = RankTensor(pg->rank(), W * 4, at::kFloat, device);
    at::Tensor shard = at::zeros({4}, full.options());
    WorkPtr reduce_scatter = pg->reduce_scatter_tensor(shard, full, ReduceOp::Avg());
    reduce_scatter->wait();
    EXPECT_TRUE(BecomesUnique(full)) << "reduce_scatter input";
    EXPECT_TRUE(BecomesUnique(shard)) << "reduce_scatter output";
    WorkPtr all_gather = pg->all_gather_into_tensor(full, shard);
    all_gather->wait();
    EXPECT_TRUE(BecomesUnique(full)) << "all_gather output";
    EXPECT_TRUE(BecomesUnique(shard)) << "all_gather input";
    WorkPtr all_reduce = pg->all_reduce(full, ReduceOp::Sum());
    all_reduce->wait();
    EXPECT_TRUE(BecomesUnique(full)) << "all_reduce tensor";
    EXPECT_TRUE(reduce_scatter->is_completed() && all_gather->is_completed() && all_reduce->is_completed());
    EXPECT_EQ(all_reduce->exception(), nullptr);
  });
}

TEST_P(Conformance, AllReduceEveryOp) {
  SKIP_IF_UNAVAILABLE();
  RunOnRanks(backend(), world(), [b = backend()](const ProcessGroupPtr& pg) {
    const int W = pg->size();
    const c10::Device device = RankDevice(b, pg->rank());
    for (auto dtype : kDtypes) {
      for (int64_t n : kNumels) {
        for (ReduceOp op : OpsFor(dtype)) {
          at::Tensor t = RankTensor(pg->rank(), n, dtype, device);
          pg->all_reduce(t, op)->wait();
          std::vector<double> expected(n);
          for (int64_t i = 0; i < n; ++i) {
            expected[i] = Reduce(op, W, [&](int r) { return Value(r, i); });
          }
          ExpectValues(t, expected, absl::StrCat("all_reduce ", op.ToString(), " ", c10::toString(dtype), " n=", n));
        }
      }
    }
  });
}

TEST_P(Conformance, BroadcastFromEveryRoot) {
  SKIP_IF_UNAVAILABLE();
  RunOnRanks(backend(), world(), [b = backend()](const ProcessGroupPtr& pg) {
    const c10::Device device = RankDevice(b, pg->rank());
    for (auto dtype : kDtypes) {
      for (int64_t n : kNumels) {
        for (int root = 0; root < pg->size(); ++root) {
          at::Tensor t = RankTensor(pg->rank(), n, dtype, device).view({-1});
          pg->broadcast(t, root)->wait();
          std::vector<double> expected(n);
          for (int64_t i = 0; i < n; ++i) expected[i] = Value(root, i);
          ExpectValues(t, expected, absl::StrCat("broadcast root=", root, " ", c10::toString(dtype)));
        }
      }
    }
  });
}

TEST_P(Conformance, AllToAllSingleEqualAndUnevenSplits) {
  SKIP_IF_UNAVAILABLE();
  RunOnRanks(backend(), world(), [b = backend()](const ProcessGroupPtr& pg) {
    const int W = pg->size();
    const int me = pg->rank();
    const c10::Device device = RankDevice(b, me);
    constexpr int64_t kCols = 3;
    for (auto dtype : kDtypes) {
      // Equal splits: 2 rows per peer.
      {
        at::Tensor in = RankTensor(me, 2 * W * kCols, dtype, device).view({2 * W, kCols});
        at::Tensor out = at::full({2 * W, kCols}, 99, in.options());
        pg->all_to_all_single(out, in)->wait();
        std::vector<double> expected;
        for (int j = 0; j < W; ++j) {
          for (int64_t i = 0; i < 2 * kCols; ++i) expected.push_back(Value(j, me * 2 * kCols + i));
        }
        ExpectValues(out, expected, absl::StrCat("all_to_all equal ", c10::toString(dtype)));
      }
      // Uneven splits, zeros included: rank i sends (i + j) % 3 rows to rank j.
      {
        std::vector<int64_t> in_splits(W), out_splits(W);
        for (int j = 0; j < W; ++j) {
          in_splits[j] = (me + j) % 3;
          out_splits[j] = (j + me) % 3;
        }
        int64_t in_rows = 0, out_rows = 0;
        for (int j = 0; j < W; ++j) {
          in_rows += in_splits[j];
          out_rows += out_splits[j];
        }
        at::Tensor in = RankTensor(me, in_rows * kCols, dtype, device).view({in_rows, kCols});
        at::Tensor out = at::full({out_rows, kCols}, 99, in.options());
        pg->all_to_all_single(out, in, out_splits, in_splits)->wait();
        std::vector<double> expected;
        for (int j = 0; j < W; ++j) {
          int64_t offset = 0;  // rows rank j sends to ranks before me
          for (int k = 0; k < me; ++k) offset += (j + k) % 3;
          for (int64_t i = 0; i < out_splits[j] * kCols; ++i) {
            expected.push_back(Value(j, offset * kCols + i));
          }
        }
        ExpectValues(out, expected, absl::StrCat("all_to_all uneven ", c10::toString(dtype)));
      }
    }
  });
}

TEST_P(Conformance, SeveralOutstandingCollectivesCompleteInOrder) {
  SKIP_IF_UNAVAILABLE();
  RunOnRanks(backend(), world(), [b = backend()](const ProcessGroupPtr& pg) {
    const int W = pg->size();
    const c10::Device device = RankDevice(b, pg->rank());
    constexpr int kCount = 4;
    std::vector<at::Tensor> tensors;
    std::vector<WorkPtr> works;
    for (int k = 0; k < kCount; ++k) {
      tensors.push_back(RankTensor(pg->rank(), 6, at::kFloat, device, /*offset=*/k));
      works.push_back(pg->all_reduce(tensors.back(), ReduceOp::Sum()));
    }
    at::Tensor gathered = at::empty({W * 6}, at::TensorOptions().dtype(at::kFloat).device(device));
    works.push_back(pg->all_gather_into_tensor(gathered, RankTensor(pg->rank(), 6, at::kFloat, device)));
    works.push_back(pg->barrier());
    for (int k = static_cast<int>(works.size()) - 1; k >= 0; --k) works[k]->wait();
    for (int k = 0; k < kCount; ++k) {
      std::vector<double> expected(6);
      for (int64_t i = 0; i < 6; ++i) {
        expected[i] = Reduce(ReduceOp::Sum(), W, [&](int r) { return Value(r, i + k); });
      }
      ExpectValues(tensors[k], expected, absl::StrCat("outstanding all_reduce #", k));
      EXPECT_TRUE(works[k]->is_completed());
    }
  });
}

TEST_P(Conformance, WaitWithTimeoutThrowsThenLateRankCompletesIt) {
  // NCCL, as PyTorch's ProcessGroupNCCL, aborts the communicator when a wait times out (the
  // collective would otherwise keep running on the device after the caller gave up): the
  // late rank cannot complete it there. Its timeout path is RankThatNeverJoins... below.
  if (backend() == Backend::kNcclProcesses) {
    GTEST_SKIP() << "nccl_processes: a timed-out wait aborts the communicator by design";
  }
  if (world() < 2) GTEST_SKIP() << "needs a second rank to be late";
  RunOnRanks(backend(), world(), [](const ProcessGroupPtr& pg) {
    const int W = pg->size();
    const bool late = pg->rank() == W - 1;
    if (late) std::this_thread::sleep_for(std::chrono::milliseconds(600));
    at::Tensor t = at::ones({4});
    WorkPtr work = pg->all_reduce(t);
    if (!late) {
      try {
        work->wait(std::chrono::milliseconds(50));
        ADD_FAILURE() << "wait(50ms) returned although rank " << W - 1 << " had not joined";
      } catch (const c10::Error& e) {
        const std::string message = e.what_without_backtrace();
        EXPECT_TRUE(absl::StrContains(message, "timed out after 50 ms")) << message;
        EXPECT_TRUE(absl::StrContains(message, "all_reduce(SUM)")) << message;
      }
    }
    work->wait();
    EXPECT_TRUE(at::equal(t, at::full({4}, static_cast<float>(W))));
  });
}

TEST_P(Conformance, RankThatNeverJoinsGivesTimeoutNotHang) {
  SKIP_IF_UNAVAILABLE();
  if (world() < 2) GTEST_SKIP() << "needs a rank that stays away";
  const bool nccl = backend() == Backend::kNcclProcesses;
  fsdp::testing::RunOptions options;
  // NCCL: the group timeout also bounds the TCPStore rendezvous, which waits for every rank
  // process to start and load LibTorch's CUDA backend; 1.5 s would make that flaky.
  options.collective_timeout = std::chrono::milliseconds(nccl ? 5000 : 1500);
  const auto stay_away = std::chrono::milliseconds(nccl ? 8000 : 2500);
  // NCCL is c10d's ProcessGroupNCCL: Work::wait only orders the current stream unless
  // TORCH_NCCL_BLOCKING_WAIT is set, and its watchdog would end the rank process on the
  // timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING's default). The rank processes inherit these.
  if (nccl) {
    ASSERT_EQ(::setenv("TORCH_NCCL_BLOCKING_WAIT", "1", 1), 0);
    ASSERT_EQ(::setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0", 1), 0);
  }
  RunOnRanks(
      backend(), world(),
      [b = backend(), nccl, stay_away](const ProcessGroupPtr& pg) {
        // NCCL connects peers lazily, on the host, inside a communicator's first collective
        // of a kind: without this warm-up the others would block there, not in a kernel
        // the watchdog can abort, until the absent rank's process exits.
        if (nccl) pg->barrier()->wait();
        if (pg->rank() == pg->size() - 1) {
          // Stay alive (and silent) past the others' timeout.
          std::this_thread::sleep_for(stay_away);
          return;
        }
        at::Tensor t = at::ones({8}, at::TensorOptions().device(RankDevice(b, pg->rank())));
        const auto start = std::chrono::steady_clock::now();
        try {
          pg->all_reduce(t)->wait();
          ADD_FAILURE() << "all_reduce completed without the last rank";
        } catch (const c10::Error& e) {
          const std::string message = absl::AsciiStrToLower(e.what_without_backtrace());
          // Gloo's ring: the first rank to time out closes its connections, so a rank
          // between it and the absent one may see the close before its own deadline
          // (seen once on 2 busy cores: "connection closed by peer" at 1499 ms). Either
          // way the collective ends with an error instead of hanging.
          EXPECT_TRUE(absl::StrContains(message, "timed out") ||
                      absl::StrContains(message, "connection closed by peer"))
              << message;
        }
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
      },
      options);
  if (nccl) {
    ::unsetenv("TORCH_NCCL_BLOCKING_WAIT");
    ::unsetenv("TORCH_NCCL_ASYNC_ERROR_HANDLING");
  }
}

// Point-to-point: a ring, each rank sending to the next and receiving from the previous, every
// dtype and size, as send / recv (the recv posted first) and as batch_isend_irecv.
TEST_P(Conformance, PointToPointRingEveryDtype) {
  SKIP_IF_UNAVAILABLE();
  if (world() < 2) GTEST_SKIP() << "point-to-point needs a peer";
  RunOnRanks(backend(), world(), [b = backend()](const ProcessGroupPtr& pg) {
    // Every rank's Gloo pairs connected before any rank can finish: a rank done with its
    // neighbours would close its pairs while another is still in connectFullMesh.
    pg->barrier()->wait();
    const int W = pg->size(), r = pg->rank(), next = (r + 1) % W, prev = (r + W - 1) % W;
    const c10::Device device = RankDevice(b, r);
    for (auto dtype : kDtypes) {
      for (int64_t n : kNumels) {
        for (bool batched : {false, true}) {
          at::Tensor out = RankTensor(r, n, dtype, device);
          at::Tensor in = at::full({n}, 99, out.options());
          std::vector<WorkPtr> works;
          if (batched) {
            pg->batch_isend_irecv(
                {{ProcessGroup::P2POp::Kind::kRecv, in, prev, 3}, {ProcessGroup::P2POp::Kind::kSend, out, next, 3}},
                works);
          } else {
            works = {pg->recv(in, prev, 3), pg->send(out, next, 3)};
          }
          for (const WorkPtr& w : works) w->wait();
          std::vector<double> expected;
          for (int64_t i = 0; i < n; ++i) expected.push_back(Value(prev, i));
          ExpectValues(in, expected,
                       absl::StrCat(batched ? "batch_isend_irecv " : "send/recv ", c10::toString(dtype), " n=", n));
        }
      }
    }
  });
}

// Messages from one rank to another with one tag arrive in their order; tags are separate
// channels (the recvs of tag 5 posted before those of tag 0 still get tag 5's messages).
TEST_P(Conformance, PointToPointKeepsOrderPerTag) {
  SKIP_IF_UNAVAILABLE();
  if (world() < 2) GTEST_SKIP() << "point-to-point needs a peer";
  RunOnRanks(backend(), world(), [b = backend()](const ProcessGroupPtr& pg) {
    // Every rank's Gloo pairs connected before ranks 2.. leave: they have nothing to do, and
    // closing their pairs failed rank 0's connectFullMesh ("Connection closed by peer").
    pg->barrier()->wait();
    const c10::Device device = RankDevice(b, pg->rank());
    const auto message = [&](int tag, int k) {
      return at::full({3}, static_cast<double>(tag * 10 + k), at::TensorOptions().device(device));
    };
    if (pg->rank() == 0) {
      std::vector<WorkPtr> works;
      for (int k = 0; k < 3; ++k) works.push_back(pg->send(message(0, k), 1, 0));
      for (int k = 0; k < 2; ++k) works.push_back(pg->send(message(5, k), 1, 5));
      for (const WorkPtr& w : works) w->wait();
    } else if (pg->rank() == 1) {
      std::vector<at::Tensor> got;
      std::vector<WorkPtr> works;
      for (int k = 0; k < 2; ++k) {
        got.push_back(at::zeros({3}, at::TensorOptions().device(device)));
        works.push_back(pg->recv(got.back(), 0, 5));
      }
      for (int k = 0; k < 3; ++k) {
        got.push_back(at::zeros({3}, at::TensorOptions().device(device)));
        works.push_back(pg->recv(got.back(), 0, 0));
      }
      for (const WorkPtr& w : works) w->wait();
      const std::vector<double> want = {50, 51, 0, 1, 2};
      for (size_t i = 0; i < got.size(); ++i)
        ExpectValues(got[i], {want[i], want[i], want[i]}, absl::StrCat("recv ", i));
    }
  });
}

TEST_P(Conformance, PointToPointArgumentsAreChecked) {
  SKIP_IF_UNAVAILABLE();
  if (world() < 2) GTEST_SKIP() << "point-to-point needs a peer";
  RunOnRanks(backend(), world(), [b = backend()](const ProcessGroupPtr& pg) {
    const at::Tensor t = at::ones({4}, at::TensorOptions().device(RankDevice(b, pg->rank())));
    const int W = pg->size();
    EXPECT_ERROR_CONTAINS(pg->send(t, W),
                          absl::StrCat("send: dst must be a rank of this group, in [0, ", W, "), got ", W));
    EXPECT_ERROR_CONTAINS(pg->recv(t, -1), "recv: src must be a rank of this group");
    EXPECT_ERROR_CONTAINS(pg->send(t, pg->rank()), absl::StrCat("send: dst must not be this rank (", pg->rank(), ")"));
    EXPECT_ERROR_CONTAINS(pg->recv(t, (pg->rank() + 1) % W, -2), "recv: tag must be >= 0, got -2");
    EXPECT_ERROR_CONTAINS(pg->send(at::ones({4, 4}).t(), (pg->rank() + 1) % W), "send");
    std::vector<WorkPtr> rejected;
    EXPECT_ERROR_CONTAINS(pg->batch_isend_irecv({{ProcessGroup::P2POp::Kind::kSend, t, (pg->rank() + 1) % W, 0},
                                                 {ProcessGroup::P2POp::Kind::kRecv, t, W + 3, 0}},
                                                rejected),
                          absl::StrCat("batch_isend_irecv: ops[1]: recv: src must be a rank of this group, in [0, ", W,
                                       "), got ", W + 3));
    EXPECT_TRUE(rejected.empty()) << "a valid op was issued before the bad one was found";
    // Every check above is local, so without this a rank could finish and close its Gloo pairs
    // while a slower one is still in connectFullMesh ("Connection closed by peer").
    pg->barrier()->wait();
  });
}

// A recv nobody sends to times out naming the op. Threaded: the late send then completes it;
// Gloo closes the pair on a timed-out wait (its "Application timeout caused pair closure"),
// so there the sender stays silent.
TEST_P(Conformance, RecvWaitTimesOut) {
  if (backend() == Backend::kNcclProcesses) {
    GTEST_SKIP() << "nccl_processes: a timed-out wait aborts the communicator by design";
  }
  if (world() < 2) GTEST_SKIP() << "point-to-point needs a peer";
  RunOnRanks(backend(), world(), [b = backend()](const ProcessGroupPtr& pg) {
    // Every rank's Gloo pairs connected before rank 1 times out: Gloo then closes its pair with
    // rank 0, and a rank still in connectFullMesh would fail ("Connection closed by peer").
    pg->barrier()->wait();
    const bool late_send = b == Backend::kThreaded;
    if (pg->rank() != 1) {
      // Alive past rank 1's timeout (a Gloo peer that left would close the pair first).
      std::this_thread::sleep_for(std::chrono::milliseconds(600));
      if (pg->rank() == 0 && late_send) pg->send(at::full({4}, 7.0), 1, 2)->wait();
    } else {
      at::Tensor t = at::zeros({4});
      WorkPtr work = pg->recv(t, 0, 2);
      try {
        work->wait(std::chrono::milliseconds(50));
        ADD_FAILURE() << "wait(50ms) returned although rank 0 had not sent";
      } catch (const c10::Error& e) {
        const std::string message = e.what_without_backtrace();
        EXPECT_TRUE(absl::StrContains(absl::AsciiStrToLower(message), "timed out")) << message;
        EXPECT_TRUE(absl::StrContains(message, "recv Float[4] from rank 0 tag 2")) << message;
        if (late_send) {
          EXPECT_TRUE(absl::StrContains(message, "rank 0 sent nothing")) << message;
        }
      }
      if (!late_send) return;
      work->wait();
      EXPECT_TRUE(at::equal(t, at::full({4}, 7.0)));
    }
  });
}

std::string ParamName(const ::testing::TestParamInfo<Conformance::ParamType>& info) {
  return absl::StrCat(fsdp::testing::BackendName(std::get<0>(info.param)), "_w", std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Backends, Conformance,
                         ::testing::Combine(::testing::Values(Backend::kThreaded, Backend::kGlooThreads,
                                                              Backend::kGlooProcesses, Backend::kC10dGlooThreads,
                                                              Backend::kC10dGlooProcesses),
                                            ::testing::Values(1, 2, 3, 4)),
                         ParamName);

// One process per rank on GPU cuda:rank; world sizes beyond the visible GPUs skip ("needs W
// GPUs, found N"), as does every case in a build without CUDA.
INSTANTIATE_TEST_SUITE_P(Nccl, Conformance,
                         ::testing::Combine(::testing::Values(Backend::kNcclProcesses),
                                            ::testing::Values(1, 2, 3, 4, 8)),
                         ParamName);

}  // namespace
}  // namespace fsdp::comm
