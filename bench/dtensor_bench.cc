// bench/dtensor: DTensor redistribute vs the raw collective it runs (same bytes, same
// Gloo group), the planner's CPU cost per call with a cached plan, and a sequence-parallel
// MLP's forward under the tensor-parallel styles vs the same ops and collectives written
// out by hand (TPSequenceMLP: all-gather, colwise and rowwise Linear, reduce-scatter).
//
// Two ranks are two threads of this process over Gloo (a FileStore rendezvous), so the
// binary runs standalone: rank 0 runs Google Benchmark on the main thread, rank 1 mirrors
// every collective benchmark body it is told about (same op, same iteration count), so a
// --benchmark_filter keeps both ranks in step. Names follow tools/bench_ratio.py's
// "<Op>/ours/<bytes>" vs "<Op>/raw/<bytes>" pairing; <bytes> is the GLOBAL tensor size
// (all-gather output, reduce-scatter input). Planner benchmarks run on rank 0 only and have
// single-part names, which bench_ratio.py skips.
//
//   bazel build -c opt //bench:dtensor_bench
//   bazel-bin/bench/dtensor_bench [--pair_repetitions=3] --benchmark_out=bench/out/dtensor.json
//   python3 tools/bench_ratio.py bench/out/dtensor.json
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/nn/modules/linear.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "bench/pair_flags.h"
#include "comm/gloo_process_group.h"
#include "comm/main_guard.h"
#include "dtensor/dtensor.h"
#include "dtensor/redistribute.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "mesh/device_mesh.h"
#include "tensor_parallel/parallel_style.h"
#include "tensor_parallel/parallelize_module.h"

