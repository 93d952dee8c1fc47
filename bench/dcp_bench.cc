// bench/dcp: distributed-checkpoint save and load throughput per rank (dcp::Save / dcp::Load),
// vs plain file IO of the same bytes, and (with the peer venv) vs PyTorch's dcp.save / load.
//
// The model: kLayers fully_shard'ed Linear(kDim, kDim) under a fully_shard'ed root, with AdamW
// after one step, so a checkpoint holds parameters + exp_avg + exp_avg_sq: ~3 x 4 B x kLayers x
// kDim^2 = 288 MiB, in kWorld = 2 shards. The ranks are threads of this process on a Threaded
// process group: every benchmark runs on kWorld Google Benchmark threads, thread r playing
// rank r (Google Benchmark lines the threads up before the timed loop; the reported time is
// the threads' mean).
//
// Save/ours/<bytes>: dcp::Save(model, &optim, dir): the state items, the torch.save encoding,
//   each rank's __<r>_0.distcp written, fsync'ed and renamed, the metadata gathered to rank 0,
//   which writes and fsyncs .metadata; Save returns once the checkpoint is complete.
// Save/raw/<bytes>: each rank writes one buffer as large as its DCP files (rank 0: its .distcp
//   + .metadata) with write(), fsync()s and closes it; then the ranks meet at a barrier (as
//   Save's completion makes them).
// Load/{ours,raw}: dcp::Load of that checkpoint into the same model and optimizer, vs each rank
//   pread()ing its raw file whole into one buffer, then a barrier. Both read the page cache (the
//   files were just written): the format's and the loader's cost, not the disk's.
// LoadCold/{ours,raw}: the same after dropping every file of both from the page cache
//   (posix_fadvise DONTNEED, untimed) before each iteration, so the reads reach the disk.
// AsyncStall/ours: what an async checkpoint costs the training step: dcp::AsyncSave with a
//   Stager (dcp/stager.h, buffers allocated at the warm-up save) until it returns (the plan's
//   agreement, the copy into the staging buffers); the previous save's write is waited for
//   untimed. AsyncStall/raw: copying as many bytes as the staged snapshot between two
//   preallocated, touched buffers (memcpy), then a barrier (AsyncSave's plan agreement makes
//   the ranks meet). Goal: ours / raw time <= 1.2. AsyncStall/staged: the same save through a
//   Stager with async_staging (torchtitan's async_with_pinned_mem), whose copy runs on a
//   worker thread after AsyncSave returned.
// StepsWithSaves/ours: the steady state of a run that checkpoints: kSaveInterval training steps
//   (forward and backward of a batch of 8, AdamW) and an AsyncSave through the Stager after the
//   last, waiting first for the previous save's write (as dcp::CheckpointManager does), which
//   meanwhile competes with the steps for the cores. StepsWithSaves/raw: the same steps, no
//   save. Reported per window of kSaveInterval steps; ours / raw is the run's slowdown.
//   StepsWithSaves/staged: the saves through the async-staging Stager, the step after a save
//   waiting for its copy before the optimizer step (torchtitan's maybe_wait_for_staging).
//
// <bytes> is the checkpoint's total size; throughput per rank is <bytes> / kWorld / time. Names
// pair as tools/bench_ratio.py expects (ratio = ours / raw time); the summary at the end prints
// the throughput ratio raw / ours time (goal >= 0.8) and, when the peer venv's Python is there
// (FSDP_PEER_PYTHON, else the ./x cache's peer venv), PyTorch's own FSDP2 + dcp.save /
// dcp.load of the same model on kWorld Gloo processes.
//
//   bazel run --config=opt //bench:dcp_bench [-- --pair_repetitions=3 --peer=0 --benchmark_out=FILE.json]
//   python3 tools/bench_ratio.py FILE.json
#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
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
#include "dcp/dcp.h"
#include "dcp/stager.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "mesh/device_mesh.h"
#include "testing/peer_python.h"

