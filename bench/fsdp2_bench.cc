// bench/fsdp2: FSDP2 (fully_shard) CPU costs that communication does not hide, single process.
//
// 1. Step/{ours,raw}/<blocks>: one training step of <blocks> tiny Linear(4, 4) layers, each
//    fully_shard'ed (ours) or plain (raw). Compute is ~nothing, so ours - raw is FSDP's
//    bookkeeping; the slope over block counts is its cost per parameter (printed at the end).
//    Rank 0 of a Fake group of 4 ranks: sharding and the reduce-scatter layout run as on 4
//    real ranks; the Fake "collectives" are a few small copy_ calls (writes a real all-gather
//    / reduce-scatter does into its output too).
// 2. CopyIn/{ours,memcpy}/<bytes>, CopyOut/{ours,memcpy}/<bytes>: the all-gather copy-in
//    (ForeachAllGather: pack every parameter's shard into this rank's slot of the flat buffer,
//    taken from FSDP's AllGatherBufferPool as in a real unshard) and copy-out (ForeachAllGatherCopyOut: split the
//    gathered buffer into each parameter's unsharded storage, re-allocated after the previous reshard freed it) at 4
//    ranks, vs Tensor::copy_ of one contiguous, reused buffer of the same bytes. <bytes> is
//    the bytes copied (copy-in: this rank's shards; copy-out: the gathered buffer). Two
//    unpaired diagnostics split the difference (see Side::kDiag).
//
// 3. PyTorch's twin (bench/peer/fsdp2_step_peer.py, run with the peer venv's Python when it is
//    there; --peer=0 skips it): the same Step model under PyTorch 2.15's fully_shard on its
//    fake process group, raw and FSDP, in the same run; the summary prints both slopes per
//    fully_shard'ed Linear and PyTorch / ours (issue goal: >= 100).
//
// Names follow tools/bench_ratio.py's "<Op>/ours/<arg>" vs "<Op>/<ref>/<arg>" pairing: the
// ratio is ours / ref time, so bandwidth as a fraction of memcpy is 1 / ratio. Everything
// runs on one intra-op thread (see main). --callgrind_iterations=N runs each benchmark N
// iterations, once (tools/callgrind_bench.sh counts the timed loops' instructions).
//
//   bazel build --config=opt //bench:fsdp2_bench
//   bazel-bin/bench/fsdp2_bench [--pair_repetitions=3] [--peer=0] --benchmark_out=bench/out/fsdp2.json
//   (from the repository root, or bazel run: the peer script is bench/peer/fsdp2_step_peer.py)
//   python3 tools/bench_ratio.py bench/out/fsdp2.json
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/callgrind_loop.h"
#include "bench/linear_stack.h"
#include "bench/pair_flags.h"
#include "bench/step_slope.h"
#include "comm/fake_process_group.h"
#include "comm/main_guard.h"
#include "comm/process_group.h"
#include "fsdp/fsdp2/fsdp_collectives.h"
#include "fsdp/fsdp2/fsdp_state.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "mesh/device_mesh.h"
#include "testing/peer_python.h"

namespace {

using fsdp::fsdp2::FSDPParam;

constexpr int kWorld = 4;  // this process is rank 0 of 4
constexpr int64_t kDim = 4;
constexpr int64_t kBatch = 8;

fsdp::mesh::DeviceMeshPtr FakeMesh() {
  return fsdp::mesh::DeviceMesh::Create(fsdp::comm::CreateFakeProcessGroup(0, kWorld), {kWorld});
}

// ---- 1. per-step bookkeeping ----

template <class Layer>
using NetImpl = fsdp::bench::LinearStackImpl<Layer>;
using RawNet = NetImpl<torch::nn::Linear>;
using ShardedLinear = fsdp::Hooked<torch::nn::LinearImpl>;
using FsdpNet = fsdp::HookedImpl<NetImpl<ShardedLinear>>;

// One step: forward, backward, SGD step, zero_grad (the optimizer sees FSDP's shards).
template <class Net>
void RunSteps(benchmark::State& state, Net& net, const std::string& label) {
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(1e-4));
  const at::Tensor x = at::randn({kBatch, kDim});
  auto step = [&] {
    net.forward(x).sum().backward();
    opt.step();
    opt.zero_grad();
  };
  for (int i = 0; i < 3; ++i) step();  // lazy init, allocator warm-up
  fsdp::bench::TimedLoop(state, label, step);
  state.counters["params"] = static_cast<double>(net.parameters().size());
}