namespace {

using fsdp::dtensor::DTensor;
using fsdp::dtensor::DTensorSpec;
using fsdp::dtensor::Placement;
using fsdp::dtensor::Placements;

constexpr int kWorld = 2;
constexpr int64_t kCols = 1024;  // global tensors are [rows, 1024] f32

struct Rank {
  fsdp::comm::ProcessGroupPtr group;
  fsdp::mesh::DeviceMeshPtr mesh;     // (x=2)
  fsdp::mesh::DeviceMeshPtr mesh_2d;  // (a=2, b=1): planner cost on a 2-D mesh
};

Rank MakeRank(const std::string& store, int rank) {
  fsdp::comm::GlooOptions options;
  options.timeout = fsdp::comm::Timeout(120000);
  Rank r;
  r.group = fsdp::comm::CreateGlooProcessGroupWithFileStore(store, rank, kWorld, options);
  r.mesh = fsdp::mesh::DeviceMesh::Create(r.group, {kWorld}, {"x"});
  r.mesh_2d = fsdp::mesh::DeviceMesh::Create(r.group, {kWorld, 1}, {"a", "b"});
  return r;
}

enum class Op {
  kAllGatherOurs,
  kAllGatherRaw,
  kAllGatherRawFreshOutput,  // raw, but a new output per call as redistribute allocates
  kReduceScatterOurs,
  kReduceScatterRaw,
  kSequenceMLPOurs,
  kSequenceMLPRaw,
};

// The sequence-parallel MLP: PrepareModuleInput Shard(1) -> Replicate, w1 colwise, w2
// rowwise to Shard(1); [1, seq, kCols] activations, a narrow hidden layer (2 columns per
// rank) so that the collectives, not the matmuls, are the cost.
using HookedLinear = fsdp::Hooked<torch::nn::LinearImpl>;
constexpr int64_t kHidden = 2 * kWorld;
struct SequenceMLPImpl : torch::nn::Module {
  SequenceMLPImpl()
      : w1(register_module("w1", HookedLinear(torch::nn::LinearOptions(kCols, kHidden).bias(false)))),
        w2(register_module("w2", HookedLinear(torch::nn::LinearOptions(kHidden, kCols).bias(false)))) {}
  at::Tensor forward(const at::Tensor& x) { return w2(w1(x)); }
  HookedLinear w1, w2;
};
using SequenceMLP = fsdp::Hooked<SequenceMLPImpl>;

// Sets up op's tensors for `bytes`, lines the ranks up, then calls loop(step): the timed
// part is only what step does. Both ranks run this with the same arguments.
template <typename Loop>
void RunOp(Op op, const Rank& r, int64_t bytes, Loop&& loop) {
  const int64_t rows = bytes / 4 / kCols;
  auto sync = [&] { r.group->barrier()->wait(); };
  switch (op) {
    case Op::kAllGatherOurs: {  // Shard(0) -> Replicate
      const DTensor dt = DTensor::from_local(at::ones({rows / kWorld, kCols}), r.mesh, {Placement::Shard(0)});
      const Placements dst{Placement::Replicate()};
      sync();
      loop([&] { benchmark::DoNotOptimize(dt.redistribute(dst).to_local().data_ptr()); });
      break;
    }
    case Op::kAllGatherRaw: {
      const at::Tensor in = at::ones({rows / kWorld, kCols});
      const at::Tensor out = at::empty({rows, kCols});
      sync();
      loop([&] { r.group->all_gather_into_tensor(out, in)->wait(); });
      break;
    }
    case Op::kAllGatherRawFreshOutput: {
      const at::Tensor in = at::ones({rows / kWorld, kCols});
      sync();
      loop([&] {
        const at::Tensor out = at::empty({rows, kCols});
        r.group->all_gather_into_tensor(out, in)->wait();
        benchmark::DoNotOptimize(out.data_ptr());
      });
      break;
    }
    case Op::kReduceScatterOurs: {  // Partial -> Shard(0)
      const DTensor dt = DTensor::from_local(at::ones({rows, kCols}), r.mesh, {Placement::Partial()});
      const Placements dst{Placement::Shard(0)};
      sync();
      loop([&] { benchmark::DoNotOptimize(dt.redistribute(dst).to_local().data_ptr()); });
      break;
    }
    case Op::kReduceScatterRaw: {
      const at::Tensor in = at::ones({rows, kCols});
      const at::Tensor out = at::empty({rows / kWorld, kCols});
      sync();
      loop([&] { r.group->reduce_scatter_tensor(out, in)->wait(); });
      break;
    }
    case Op::kSequenceMLPOurs: {  // rows = the global sequence length
      SequenceMLP mlp;
      using fsdp::tensor_parallel::ColwiseParallel;
      using fsdp::tensor_parallel::RowwiseParallel;
      fsdp::tensor_parallel::parallelize_module(
          *mlp, r.mesh,
          {{"", fsdp::tensor_parallel::PrepareModuleInput({{Placement::Shard(1)}, {Placement::Replicate()}})},
           {"w1", ColwiseParallel()},
           {"w2", RowwiseParallel({.output_layouts = Placement::Shard(1)})}});
      const at::Tensor x = at::ones({1, rows / kWorld, kCols});
      at::NoGradGuard no_grad;
      sync();
      loop([&] { benchmark::DoNotOptimize(mlp(x).data_ptr()); });
      break;
    }
    case Op::kSequenceMLPRaw: {
      const at::Tensor w1 = at::ones({kHidden / kWorld, kCols}), w2 = at::ones({kCols, kHidden / kWorld});
      const at::Tensor x = at::ones({1, rows / kWorld, kCols});
      at::NoGradGuard no_grad;
      sync();
      loop([&] {
        const at::Tensor full = at::empty({1, rows, kCols});
        r.group->all_gather_into_tensor(full, x)->wait();
        const at::Tensor partial = at::linear(at::linear(full, w1), w2);
        const at::Tensor out = at::empty({1, rows / kWorld, kCols});
        r.group->reduce_scatter_tensor(out, partial)->wait();
        benchmark::DoNotOptimize(out.data_ptr());
      });
      break;
    }
  }
}

// Rank 0 tells rank 1 which collective body to mirror; quit ends rank 1.
struct Task {
  Op op;
  int64_t bytes;
  int64_t iterations;
  bool quit;
};

class Mailbox {
 public:
  void Post(Task t) {
    absl::MutexLock lock(&mu_);
    tasks_.push_back(t);
  }
  Task Take() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](std::deque<Task>* q) { return !q->empty(); }, &tasks_));
    Task t = tasks_.front();
    tasks_.pop_front();
    return t;
  }

 private:
  absl::Mutex mu_;
  std::deque<Task> tasks_ ABSL_GUARDED_BY(mu_);
};

Mailbox& Mail() {
  static Mailbox mailbox;
  return mailbox;
}

Rank& Rank0() {
  static Rank rank;
  return rank;
}

void MirrorLoop(const std::string& store) {
  try {
    const Rank r = MakeRank(store, 1);
    for (Task t = Mail().Take(); !t.quit; t = Mail().Take()) {
      RunOp(t.op, r, t.bytes, [&](auto&& step) {
        for (int64_t i = 0; i < t.iterations; ++i) step();
      });
    }
  } catch (const std::exception& e) {  // rank 0 would wait forever on a dead peer
    std::fprintf(stderr, "rank 1 failed: %s\n", e.what());
    std::abort();
  }
}

void BM_Collective(benchmark::State& state, Op op) {
  const int64_t bytes = state.range(0);
  Mail().Post({op, bytes, static_cast<int64_t>(state.max_iterations), false});
  RunOp(op, Rank0(), bytes, [&](auto&& step) {
    for (auto _ : state) step();
  });
  state.SetBytesProcessed(state.iterations() * bytes);
}

