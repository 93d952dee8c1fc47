// bench/hf: Hugging Face checkpoints of a sharded model (dcp/hf.h) per rank, vs plain file IO
// of the same bytes, and (with the peer venv) vs Python's safetensors loading the same files.
//
// The model: kLayers fully_shard'ed Linear(kDim, kDim) under a fully_shard'ed root, float32:
// ~4 B x kLayers x kDim^2 = 96 MiB, on kWorld = 2 ranks (threads of this process, Google
// Benchmark threads, thread r playing rank r; the time is the threads' mean). The checkpoint:
// SaveHuggingFace's export split at 32 MB (four files and an index).
//
// Load/ours: LoadHuggingFace(model, dir): every header and the index read and checked on each
//   rank, then each rank preads its rows of every tensor straight into its shards.
// Load/raw: each rank preads its half of every file's bytes into one buffer; then a barrier.
//   Both from the page cache (the files were just written): the format's and the loader's
//   cost, not the disk's. Goal: throughput ours/raw >= 0.8.
// Save/ours: SaveHuggingFace(model, dir2) without keep_sharded: each rank writes its shards
//   straight into their places in the export files, fsyncs them; the index last.
// Save/raw: each rank writes half the export's bytes with write(), fsync()s and closes; then
//   a barrier. Goal: throughput ours/raw >= 0.7.
// SaveSharded/{ours,raw}: the same with keep_sharded (the default, PyTorch's layout kept): the
//   per-rank files written and fsync'ed, then consolidated from them (the bytes written twice).
//
//   bazel run --config=opt //bench:hf_bench [-- --pair_repetitions=3 --peer=0 --benchmark_out=FILE.json]
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <torch/nn/modules/linear.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/linear_stack.h"
#include "bench/pair_flags.h"
#include "bench/threaded_io.h"
#include "comm/main_guard.h"
#include "comm/threaded_process_group.h"
#include "dcp/hf.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "mesh/device_mesh.h"
#include "testing/peer_python.h"