void BM_Step(benchmark::State& state, bool ours) {
  const int64_t blocks = state.range(0);
  const std::string label = absl::StrCat(ours ? "Step/ours/" : "Step/raw/", blocks);
  if (!ours) {
    RawNet net(blocks, kDim);
    return RunSteps(state, net, label);
  }
  auto net = std::make_shared<FsdpNet>(blocks, kDim);
  const fsdp::fsdp2::FullyShardOptions options{.mesh = FakeMesh()};
  for (auto& layer : net->layers) fsdp::fsdp2::fully_shard(layer.ptr(), options);
  fsdp::fsdp2::fully_shard(net, options);
  RunSteps(state, *net, label);
}

// ---- 2. copy-in / copy-out bandwidth ----

// A group that claims rank 0 of `size` ranks and whose collectives return at once without
// touching their tensors: timing ForeachAllGather with it measures FSDP's own part of an
// all-gather (the flat buffer's allocation and the copy-in), not a stand-in collective.
class NoCommGroup final : public fsdp::comm::ProcessGroup {
 public:
  NoCommGroup(int rank, int size) : ProcessGroup(rank, size, fsdp::comm::kDefaultTimeout) {}
  std::string backend_name() const override { return "nocomm"; }

 protected:
  using WorkPtr = fsdp::comm::WorkPtr;
  static WorkPtr Done() { return fsdp::comm::MakeCompletedWork("nocomm"); }
  WorkPtr DoAllGather(const at::Tensor&, const at::Tensor&) override { return Done(); }
  WorkPtr DoReduceScatter(const at::Tensor&, const at::Tensor&, fsdp::comm::ReduceOp) override { return Done(); }
  WorkPtr DoAllReduce(const at::Tensor&, fsdp::comm::ReduceOp) override { return Done(); }
  WorkPtr DoBroadcast(const at::Tensor&, int) override { return Done(); }
  WorkPtr DoAllToAll(const at::Tensor&, const at::Tensor&, const std::vector<int64_t>&,
                     const std::vector<int64_t>&) override {
    return Done();
  }
  WorkPtr DoBarrier() override { return Done(); }
  WorkPtr DoSend(const at::Tensor&, int, int) override { return Done(); }
  WorkPtr DoRecv(const at::Tensor&, int, int) override { return Done(); }
  std::shared_ptr<ProcessGroup> DoNewSubgroup(const std::vector<int>& ranks) override {
    const auto it = std::find(ranks.begin(), ranks.end(), rank());
    if (it == ranks.end()) return nullptr;
    return std::make_shared<NoCommGroup>(static_cast<int>(it - ranks.begin()), static_cast<int>(ranks.size()));
  }
};

// Two transformer layers' parameters (24: per layer 2 LayerNorms' weight and bias, qkv [3d, d],
// proj [d, d], fc1 [4d, d], fc2 [d, 4d] and their biases) totalling about `unsharded_bytes`
// of f32, sharded on dim 0 over the 4 Fake ranks (d is a multiple of 4: no padding).
struct Params {
  std::vector<std::unique_ptr<FSDPParam>> owned;
  std::vector<FSDPParam*> ptrs;
  int64_t shard_bytes = 0;
};

