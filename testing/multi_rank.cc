#include "testing/multi_rank.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "comm/c10d_process_group.h"
#include "comm/gloo_process_group.h"
#include "comm/nccl_process_group.h"
#include "comm/threaded_process_group.h"
#include "testing/free_port.h"

#ifdef FSDP_WITH_CUDA
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <link.h>

#include <cstring>
#endif

extern char** environ;

namespace fsdp::testing {
namespace {

constexpr const char* kChildCallEnv = "FSDP_TESTING_CALL";
constexpr const char* kFailureMarker = "FSDP_RANK_FAILURE: ";

std::string ExceptionMessage(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

std::string CurrentTestName() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return info ? absl::StrCat(info->test_suite_name(), ".", info->name()) : "";
}

// Index of this RunOnRanksCollect call within the current test.
int NextCallIndex() {
  static std::string test;
  static int index = 0;
  const std::string current = CurrentTestName();
  if (current != test) {
    test = current;
    index = 0;
  }
  return index++;
}

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir ? dir : "/tmp";
}

// ------------------------------------------------------------------ threads

// What a user who already holds a c10d backend does: build ProcessGroupGloo by hand (on
// loopback) and wrap it.
comm::ProcessGroupPtr HandBuiltC10dGloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                                        comm::Timeout timeout) {
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
  gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, gloo_options);
  return comm::WrapC10dBackend(gloo, {.timeout = timeout, .store = store});
}

std::vector<RankOutcome> RunAsThreads(Backend backend, int world_size, const RankBody& body,
                                      const RunOptions& options) {
  std::vector<comm::ProcessGroupPtr> threaded;
  if (backend == Backend::kThreaded) {
    threaded = comm::CreateThreadedProcessGroups(world_size, options.collective_timeout);
  }
  static std::atomic<int> store_counter{0};
  const std::string store_path = absl::StrCat(TempDir(), "/fsdp_gloo_store_", getpid(), "_", store_counter++);
  std::remove(store_path.c_str());

  std::vector<RankOutcome> outcomes(world_size);
  // std::mutex, not absl::Mutex: ThreadSanitizer sees pthread locks, not Debian's absl.
  std::mutex mu;
  std::condition_variable cv;
  int finished = 0;
  std::vector<bool> done(world_size, false);
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      outcomes[r].rank = r;
      comm::ProcessGroupPtr group;
      try {
        if (backend == Backend::kThreaded) {
          group = threaded[r];
        } else if (backend == Backend::kC10dGlooThreads) {
          auto store = c10::make_intrusive<c10d::FileStore>(store_path, world_size);
          store->setTimeout(options.collective_timeout);
          group = HandBuiltC10dGloo(store, r, world_size, options.collective_timeout);
        } else {
          comm::GlooOptions gloo;
          gloo.timeout = options.collective_timeout;
          group = comm::CreateGlooProcessGroupWithFileStore(store_path, r, world_size, gloo);
        }
        SCOPED_TRACE(absl::StrCat("rank ", r, " of ", world_size, " (", BackendName(backend), ")"));
        body(group);
      } catch (...) {
        outcomes[r].ok = false;
        outcomes[r].message = ExceptionMessage(std::current_exception());
        if (backend == Backend::kThreaded) {
          comm::AbortThreadedWorld(*threaded[r], absl::StrCat("rank ", r, " failed: ", outcomes[r].message));
        }
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        done[r] = true;
        ++finished;
      }
      cv.notify_all();
    });
  }
  const auto all_done = [&] { return finished == world_size; };
  bool in_time;
  {
    std::unique_lock<std::mutex> lock(mu);
    in_time = cv.wait_for(lock, options.deadline, all_done);
  }
  if (!in_time && backend == Backend::kThreaded) {
    comm::AbortThreadedWorld(*threaded[0], "test deadline exceeded");
    std::unique_lock<std::mutex> lock(mu);
    in_time = cv.wait_for(lock, std::chrono::seconds(5), all_done);
  }
  if (!in_time) {
    std::vector<int> stuck;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (int r = 0; r < world_size; ++r) {
        if (!done[r]) stuck.push_back(r);
      }
    }
    // The stuck threads cannot be stopped, and they reference this frame and the test's
    // locals: the process cannot go on. Name them (and what the others reported) and exit.
    std::cerr << "\n[multi_rank] " << CurrentTestName() << ": rank(s) [" << absl::StrJoin(stuck, ", ")
              << "] still running after the deadline of " << options.deadline.count()
              << " ms (deadlock?); failing the test binary\n";
    {
      std::lock_guard<std::mutex> lock(mu);
      for (int r = 0; r < world_size; ++r) {
        if (done[r] && !outcomes[r].ok)
          std::cerr << "[multi_rank] rank " << r << " failed: " << outcomes[r].message << "\n";
      }
    }
    std::cerr.flush();
    std::_Exit(1);
  }
  for (auto& t : threads) t.join();
  std::remove(store_path.c_str());
  return outcomes;
}