namespace {

namespace fs = std::filesystem;

constexpr int kWorld = 2;
constexpr int64_t kLayers = 24, kDim = 1024;
constexpr int64_t kShardSize = 32'000'000;
constexpr int kIterations = 3;

using ShardedLinear = fsdp::Hooked<torch::nn::LinearImpl>;
using Net = fsdp::HookedImpl<fsdp::bench::LinearStackImpl<ShardedLinear>>;

struct Rank {
  fsdp::comm::ProcessGroupPtr group;
  std::shared_ptr<Net> net;
  std::string raw_file;
  std::vector<char> raw;  // half the checkpoint's bytes
};

struct World {
  std::string dir, in, out;  // dir: everything this run writes; in: the export loaded; out: saved
  int64_t checkpoint_bytes = 0;
  std::vector<std::string> files;  // of `in`
  std::vector<Rank> ranks;
  std::unique_ptr<std::barrier<>> barrier;
};

World& TheWorld() {
  static World world;
  return world;
}

constexpr char kProgram[] = "hf_bench";

[[noreturn]] void Die(const std::string& message) { fsdp::bench::Die(kProgram, message); }

void RawWrite(const Rank& r) { fsdp::bench::WriteAndFsync(kProgram, r.raw_file, r.raw); }

// This rank's half of every file of the checkpoint, pread into the buffer.
void RawRead(Rank& r) {
  size_t at = 0;
  const int rank = r.group->rank();
  for (const std::string& path : TheWorld().files) {
    const int64_t size = static_cast<int64_t>(fs::file_size(path));
    const int64_t begin = size * rank / kWorld, end = size * (rank + 1) / kWorld;
    const size_t n = std::min<size_t>(static_cast<size_t>(end - begin), r.raw.size() - at);
    fsdp::bench::PreadRange(kProgram, path, begin, n, r.raw.data() + at);
    at += n;
  }
}

void OnRanks(const std::function<void(Rank&)>& body) { fsdp::bench::OnRanks(kProgram, TheWorld().ranks, body); }

const fsdp::dcp::HfSaveOptions kSave{.max_shard_size = kShardSize, .keep_sharded = false};

void SetUp() {
  World& w = TheWorld();
  const char* tmp = std::getenv("TMPDIR");
  w.dir = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/fsdp_hf_bench_", ::getpid());
  w.in = w.dir + "/in";
  w.out = w.dir + "/out";
  fs::create_directories(w.dir + "/raw");
  w.barrier = std::make_unique<std::barrier<>>(kWorld);
  w.ranks.resize(kWorld);
  auto groups = fsdp::comm::CreateThreadedProcessGroups(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    w.ranks[r].group = groups[r];
    w.ranks[r].raw_file = absl::StrCat(w.dir, "/raw/rank", r, ".bin");
  }
  OnRanks([&w](Rank& r) {
    const fsdp::fsdp2::FullyShardOptions options{.mesh = fsdp::mesh::DeviceMesh::Create(r.group, {kWorld})};
    r.net = std::make_shared<Net>(kLayers, kDim);
    for (auto& layer : r.net->layers) fsdp::fsdp2::fully_shard(layer.ptr(), options);
    fsdp::fsdp2::fully_shard(r.net, options);
    fsdp::dcp::SaveHuggingFace(*r.net, w.in, kSave);
  });
  for (const auto& entry : fs::directory_iterator(w.in)) {
    if (entry.path().extension() != ".safetensors") continue;
    w.files.push_back(entry.path().string());
    w.checkpoint_bytes += static_cast<int64_t>(fs::file_size(entry.path()));
  }
  std::sort(w.files.begin(), w.files.end());
  for (Rank& r : w.ranks) {
    r.raw.assign(static_cast<size_t>(w.checkpoint_bytes / kWorld + 64), 1);  // touched: no page faults timed
    RawWrite(r);
  }
}

enum class Op { kLoad, kSave, kSaveSharded };
const char* OpName(Op op) {
  switch (op) {
    case Op::kLoad: return "Load";
    case Op::kSave: return "Save";
    case Op::kSaveSharded: return "SaveSharded";
  }
  return "?";
}

void BM_HuggingFace(benchmark::State& state, Op op, bool ours) {
  World& w = TheWorld();
  Rank& r = w.ranks[state.thread_index()];
  auto body = [&] {
    if (ours) {
      if (op == Op::kLoad) {
        fsdp::dcp::LoadHuggingFace(*r.net, w.in);
      } else {
        fsdp::dcp::HfSaveOptions options = kSave;
        options.keep_sharded = op == Op::kSaveSharded;
        fsdp::dcp::SaveHuggingFace(*r.net, w.out, options);
      }
      return;
    }
    if (op != Op::kLoad) {
      RawWrite(r);
    } else {
      RawRead(r);
    }
    w.barrier->arrive_and_wait();
  };
  fsdp::bench::RunRankLoop(kProgram, state, absl::StrCat(OpName(op), " on rank ", r.group->rank()),
                           static_cast<double>(w.checkpoint_bytes) / kWorld, body);
}

void RegisterAll(int pair_repetitions) {
  for (int rep = 0; rep < pair_repetitions; ++rep) {
    for (Op op : {Op::kLoad, Op::kSave, Op::kSaveSharded}) {
      for (bool ours : {true, false}) {
        benchmark::RegisterBenchmark(absl::StrCat(OpName(op), ours ? "/ours" : "/raw").c_str(), BM_HuggingFace, op,
                                     ours)
            ->Arg(TheWorld().checkpoint_bytes)
            ->Threads(kWorld)
            ->Iterations(kIterations)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
    }
  }
}

// Python's safetensors (0.8) loading the same files whole in one process into preallocated
// tensors (safetensors.torch.load_file, what transformers' from_pretrained reads with, then a
// copy_ as load_state_dict's). Prints "PEER <median seconds>".
constexpr const char* kPeerScript = R"py(
import statistics, sys, time
from safetensors.torch import load_file
files, iters = sys.argv[2:], int(sys.argv[1])
# Into preallocated tensors, as model.load_state_dict copies them (load_file alone maps the
# file and touches nothing).
dest = {k: v.clone() for f in files for k, v in load_file(f).items()}
times = []
for _ in range(iters):
    start = time.perf_counter()
    for f in files:
        for k, v in load_file(f).items(): dest[k].copy_(v)
    times.append(time.perf_counter() - start)
print(f"PEER {statistics.median(times)}", flush=True)
)py";

std::optional<double> RunPeer(int iterations) {
  std::string why_not;
  const std::string python = fsdp::testing::PeerPythonOrCacheDefault(&why_not);
  if (python.empty()) {
    std::printf("Python safetensors load_file: skipped (%s)\n", why_not.c_str());
    return std::nullopt;
  }
  const std::string script = TheWorld().dir + "/hf_peer.py";
  std::ofstream(script) << kPeerScript;
  std::string command = absl::StrCat("'", python, "' '", script, "' ", iterations);
  for (const std::string& f : TheWorld().files) absl::StrAppend(&command, " '", f, "'");
  std::string output;
  const int status = fsdp::testing::RunCommand(command, &output);
  double seconds = 0;
  const size_t at = output.find("PEER ");
  if (status != 0 || at == std::string::npos || std::sscanf(output.c_str() + at, "PEER %lf", &seconds) != 1) {
    std::printf("Python safetensors load_file: FAILED (status %d): %s\n", status, output.c_str());
    return std::nullopt;
  }
  return seconds * 1e3;
}

class SummaryReporter : public fsdp::bench::MedianReporter {
 public:
  void PrintSummary(const std::optional<double>& peer_ms) {
    const double rank_mib = TheWorld().checkpoint_bytes / double(kWorld) / (1 << 20);
    std::printf("\nhf_bench: %d ranks (threads), checkpoint %.1f MiB in %zu files (%.1f MiB per rank), medians:\n",
                kWorld, rank_mib * kWorld, TheWorld().files.size(), rank_mib);
    std::printf("%-12s %10s %10s %16s %16s %22s\n", "op", "ours ms", "raw ms", "ours MiB/s/rank", "raw MiB/s/rank",
                "throughput ours/raw");
    for (Op op : {Op::kLoad, Op::kSave, Op::kSaveSharded}) {
      const double ours = Median(absl::StrCat(OpName(op), "/ours")), raw = Median(absl::StrCat(OpName(op), "/raw"));
      if (std::isnan(ours) || std::isnan(raw)) continue;
      const double goal = op == Op::kLoad ? 0.8 : 0.7;
      std::printf("%-12s %10.1f %10.1f %16.0f %16.0f %17.3f%s\n", OpName(op), ours, raw, rank_mib / ours * 1e3,
                  rank_mib / raw * 1e3, raw / ours, raw / ours >= goal ? "" : absl::StrCat(" (< ", goal, ")").c_str());
    }
    if (!peer_ms) return;
    const double load = Median("Load/ours");
    std::printf(
        "Python safetensors.torch.load_file + copy_ of every file, one process: %.1f ms; our sharded load on %d "
        "ranks: %.1f ms (Python / ours: %.2f)\n",
        *peer_ms, kWorld, load, *peer_ms / load);
  }
};

}  // namespace

int main(int argc, char** argv) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain([&]() -> int {
    std::vector<char*> args(argv, argv + argc);
    const int pair_repetitions = fsdp::bench::TakePairRepetitions(args);
    const bool peer = fsdp::bench::TakeIntFlag(args, "--peer=", 1) != 0;  // --peer=0: no Python run
    at::set_num_threads(1);  // the kWorld rank threads share the machine's cores
    int args_count = static_cast<int>(args.size());
    benchmark::Initialize(&args_count, args.data());
    SetUp();
    RegisterAll(pair_repetitions);
    SummaryReporter reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);
    reporter.PrintSummary(peer ? RunPeer(kIterations * pair_repetitions) : std::nullopt);
    TheWorld().ranks.clear();
    fs::remove_all(TheWorld().dir);
    benchmark::Shutdown();
    return 0;
  });
}