// PlanRedistribute with a warm cache: what every redistribute pays before communicating.
void BM_PlanCached(benchmark::State& state, bool two_d) {
  const DTensorSpec src = two_d ? DTensorSpec::Make(Rank0().mesh_2d, {Placement::Shard(0), Placement::Replicate()},
                                                    {4096, kCols}, at::kFloat)
                                : DTensorSpec::Make(Rank0().mesh, {Placement::Shard(0)}, {4096, kCols}, at::kFloat);
  const Placements dst =
      two_d ? Placements{Placement::Replicate(), Placement::Shard(1)} : Placements{Placement::Replicate()};
  fsdp::dtensor::PlanRedistribute(src, dst);
  for (auto _ : state) benchmark::DoNotOptimize(fsdp::dtensor::PlanRedistribute(src, dst));
}

// A cache miss (a new global shape every call): the cost of building a plan.
void BM_PlanMiss(benchmark::State& state) {
  int64_t rows = 1;
  for (auto _ : state) {
    const DTensorSpec src = DTensorSpec::Make(Rank0().mesh, {Placement::Shard(0)}, {++rows, kCols}, at::kFloat);
    benchmark::DoNotOptimize(fsdp::dtensor::PlanRedistribute(src, {Placement::Replicate()}));
  }
}

// DTensor::redistribute to its own placements: spec copy + cached no-op plan, no copy.
void BM_RedistributeNoop(benchmark::State& state) {
  const DTensor dt = DTensor::from_local(at::ones({64, 64}), Rank0().mesh, {Placement::Shard(0)});
  for (auto _ : state) {
    DTensor out = dt.redistribute(dt.placements());
    benchmark::DoNotOptimize(out);
  }
}

int64_t Iterations(int64_t bytes) {
  const int64_t budget = int64_t{256} << 20;  // ~256 MiB moved per benchmark
  return std::max<int64_t>(10, std::min<int64_t>(400, budget / bytes));
}

void RegisterAll(int pair_repetitions) {
  benchmark::RegisterBenchmark("PlanRedistribute_1D_cached", BM_PlanCached, false);
  benchmark::RegisterBenchmark("PlanRedistribute_2D_cached", BM_PlanCached, true);
  benchmark::RegisterBenchmark("PlanRedistribute_1D_miss", BM_PlanMiss);
  benchmark::RegisterBenchmark("DTensorRedistribute_noop", BM_RedistributeNoop);
  for (int64_t bytes = int64_t{1} << 20; bytes <= (int64_t{64} << 20); bytes *= 4) {
    // Ours and raw alternate, repeated as pairs, so machine noise hits both alike;
    // bench_ratio.py takes the median of each side.
    for (int rep = 0; rep < pair_repetitions; ++rep) {
      for (auto [name, ours, raw] : {std::tuple{"RedistShardToReplicate", Op::kAllGatherOurs, Op::kAllGatherRaw},
                                     std::tuple{"RedistPartialToShard", Op::kReduceScatterOurs, Op::kReduceScatterRaw},
                                     std::tuple{"TPSequenceMLP", Op::kSequenceMLPOurs, Op::kSequenceMLPRaw}}) {
        for (auto [side, op] : {std::pair{"ours", ours}, std::pair{"raw", raw}}) {
          benchmark::RegisterBenchmark(absl::StrCat(name, "/", side).c_str(), BM_Collective, op)
              ->Arg(bytes)
              ->Iterations(Iterations(bytes))
              ->UseRealTime();
        }
      }
      // Unpaired (bench_ratio.py skips it): how much of ours - raw is the fresh output.
      benchmark::RegisterBenchmark("AllGatherFreshOutput/raw", BM_Collective, Op::kAllGatherRawFreshOutput)
          ->Arg(bytes)
          ->Iterations(Iterations(bytes))
          ->UseRealTime();
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain([&]() -> int {
    std::vector<char*> args(argv, argv + argc);
    const int pair_repetitions = fsdp::bench::TakePairRepetitions(args);
    const std::string store = absl::StrCat("/tmp/fsdp_dtensor_bench_", getpid());
    std::remove(store.c_str());
    std::thread rank1(MirrorLoop, store);
    Rank0() = MakeRank(store, 0);
    int args_count = static_cast<int>(args.size());
    benchmark::Initialize(&args_count, args.data());
    RegisterAll(pair_repetitions);
    benchmark::RunSpecifiedBenchmarks();
    Mail().Post({Op::kAllGatherRaw, 0, 0, true});
    rank1.join();
    Rank0() = Rank();
    std::remove(store.c_str());
    benchmark::Shutdown();
    return 0;
  });
}