// ------------------------------------------------------------------ processes

// The rank process's group, from the torchrun environment the parent set.
comm::ProcessGroupPtr CreateChildGroup(Backend backend, const RunOptions& options) {
  if (backend == Backend::kNcclProcesses) {
    const comm::TorchrunEnv env = comm::ReadTorchrunEnv();
    // The parent checked; this process loads LibTorch's CUDA backend for itself.
    const std::string unavailable = BackendUnavailableReason(backend, env.world_size);
    TORCH_CHECK(unavailable.empty(), "rank ", env.rank, " (nccl_processes): ", unavailable);
    comm::NcclOptions nccl;
    nccl.timeout = options.collective_timeout;
    nccl.device_index = RankDevice(backend, env.local_rank).index();
    return comm::CreateNcclProcessGroupWithTcpStore(env, nccl);
  }
  if (backend == Backend::kC10dGlooProcesses) {
    const comm::TorchrunEnv env = comm::ReadTorchrunEnv();
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(env.master_port);
    store_options.isServer = env.rank == 0;
    store_options.numWorkers = env.world_size;
    store_options.timeout = options.collective_timeout;
    auto store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, store_options);
    return HandBuiltC10dGloo(store, env.rank, env.world_size, options.collective_timeout);
  }
  comm::GlooOptions gloo;
  gloo.timeout = options.collective_timeout;
  return comm::CreateGlooProcessGroupFromEnv(gloo);
}

// Runs in a rank process: the body on this rank, then exit without running the rest.
[[noreturn]] void RunAsChild(Backend backend, const RankBody& body, const RunOptions& options) {
  int status = 0;
  try {
    auto group = CreateChildGroup(backend, options);
    // Every rank finishes making its group before any body runs: a rank whose body returns
    // at once would otherwise exit (taking rank 0's TCPStore or a Gloo connection with it)
    // while a peer is still connecting ("Failed to recv", "Connection closed by peer").
    group->barrier()->wait();
    SCOPED_TRACE(absl::StrCat("rank ", group->rank(), " of ", group->size(), " (", BackendName(backend), ")"));
    body(group);
    if (::testing::Test::HasFailure()) status = 1;
  } catch (...) {
    std::cerr << kFailureMarker << ExceptionMessage(std::current_exception()) << "\n";
    status = 1;
  }
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  std::_Exit(status);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string FailureMessage(const std::string& output) {
  const size_t marker = output.rfind(kFailureMarker);
  if (marker != std::string::npos) {
    std::string message = output.substr(marker + std::string(kFailureMarker).size());
    while (!message.empty() && message.back() == '\n') message.pop_back();
    return message;
  }
  constexpr size_t kTail = 3000;
  return output.size() > kTail ? output.substr(output.size() - kTail) : output;
}

std::vector<RankOutcome> RunAsProcesses(Backend backend, int world_size, int call_index, const RunOptions& options) {
  const std::string test = CurrentTestName();
  TORCH_CHECK(!test.empty(), "RunOnRanks(", BackendName(backend), ") must run inside a GoogleTest test");
  const int port = FreePort();
  // Children inherit the environment minus what would let them write the parent's test
  // result files.
  std::vector<std::string> base_env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    const std::string name = entry.substr(0, entry.find('='));
    if (name == "GTEST_OUTPUT" || name == "XML_OUTPUT_FILE" || name == "TEST_PREMATURE_EXIT_FILE" ||
        name == "TEST_SHARD_STATUS_FILE" || name == "GTEST_SHARD_INDEX" || name == "GTEST_TOTAL_SHARDS" ||
        name == "RANK" || name == "WORLD_SIZE" || name == "LOCAL_RANK" || name == "MASTER_ADDR" ||
        name == "MASTER_PORT" || name == kChildCallEnv) {
      continue;
    }
    base_env.push_back(entry);
  }
  std::vector<pid_t> pids(world_size, -1);
  std::vector<std::string> logs(world_size);
  for (int r = 0; r < world_size; ++r) {
    std::vector<std::string> env = base_env;
    env.push_back(absl::StrCat("RANK=", r));
    env.push_back(absl::StrCat("WORLD_SIZE=", world_size));
    env.push_back(absl::StrCat("LOCAL_RANK=", r));
    env.push_back("MASTER_ADDR=127.0.0.1");
    env.push_back(absl::StrCat("MASTER_PORT=", port));
    env.push_back(absl::StrCat(kChildCallEnv, "=", call_index));
    std::vector<std::string> args = {"/proc/self/exe", absl::StrCat("--gtest_filter=", test)};
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);

    logs[r] = absl::StrCat(TempDir(), "/fsdp_rank_", getpid(), "_", port, "_", r, ".log");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, logs[r].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
    const int rc = posix_spawn(&pids[r], "/proc/self/exe", &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    TORCH_CHECK(rc == 0, "RunOnRanks: posix_spawn of rank ", r, " failed with ", rc);
  }

  std::vector<RankOutcome> outcomes(world_size);
  std::vector<bool> exited(world_size, false);
  const absl::Time deadline = absl::Now() + absl::FromChrono(options.deadline);
  int remaining = world_size;
  while (remaining > 0 && absl::Now() < deadline) {
    for (int r = 0; r < world_size; ++r) {
      if (exited[r]) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        exited[r] = true;
        --remaining;
        outcomes[r].rank = r;
        outcomes[r].ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!outcomes[r].ok) {
          outcomes[r].message = FailureMessage(ReadFile(logs[r]));
          if (WIFSIGNALED(status)) {
            outcomes[r].message = absl::StrCat("killed by signal ", WTERMSIG(status), "\n", outcomes[r].message);
          }
        }
      }
    }
    if (remaining > 0) absl::SleepFor(absl::Milliseconds(5));
  }
  for (int r = 0; r < world_size; ++r) {
    if (exited[r]) continue;
    kill(pids[r], SIGKILL);
    waitpid(pids[r], nullptr, 0);
    outcomes[r] = {r, false,
                   absl::StrCat("still running after the deadline of ", options.deadline.count(),
                                " ms (deadlock?); killed. Output:\n", FailureMessage(ReadFile(logs[r])))};
  }
  for (const auto& log : logs) std::remove(log.c_str());
  return outcomes;
}