Params MakeParams(int64_t unsharded_bytes) {
  constexpr int kLayers = 2;
  const int64_t d = std::max<int64_t>(4, std::llround(std::sqrt(unsharded_bytes / (4.0 * 12 * kLayers)) / 4) * 4);
  const std::vector<std::vector<int64_t>> layer = {{d}, {d}, {3 * d, d}, {3 * d}, {d, d},     {d},
                                                   {d}, {d}, {4 * d, d}, {4 * d}, {d, 4 * d}, {d}};
  const fsdp::FSDPMeshInfo mesh_info = fsdp::FSDPMeshInfo::Fsdp(FakeMesh());
  Params out;
  for (int l = 0; l < kLayers; ++l) {
    for (const auto& shape : layer) {
      out.owned.push_back(std::make_unique<FSDPParam>(at::randn(shape), fsdp::fsdp2::ParamModuleInfo{}, mesh_info,
                                                      std::nullopt, 0, fsdp::MixedPrecisionPolicy{},
                                                      fsdp::fsdp2::OffloadPolicy{}, std::nullopt));
      out.ptrs.push_back(out.owned.back().get());
      out.shard_bytes += out.owned.back()->sharded_param_data().nbytes();
    }
  }
  return out;
}

// The reference: Tensor::copy_ between contiguous byte buffers, the destination touched
// once before timing (steady state of a reused buffer).
void CopyLoop(benchmark::State& state, const char* op, int64_t bytes) {
  const at::Tensor src = at::ones({bytes}, at::kByte);
  const at::Tensor dst = at::zeros({bytes}, at::kByte);
  fsdp::bench::TimedLoop(state, absl::StrCat(op, "/memcpy/", state.range(0)), [&] { dst.copy_(src); });
  benchmark::DoNotOptimize(dst.data_ptr());
}

// kDiag splits ours - memcpy (unpaired names, which bench_ratio.py skips):
//   CopyInFreshBuffer/memcpy: one copy_ into this rank's slot of a fresh [world * bytes]
//     buffer: what copy-in cost before FSDP reused its buffers (AllGatherBufferPool);
//   CopyOutKeepStorage/ours: ForeachAllGatherCopyOut without the reshard's free in between:
//     the per-parameter copies without re-allocating the unsharded storage.
enum class Side { kOurs, kMemcpy, kDiag };