namespace {

namespace fs = std::filesystem;

constexpr int kWorld = 2;
constexpr int64_t kLayers = 24, kDim = 1024;
constexpr int kIterations = 3;     // per benchmark run; each moves ~288 MiB
constexpr int kSaveInterval = 10;  // StepsWithSaves: steps per async save

using ShardedLinear = fsdp::Hooked<torch::nn::LinearImpl>;
using Net = fsdp::HookedImpl<fsdp::bench::LinearStackImpl<ShardedLinear>>;

// One rank: its model and optimizer, and the plain-IO side's file and buffer.
struct Rank {
  fsdp::comm::ProcessGroupPtr group;
  std::shared_ptr<Net> net;
  std::unique_ptr<torch::optim::AdamW> opt;
  std::string raw_file;
  std::vector<char> raw;  // as many bytes as this rank's DCP files
  std::shared_ptr<fsdp::dcp::Stager> stager;
  std::shared_ptr<fsdp::dcp::Stager> async_stager;    // with async_staging
  std::optional<fsdp::dcp::AsyncSaveHandle> pending;  // the last AsyncStall/ours save
  at::Tensor stall_src, stall_dst;                    // as many bytes as the stager holds
};

struct World {
  std::string dir;   // everything this run writes: removed at the end
  std::string ckpt;  // dir/dcp
  int64_t checkpoint_bytes = 0;
  std::vector<Rank> ranks;
  std::unique_ptr<std::barrier<>> barrier;  // the plain-IO side's stand-in for Save's completion
};

World& TheWorld() {
  static World world;
  return world;
}

constexpr char kProgram[] = "dcp_bench";

[[noreturn]] void Die(const std::string& message) { fsdp::bench::Die(kProgram, message); }
void CheckErrno(bool ok, const char* what, const std::string& path) {
  fsdp::bench::CheckErrno(kProgram, ok, what, path);
}

// The plain-IO save and load: the whole buffer (dcp_storage's writer does the same per file,
// plus a rename; its reader preads).
void RawWrite(const Rank& r) { fsdp::bench::WriteAndFsync(kProgram, r.raw_file, r.raw); }
void RawRead(Rank& r) { fsdp::bench::PreadRange(kProgram, r.raw_file, 0, r.raw.size(), r.raw.data()); }

// Every file under `dir` out of the page cache (they are fsync'ed: clean pages, dropped).
void DropFromPageCache(const std::string& dir) {
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    CheckErrno(fd >= 0, "open", entry.path());
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

void OnRanks(const std::function<void(Rank&)>& body) { fsdp::bench::OnRanks(kProgram, TheWorld().ranks, body); }

// The sharded model with AdamW state, one checkpoint of it, and the plain-IO side's buffers
// sized from that checkpoint's files.
void SetUp() {
  World& w = TheWorld();
  const char* tmp = std::getenv("TMPDIR");
  w.dir = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/fsdp_dcp_bench_", ::getpid());
  w.ckpt = w.dir + "/dcp";
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
    r.opt = std::make_unique<torch::optim::AdamW>(r.net->parameters(), torch::optim::AdamWOptions(1e-3));
    // One step, so that AdamW has its moments (a fresh optimizer has no state to save).
    r.net->forward(at::randn({8, kDim})).sum().backward();
    r.opt->step();
    r.opt->zero_grad();
    fsdp::dcp::Save(*r.net, r.opt.get(), w.ckpt);
    // The stager's buffers, once; the memcpy side as large.
    r.stager = std::make_shared<fsdp::dcp::Stager>();
    fsdp::dcp::SaveOptions staged;
    staged.stager = r.stager;
    fsdp::dcp::AsyncSave(*r.net, r.opt.get(), w.dir + "/async", staged).wait();
    r.async_stager = std::make_shared<fsdp::dcp::Stager>(fsdp::dcp::StagerOptions{.async_staging = true});
    staged.stager = r.async_stager;
    fsdp::dcp::AsyncSave(*r.net, r.opt.get(), w.dir + "/async", staged).wait();
    r.stall_src = at::ones({r.stager->staged_bytes()}, at::kByte);
    r.stall_dst = at::zeros({r.stager->staged_bytes()}, at::kByte);
  });
  for (const auto& entry : fs::directory_iterator(w.ckpt)) w.checkpoint_bytes += fs::file_size(entry.path());
  for (int r = 0; r < kWorld; ++r) {
    Rank& rank = w.ranks[r];
    size_t bytes = fs::file_size(absl::StrCat(w.ckpt, "/__", r, "_0.distcp"));
    if (r == 0) bytes += fs::file_size(w.ckpt + "/.metadata");
    rank.raw.assign(bytes, static_cast<char>(r + 1));  // touched: no page faults inside the timing
    RawWrite(rank);                                    // for the Load/raw benchmarks
  }
}

