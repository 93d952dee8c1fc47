// Runs a GoogleTest body on W ranks: as threads (Threaded or Gloo+FileStore backends) or
// as W processes (Gloo+TCPStore, or NCCL with rank r on cuda:r, on 127.0.0.1 with the
// torchrun environment per child).
#ifndef FSDP_TESTING_MULTI_RANK_H_
#define FSDP_TESTING_MULTI_RANK_H_

#include <c10/core/Device.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "comm/process_group.h"

namespace fsdp::testing {

// kNcclProcesses: one process per rank, rank r on GPU cuda:r (comm/nccl_process_group.h);
// needs a --config=cuda (FSDP_WITH_CUDA) build, W visible GPUs and LibTorch's CUDA backend
// (see BackendUnavailableReason). Its tensors must live on RankDevice().
// kC10dGlooThreads / kC10dGlooProcesses: a c10d::ProcessGroupGloo built by hand (as a user
// holding a c10d backend would) and wrapped with comm::WrapC10dBackend (comm/c10d_process_group.h);
// ranks as threads over a FileStore, or as processes over a TCPStore.
enum class Backend { kThreaded, kGlooThreads, kGlooProcesses, kNcclProcesses, kC10dGlooThreads, kC10dGlooProcesses };

// "threaded", "gloo_threads", "gloo_processes", "nccl_processes", "c10d_gloo_threads",
// "c10d_gloo_processes" (usable in test names).
std::string BackendName(Backend backend);

// The device rank `rank`'s tensors live on: cuda:<rank> for kNcclProcesses (the rank's
// LOCAL_RANK), the CPU for the other backends.
c10::Device RankDevice(Backend backend, int rank);

// Why `backend` cannot run `world_size` ranks in this build and on this machine; empty when
// it can (always, for the CPU backends). For kNcclProcesses: the NCCL backend is not built
// (default build), no usable GPU or driver, fewer than `world_size` GPUs ("needs W GPUs,
// found N": NCCL forbids two ranks of one communicator on one GPU), or LibTorch's CUDA
// backend (libtorch_cuda.so, which CUDA tensors need) cannot be loaded. Loads it into this
// process on first success (FSDP_LIBTORCH_CUDA names the library, default: next to the
// loaded libtorch_cpu.so). Tests skip with it:
#define FSDP_SKIP_IF_BACKEND_UNAVAILABLE(backend, world_size)                                                \
  do {                                                                                                       \
    const std::string fsdp_unavailable = ::fsdp::testing::BackendUnavailableReason((backend), (world_size)); \
    if (!fsdp_unavailable.empty()) GTEST_SKIP() << fsdp_unavailable;                                         \
  } while (0)
std::string BackendUnavailableReason(Backend backend, int world_size);

struct RunOptions {
  // The whole run must finish by then; stuck ranks fail the test. Threads: a stuck thread
  // cannot be stopped and references the test's stack, so the binary prints "rank(s) [R, ...]
  // still running after the deadline of D ms" (and the finished ranks' errors) and exits
  // with status 1 (Threaded groups are first aborted, with 5 s for their ranks to return).
  // Processes: the stuck rank processes are killed and their outcomes say so; the call
  // returns. Proven by injected hangs in multi_rank_test.cc.
  std::chrono::milliseconds deadline{120000};
  // The groups' collective timeout (Work::wait default and Gloo's own deadline).
  comm::Timeout collective_timeout{30000};
};

using RankBody = std::function<void(const comm::ProcessGroupPtr& group)>;

struct RankOutcome {
  int rank = 0;
  bool ok = true;
  // The rank's exception message, or (processes) the tail of its failing output.
  std::string message;
};

// Runs `body` once per rank and returns every rank's outcome; rank failures do not throw.
// When a threaded rank throws, the other ranks' pending and later collectives fail with
// "rank R failed: <message>" at once. GoogleTest assertions inside `body` work on every
// backend (in process mode the child's failure output becomes the rank's message).
//
// Process mode re-executes the current test binary filtered to the current test, once per
// rank; a test may call this several times (each call is matched by its index). Calling it
// with a backend that BackendUnavailableReason rejects throws that reason: skip first.
std::vector<RankOutcome> RunOnRanksCollect(Backend backend, int world_size, const RankBody& body,
                                           const RunOptions& options = {});

// RunOnRanksCollect, then one GoogleTest failure per failing rank, naming the rank.
void RunOnRanks(Backend backend, int world_size, const RankBody& body, const RunOptions& options = {});

// True inside a rank process started by process mode.
bool IsRankProcess();

}  // namespace fsdp::testing

#endif  // FSDP_TESTING_MULTI_RANK_H_