void BM_CopyIn(benchmark::State& state, Side side) {
  const Params params = MakeParams(state.range(0) * kWorld);
  const int64_t bytes = params.shard_bytes;
  if (side == Side::kOurs) {
    const auto group = std::make_shared<NoCommGroup>(0, kWorld);
    fsdp::fsdp2::AllGatherBufferPool pool;
    fsdp::bench::TimedLoop(state, absl::StrCat("CopyIn/ours/", state.range(0)), [&] {
      fsdp::fsdp2::AllGatherResult result = fsdp::fsdp2::ForeachAllGather(params.ptrs, group, &pool);
      result.event->Synchronize(fsdp::comm::kDefaultTimeout);
      benchmark::DoNotOptimize(result.output.data_ptr());
      pool.Give(std::move(result.buffer));  // what FSDP's copy-out does
    });
  } else if (side == Side::kDiag) {
    const at::Tensor src = at::ones({bytes}, at::kByte);
    for (auto _ : state) {
      at::empty({kWorld * bytes}, at::kByte).narrow(0, 0, bytes).copy_(src);
    }
  } else {
    CopyLoop(state, "CopyIn", bytes);
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_CopyOut(benchmark::State& state, Side side) {
  const Params params = MakeParams(state.range(0));
  const int64_t bytes = kWorld * params.shard_bytes;
  if (side == Side::kMemcpy) {
    CopyLoop(state, "CopyOut", bytes);
  } else {
    // A real all-gather result (the Fake group fills every rank's slot), reused every
    // iteration; each copy-out re-allocates the unsharded storage that the previous
    // iteration's FreeUnshardedParam (what reshard does) freed.
    const fsdp::fsdp2::AllGatherResult gathered =
        fsdp::fsdp2::ForeachAllGather(params.ptrs, fsdp::comm::CreateFakeProcessGroup(0, kWorld));
    const std::string label =
        absl::StrCat(side == Side::kOurs ? "CopyOut/ours/" : "CopyOutKeepStorage/ours/", state.range(0));
    fsdp::bench::TimedLoop(state, label, [&] {
      fsdp::fsdp2::AllGatherResult result = gathered;
      fsdp::fsdp2::ForeachAllGatherCopyOut(result, params.ptrs);
      benchmark::DoNotOptimize(params.ptrs.back()->all_gather_output().data_ptr());
      if (side == Side::kOurs) {
        for (FSDPParam* p : params.ptrs) p->FreeUnshardedParam();
      }
    });
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

// ---- 3. PyTorch's twin ----

// iterations > 0: each benchmark runs exactly that many iterations (for instruction counts).
void RegisterAll(int pair_repetitions, int iterations) {
  auto fixed = [iterations](benchmark::internal::Benchmark* b) {
    if (iterations > 0) b->Iterations(iterations);
  };
  // Ours and the reference alternate, repeated as pairs, so machine noise hits both alike;
  // bench_ratio.py takes the median of each side.
  for (int rep = 0; rep < pair_repetitions; ++rep) {
    for (int64_t blocks : {16, 64}) {
      for (bool ours : {true, false}) {
        fixed(benchmark::RegisterBenchmark(ours ? "Step/ours" : "Step/raw", BM_Step, ours)
                  ->Arg(blocks)
                  ->Unit(benchmark::kMicrosecond)
                  ->UseRealTime());
      }
    }
    for (int64_t mib : {1, 16, 64}) {
      using Op = std::tuple<const char*, void (*)(benchmark::State&, Side), const char*>;
      for (auto [op, fn, diag] :
           {Op{"CopyIn", BM_CopyIn, "FreshBuffer/memcpy"}, Op{"CopyOut", BM_CopyOut, "KeepStorage/ours"}}) {
        for (auto [name, side] :
             {std::pair{absl::StrCat(op, "/ours"), Side::kOurs}, std::pair{absl::StrCat(op, "/memcpy"), Side::kMemcpy},
              std::pair{absl::StrCat(op, diag), Side::kDiag}}) {
          fixed(benchmark::RegisterBenchmark(name.c_str(), fn, side)
                    ->Arg(mib << 20)
                    ->Unit(benchmark::kMicrosecond)
                    ->UseRealTime());
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain([&]() -> int {
    std::vector<char*> args(argv, argv + argc);
    const int pair_repetitions = fsdp::bench::TakePairRepetitions(args);
    const int callgrind_iterations = fsdp::bench::TakeIntFlag(args, "--callgrind_iterations=", 0);
    const bool peer = fsdp::bench::TakeIntFlag(args, "--peer=", 1) != 0 && callgrind_iterations == 0;
    // One intra-op thread: on this 2-core machine, shared with compiles, a parallel copy_ waits
    // for a descheduled worker (milliseconds, both sides alike); one core gives repeatable
    // numbers, and both sides copy with the same thread count.
    at::set_num_threads(1);
    int args_count = static_cast<int>(args.size());
    benchmark::Initialize(&args_count, args.data());
    RegisterAll(pair_repetitions, callgrind_iterations);
    fsdp::bench::StepSlopeReporter reporter("fsdp2 step", "fully_shard'ed Linear");
    benchmark::RunSpecifiedBenchmarks(&reporter);
    const char* twin = "PyTorch 2.15 FSDP2 (fake group)";
    reporter.PrintSummary(
        peer ? fsdp::bench::RunPeerStepSlope("bench/peer/fsdp2_step_peer.py", "fsdp", twin, pair_repetitions)
             : std::nullopt,
        twin);
    benchmark::Shutdown();
    return 0;
  });
}