bool IsProcessBackend(Backend backend) {
  return backend == Backend::kGlooProcesses || backend == Backend::kNcclProcesses ||
         backend == Backend::kC10dGlooProcesses;
}

#ifdef FSDP_WITH_CUDA

// The directory of the loaded libtorch_cpu.so (the torch wheel's lib/), empty if none.
std::string LoadedLibTorchDir() {
  std::string dir;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        const std::string path = info->dlpi_name != nullptr ? info->dlpi_name : "";
        const std::string name = "/libtorch_cpu.so";
        if (path.size() <= name.size() || path.compare(path.size() - name.size(), name.size(), name) != 0) {
          return 0;
        }
        *static_cast<std::string*>(out) = path.substr(0, path.size() - name.size());
        return 1;
      },
      &dir);
  return dir;
}

// CUDA tensors need LibTorch's CUDA backend (its kernels and allocator register when
// libtorch_cuda.so loads). The build links torch_cpu + c10 only (third_party/libtorch.BUILD):
// linking libtorch_cuda would make every test binary need the wheel's CUDA runtime
// libraries (cuDNN, cuSPARSELt, cuFile, NVSHMEM, ...), so it is loaded here, where a GPU
// test needs it, and a host without them skips with dlopen's reason. Empty: loaded.
std::string LoadLibTorchCuda() {
  static const std::string reason = [] {
    const char* explicit_path = std::getenv("FSDP_LIBTORCH_CUDA");
    std::string path;
    if (explicit_path != nullptr && explicit_path[0] != '\0') {
      path = explicit_path;
    } else {
      const std::string dir = LoadedLibTorchDir();
      if (dir.empty()) {
        return std::string(
            "LibTorch's CUDA backend not found: libtorch_cpu.so is not loaded "
            "from a file (set FSDP_LIBTORCH_CUDA to libtorch_cuda.so)");
      }
      path = dir + "/libtorch_cuda.so";
    }
    if (dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) != nullptr) return std::string();
    const char* error = dlerror();
    return absl::StrCat("LibTorch's CUDA backend (needed for CUDA tensors) cannot be loaded: dlopen(", path,
                        ") failed: ", error != nullptr ? error : "unknown error",
                        ". Install the torch wheel with its CUDA dependencies (pip install torch without "
                        "--no-deps: nvidia-cudnn, -cusparselt, -cufile, -nvshmem, -nccl, ...) or set "
                        "FSDP_LIBTORCH_CUDA to such an install's torch/lib/libtorch_cuda.so; if the symbol "
                        "missing is an nccl* one, put that install's nvidia/nccl/lib first on LD_LIBRARY_PATH "
                        "(the CUDA toolkit's libnccl is older than the wheel's)");
  }();
  return reason;
}