// One training step of rank `r` (its share of a batch of 8); the optimizer step waits for the
// async-staging stager's last copy.
void TrainStep(Rank& r) {
  r.net->forward(at::randn({8 / kWorld, kDim})).sum().backward();
  r.async_stager->WaitForStaging();
  r.opt->step();
  r.opt->zero_grad();
}

// How a benchmark saves: through the stager that copies before AsyncSave returns, through the
// async-staging one, or not at all (the raw side).
enum class Saves { kStaged, kAsyncStaged, kNone };

void BM_StepsWithSaves(benchmark::State& state, Saves saves) {
  World& w = TheWorld();
  Rank& r = w.ranks[state.thread_index()];
  auto body = [&] {
    for (int step = 0; step < kSaveInterval; ++step) TrainStep(r);
    if (saves == Saves::kNone) return;
    if (r.pending) r.pending->wait();  // at most one save in flight
    fsdp::dcp::SaveOptions options;
    options.stager = saves == Saves::kStaged ? r.stager : r.async_stager;
    r.pending.emplace(fsdp::dcp::AsyncSave(*r.net, r.opt.get(), w.dir + "/async", options));
  };
  fsdp::bench::RunRankLoop(kProgram, state, absl::StrCat("StepsWithSaves on rank ", r.group->rank()),
                           static_cast<double>(r.stager->staged_bytes()), body);
  if (r.pending) r.pending->wait();
  r.pending.reset();
}

const char* SavesName(Saves saves) {
  switch (saves) {
    case Saves::kStaged: return "ours";
    case Saves::kAsyncStaged: return "staged";
    case Saves::kNone: return "raw";
  }
  return "?";
}

enum class Op { kSave, kLoad, kLoadCold, kAsyncStall };
const char* OpName(Op op) {
  switch (op) {
    case Op::kSave: return "Save";
    case Op::kLoad: return "Load";
    case Op::kLoadCold: return "LoadCold";
    case Op::kAsyncStall: return "AsyncStall";
  }
  return "?";
}

void BM_AsyncStall(benchmark::State& state, Saves saves) {
  World& w = TheWorld();
  Rank& r = w.ranks[state.thread_index()];
  auto body = [&] {
    if (saves != Saves::kNone) {
      fsdp::dcp::SaveOptions options;
      options.stager = saves == Saves::kStaged ? r.stager : r.async_stager;
      r.pending.emplace(fsdp::dcp::AsyncSave(*r.net, r.opt.get(), w.dir + "/async", options));
      return;
    }
    r.stall_dst.copy_(r.stall_src);
    w.barrier->arrive_and_wait();
  };
  const auto finish_previous = [&] {
    if (r.pending) r.pending->wait();  // the write, outside the stall
    r.pending.reset();
  };
  fsdp::bench::RunRankLoop(kProgram, state, absl::StrCat("AsyncStall on rank ", r.group->rank()),
                           static_cast<double>(r.stager->staged_bytes()), body, finish_previous);
  finish_previous();
}

void BM_Checkpoint(benchmark::State& state, Op op, bool ours) {
  World& w = TheWorld();
  Rank& r = w.ranks[state.thread_index()];
  auto body = [&] {
    if (ours) {
      if (op == Op::kSave) {
        fsdp::dcp::Save(*r.net, r.opt.get(), w.ckpt);
      } else {
        fsdp::dcp::Load(*r.net, r.opt.get(), w.ckpt);
      }
      return;
    }
    if (op == Op::kSave) {
      RawWrite(r);
    } else {
      RawRead(r);
    }
    w.barrier->arrive_and_wait();
  };
  std::function<void()> drop;
  if (op == Op::kLoadCold) {
    drop = [&] {
      if (state.thread_index() == 0) DropFromPageCache(w.dir);
      w.barrier->arrive_and_wait();  // no rank reads before the drop
    };
  }
  fsdp::bench::RunRankLoop(kProgram, state, absl::StrCat(OpName(op), " on rank ", r.group->rank()),
                           static_cast<double>(w.checkpoint_bytes) / kWorld, body, drop);
}