#endif  // FSDP_WITH_CUDA

}  // namespace

std::string BackendName(Backend backend) {
  switch (backend) {
    case Backend::kThreaded: return "threaded";
    case Backend::kGlooThreads: return "gloo_threads";
    case Backend::kGlooProcesses: return "gloo_processes";
    case Backend::kNcclProcesses: return "nccl_processes";
    case Backend::kC10dGlooThreads: return "c10d_gloo_threads";
    case Backend::kC10dGlooProcesses: return "c10d_gloo_processes";
  }
  return "unknown";
}

c10::Device RankDevice(Backend backend, int rank) {
  if (backend == Backend::kNcclProcesses) {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(rank));
  }
  return c10::Device(c10::kCPU);
}

std::string BackendUnavailableReason(Backend backend, int world_size) {
  if (backend != Backend::kNcclProcesses) return "";
#ifndef FSDP_WITH_CUDA
  return "nccl_processes: the NCCL backend is not built (default build); build with "
         "bazel --config=cuda or cmake -DFSDP_WITH_CUDA=ON";
#else
  if (!comm::NcclAvailable()) return "nccl_processes: the NCCL backend is not built";
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::StrCat("nccl_processes: no usable GPU: cudaGetDeviceCount failed: ", cudaGetErrorName(status), " (",
                        cudaGetErrorString(status), ")");
  }
  // NCCL rejects two ranks of one communicator on the same GPU.
  if (count < world_size) {
    return absl::StrCat("nccl_processes: needs ", world_size, " GPUs, found ", count);
  }
  return LoadLibTorchCuda();
#endif
}

bool IsRankProcess() { return std::getenv(kChildCallEnv) != nullptr; }

std::vector<RankOutcome> RunOnRanksCollect(Backend backend, int world_size, const RankBody& body,
                                           const RunOptions& options) {
  TORCH_CHECK(world_size >= 1, "RunOnRanks: world_size must be >= 1, got ", world_size);
  if (!IsProcessBackend(backend)) return RunAsThreads(backend, world_size, body, options);
  const int call_index = NextCallIndex();
  if (const char* child_call = std::getenv(kChildCallEnv)) {
    if (std::atoi(child_call) == call_index) RunAsChild(backend, body, options);
    // Another call of this test: the parent runs it in other children.
    std::vector<RankOutcome> skipped(world_size);
    for (int r = 0; r < world_size; ++r) skipped[r].rank = r;
    return skipped;
  }
  const std::string unavailable = BackendUnavailableReason(backend, world_size);
  TORCH_CHECK(unavailable.empty(), "RunOnRanks(", BackendName(backend), ", world_size ", world_size, "): ", unavailable,
              " (skip first: FSDP_SKIP_IF_BACKEND_UNAVAILABLE)");
  // FreePort's port was free when it looked; another process may take it before rank 0's
  // store listens on it. Then rank 0 fails with EADDRINUSE before the body runs (the others
  // time out connecting): run the call again on a fresh port.
  constexpr int kPortAttempts = 3;
  for (int attempt = 1;; ++attempt) {
    std::vector<RankOutcome> outcomes = RunAsProcesses(backend, world_size, call_index, options);
    const bool port_taken = !outcomes.empty() && !outcomes[0].ok &&
                            outcomes[0].message.find("EADDRINUSE") != std::string::npos &&
                            outcomes[0].message.find("failed to listen") != std::string::npos;
    if (!port_taken || attempt == kPortAttempts) return outcomes;
  }
}

void RunOnRanks(Backend backend, int world_size, const RankBody& body, const RunOptions& options) {
  for (const RankOutcome& outcome : RunOnRanksCollect(backend, world_size, body, options)) {
    if (!outcome.ok) {
      ADD_FAILURE() << "rank " << outcome.rank << " of " << world_size << " (" << BackendName(backend)
                    << ") failed: " << outcome.message;
    }
  }
}

}  // namespace fsdp::testing