void RegisterAll(int pair_repetitions) {
  // Ours and raw alternate, repeated as pairs, so machine noise hits both alike.
  for (int rep = 0; rep < pair_repetitions; ++rep) {
    for (Op op : {Op::kSave, Op::kLoad, Op::kLoadCold}) {
      for (bool ours : {true, false}) {
        benchmark::RegisterBenchmark(absl::StrCat(OpName(op), ours ? "/ours" : "/raw").c_str(), BM_Checkpoint, op, ours)
            ->Arg(TheWorld().checkpoint_bytes)
            ->Threads(kWorld)
            ->Iterations(kIterations)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
      }
    }
    for (Saves saves : {Saves::kStaged, Saves::kAsyncStaged, Saves::kNone}) {
      benchmark::RegisterBenchmark(absl::StrCat("StepsWithSaves/", SavesName(saves)).c_str(), BM_StepsWithSaves, saves)
          ->Arg(kSaveInterval)
          ->Threads(kWorld)
          ->Iterations(kIterations)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
    for (Saves saves : {Saves::kStaged, Saves::kAsyncStaged, Saves::kNone}) {
      benchmark::RegisterBenchmark(absl::StrCat("AsyncStall/", SavesName(saves)).c_str(), BM_AsyncStall, saves)
          ->Arg(TheWorld().ranks[0].stager->staged_bytes())
          ->Threads(kWorld)
          ->Iterations(kIterations)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
}

// PyTorch 2.15's side, run by the peer Python: the same model (kLayers Linear(kDim, kDim),
// fully_shard on each and the root, AdamW after one step) on kWorld Gloo processes; a save is
// dcp.save of get_model_state_dict + get_optimizer_state_dict (FileSystemWriter: fsync'ed
// files), a load dcp.load into them + set_*_state_dict, as dcp::Save / dcp::Load do. Prints
// "PEER <median save s> <median load s>".
constexpr const char* kPeerScript = R"py(
import os, statistics, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp, torch.nn as nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

def rank_main(rank, world, layers, dim, iters, root):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(root, "store"), world),
                            rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, dim)).sum().backward()
    opt.step()
    opt.zero_grad()
    ckpt = os.path.join(root, "dcp")
    state = lambda: {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}

    def load():
        sd = state()
        dcp.load(sd, checkpoint_id=ckpt)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])

    def median_s(fn):
        times = []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    save_s = median_s(lambda: dcp.save(state(), checkpoint_id=ckpt))
    load_s = median_s(load)
    if rank == 0:
        print(f"PEER {save_s} {load_s}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    world, layers, dim, iters = map(int, sys.argv[1:5])
    mp.spawn(rank_main, args=(world, layers, dim, iters, sys.argv[5]), nprocs=world)
)py";

struct PeerTimes {
  double save_ms = 0, load_ms = 0;
};

// PyTorch's times, or nullopt with the reason printed.
std::optional<PeerTimes> RunPeer(int iterations) {
  std::string why_not;
  const std::string python = fsdp::testing::PeerPythonOrCacheDefault(&why_not);
  if (python.empty()) {
    std::printf("PyTorch dcp.save / dcp.load: skipped (%s)\n", why_not.c_str());
    return std::nullopt;
  }
  const std::string root = TheWorld().dir + "/peer";
  fs::create_directories(root);
  std::ofstream(root + "/dcp_peer.py") << kPeerScript;
  const std::string command = absl::StrCat("'", python, "' '", root, "/dcp_peer.py' ", kWorld, " ", kLayers, " ", kDim,
                                           " ", iterations, " '", root, "'");
  std::string output;
  const int status = fsdp::testing::RunCommand(command, &output);
  PeerTimes t;
  const size_t at = output.find("PEER ");
  if (status != 0 || at == std::string::npos ||
      std::sscanf(output.c_str() + at, "PEER %lf %lf", &t.save_ms, &t.load_ms) != 2) {
    std::printf("PyTorch dcp.save / dcp.load: FAILED (status %d): %s\n", status, output.c_str());
    return std::nullopt;
  }
  t.save_ms *= 1e3;
  t.load_ms *= 1e3;
  return t;
}

// The usual console output; also keeps every run's time (ms) for the summary.
class SummaryReporter : public fsdp::bench::MedianReporter {
 public:
  void PrintSummary(const std::optional<PeerTimes>& peer) {
    const double rank_mib = TheWorld().checkpoint_bytes / double(kWorld) / (1 << 20);
    std::printf("\ndcp_bench: %d ranks (threads), checkpoint %.1f MiB (%.1f MiB per rank), medians:\n", kWorld,
                rank_mib * kWorld, rank_mib);
    std::printf("%-10s %10s %10s %16s %16s %22s\n", "op", "ours ms", "raw ms", "ours MiB/s/rank", "raw MiB/s/rank",
                "throughput ours/raw");
    for (Op op : {Op::kSave, Op::kLoad, Op::kLoadCold}) {
      const double ours = Median(absl::StrCat(OpName(op), "/ours")), raw = Median(absl::StrCat(OpName(op), "/raw"));
      if (std::isnan(ours) || std::isnan(raw)) continue;  // filtered out
      std::printf("%-10s %10.1f %10.1f %16.0f %16.0f %17.3f%s\n", OpName(op), ours, raw, rank_mib / ours * 1e3,
                  rank_mib / raw * 1e3, raw / ours, raw / ours >= 0.8 ? "" : " (< 0.8)");
    }
    const double stall = Median("AsyncStall/ours"), copy = Median("AsyncStall/raw");
    if (!std::isnan(stall) && !std::isnan(copy)) {
      const double mib = TheWorld().ranks[0].stager->staged_bytes() / double(1 << 20);
      std::printf("AsyncSave stall %.1f ms per save vs memcpy of its %.1f MiB %.1f ms: %.2fx%s\n", stall, mib, copy,
                  stall / copy, stall / copy <= 1.2 ? "" : " (> 1.2)");
    }
    const double async_stall = Median("AsyncStall/staged");
    if (!std::isnan(async_stall) && !std::isnan(copy)) {
      std::printf("AsyncSave stall with async staging %.1f ms per save (the copy after it returns): %.2fx of memcpy\n",
                  async_stall, async_stall / copy);
    }
    const double plain = Median("StepsWithSaves/raw");
    for (const char* name : {"ours", "staged"}) {
      const double saving = Median(absl::StrCat("StepsWithSaves/", name));
      if (std::isnan(saving) || std::isnan(plain)) continue;
      std::printf("training step with an async save%s every %d steps %.1f ms vs without saves %.1f ms: %.2fx\n",
                  std::string(name) == "staged" ? " (async staging)" : "", kSaveInterval, saving / kSaveInterval,
                  plain / kSaveInterval, saving / plain);
    }
    if (!peer) return;
    const double save = Median("Save/ours"), load = Median("Load/ours");  // NaN when filtered out
    std::printf(
        "PyTorch 2.15 dcp.save %.1f ms (%.0f MiB/s/rank), dcp.load %.1f ms (%.0f MiB/s/rank); "
        "throughput ours/PyTorch: save %.2f, load %.2f\n",
        peer->save_ms, rank_mib / peer->save_ms * 1e3, peer->load_ms, rank_mib / peer->load_ms * 1e3,
        peer->save_ms / save, peer->load_ms / load);
  }
};

}  // namespace

int main(int argc, char** argv) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain([&]() -> int {
    std::vector<char*> args(argv, argv + argc);
    const int pair_repetitions = fsdp::bench::TakePairRepetitions(args);
    const bool peer = fsdp::bench::TakeIntFlag(args, "--peer=", 1) != 0;  // --peer=0: no PyTorch run
    // One intra-op thread per rank: the kWorld rank threads share this 2-core machine.
    at::set_num_threads(1);
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
