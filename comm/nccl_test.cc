// :nccl in both builds. Default build: the stub's contract. --config=cuda: a one-rank group
// on GPU 0 (skipped, with the reason, where no GPU is visible).
#include "comm/nccl_process_group.h"
#include "testing/multi_rank.h"

#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#ifdef FSDP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace fsdp::comm {
namespace {

// The message of the c10::Error `fn` throws; fails the test when it throws none.
template <typename Fn>
std::string ErrorOf(Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  ADD_FAILURE() << "expected a c10::Error";
  return "";
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (fd >= 0) close(fd);
    return 29500;
  }
  close(fd);
  return ntohs(addr.sin_port);
}

TorchrunEnv OneRankEnv() {
  TorchrunEnv env;
  env.master_addr = "127.0.0.1";
  env.master_port = FreePort();
  return env;
}

#ifndef FSDP_WITH_CUDA

constexpr const char* kNotBuilt = "NCCL backend not built: rebuild with --config=cuda (needs nvcc and NCCL)";

TEST(NcclTest, UnavailableInDefaultBuild) { EXPECT_FALSE(NcclAvailable()); }

TEST(NcclTest, FactoriesSayHowToBuildIt) {
  EXPECT_EQ(ErrorOf([] { CreateNcclProcessGroupWithTcpStore(OneRankEnv()); }), kNotBuilt);
  EXPECT_EQ(ErrorOf([] { CreateNcclProcessGroupFromEnv(); }), kNotBuilt);
}

#else  // FSDP_WITH_CUDA

// Skips the test unless a GPU is visible, printing why.
#define SKIP_WITHOUT_GPU()                                                                        \
  do {                                                                                            \
    int count = 0;                                                                                \
    const cudaError_t status = cudaGetDeviceCount(&count);                                        \
    if (status != cudaSuccess) {                                                                  \
      (void)cudaGetLastError();                                                                   \
      GTEST_SKIP() << "no usable GPU: cudaGetDeviceCount failed: " << cudaGetErrorString(status); \
    }                                                                                             \
    if (count == 0) GTEST_SKIP() << "no usable GPU: cudaGetDeviceCount returned 0";               \
  } while (0)

TEST(NcclTest, AvailableInCudaBuild) { EXPECT_TRUE(NcclAvailable()); }

TEST(NcclTest, OneRankGroup) {
  SKIP_WITHOUT_GPU();
  NcclOptions options;
  options.device_index = 0;
  options.timeout = Timeout(60000);
  ProcessGroupPtr group = CreateNcclProcessGroupWithTcpStore(OneRankEnv(), options);
  ASSERT_NE(group, nullptr);
  EXPECT_EQ(group->backend_name(), "nccl");
  EXPECT_EQ(group->rank(), 0);
  EXPECT_EQ(group->size(), 1);

  // Barrier uses the group's own device buffer: needs no CUDA tensors.
  WorkPtr work = group->barrier();
  work->wait();
  EXPECT_TRUE(work->is_completed());
  EXPECT_EQ(work->exception(), nullptr);

  // CPU tensors are rejected, naming the argument and its device.
  const std::string error = ErrorOf([&] { group->all_reduce(at::ones({4})); });
  EXPECT_NE(error.find("all_reduce: tensor must be a CUDA tensor"), std::string::npos) << error;
  EXPECT_NE(error.find("on cpu"), std::string::npos) << error;

  ProcessGroupPtr sub = group->new_subgroup({0});
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->size(), 1);
  sub->barrier()->wait();
}

TEST(NcclTest, RejectsNonPositiveWatchdogPollInterval) {
  NcclOptions options;
  options.watchdog_poll_interval = std::chrono::milliseconds(0);
  const std::string error = ErrorOf([&] { CreateNcclProcessGroupWithTcpStore(OneRankEnv(), options); });
  EXPECT_NE(error.find("NcclOptions.watchdog_poll_interval must be positive, got 0 ms"), std::string::npos) << error;
}

TEST(NcclTest, OneRankGroupWithoutWatchdog) {
  SKIP_WITHOUT_GPU();
  NcclOptions options;
  options.device_index = 0;
  options.timeout = Timeout(60000);
  options.watchdog = false;
  ProcessGroupPtr group = CreateNcclProcessGroupWithTcpStore(OneRankEnv(), options);
  WorkPtr work = group->barrier();
  work->wait();
  EXPECT_TRUE(work->is_completed());
  EXPECT_EQ(work->exception(), nullptr);
  ProcessGroupPtr sub = group->new_subgroup({0});
  ASSERT_NE(sub, nullptr);
  sub->barrier()->wait();
}

TEST(NcclTest, OneRankCollectivesOnCudaTensors) {
  SKIP_WITHOUT_GPU();
  // CUDA tensors need LibTorch's CUDA backend (libtorch_cuda.so), loaded at run time.
  FSDP_SKIP_IF_BACKEND_UNAVAILABLE(::fsdp::testing::Backend::kNcclProcesses, 1);
  NcclOptions options;
  options.device_index = 0;
  ProcessGroupPtr group = CreateNcclProcessGroupWithTcpStore(OneRankEnv(), options);
  const auto cuda = at::TensorOptions().device(at::kCUDA, 0);

  at::Tensor t = at::arange(6, cuda.dtype(at::kFloat));
  group->all_reduce(t, ReduceOp::PremulSum(0.5))->wait();
  EXPECT_TRUE(at::allclose(t.cpu(), at::arange(6, at::kFloat) * 0.5));

  at::Tensor gathered = at::empty({6}, cuda.dtype(at::kFloat));
  group->all_gather_into_tensor(gathered, t)->wait();
  EXPECT_TRUE(at::equal(gathered.cpu(), t.cpu()));

  at::Tensor scattered = at::empty({6}, cuda.dtype(at::kFloat));
  group->reduce_scatter_tensor(scattered, t, ReduceOp::Avg())->wait();
  EXPECT_TRUE(at::equal(scattered.cpu(), t.cpu()));

  at::Tensor out = at::empty({3, 2}, cuda.dtype(at::kLong));
  at::Tensor in = at::arange(6, cuda.dtype(at::kLong)).view({3, 2});
  group->all_to_all_single(out, in)->wait();
  EXPECT_TRUE(at::equal(out.cpu(), in.cpu()));
}

// The watchdog on a real device: a collective that cannot start (the legacy default stream,
// which the group's collectives are ordered after, is held by a host callback) must be
// failed by the watchdog thread within the group's timeout although nobody waits for it,
// and the group must stay failed.
TEST(NcclTest, WatchdogAbortsACollectiveStuckOnTheDevice) {
  SKIP_WITHOUT_GPU();
  NcclOptions options;
  options.device_index = 0;
  options.timeout = Timeout(500);
  ProcessGroupPtr group = CreateNcclProcessGroupWithTcpStore(OneRankEnv(), options);
  group->barrier()->wait();  // connected before the stream is held

  static std::atomic<bool> release{false};
  release = false;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  // Holds the stream until released, for 30 s at most (so a hung abort still ends).
  const auto hold = [](void*) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!release.load() && std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  };
  ASSERT_EQ(cudaLaunchHostFunc(cudaStreamLegacy, hold, nullptr), cudaSuccess);

  const auto start = std::chrono::steady_clock::now();
  WorkPtr stuck = group->barrier();
  while (!stuck->is_completed() && std::chrono::steady_clock::now() - start < std::chrono::seconds(10)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const auto elapsed = std::chrono::steady_clock::now() - start;
  std::exception_ptr failure = stuck->exception();
  release = true;
  EXPECT_LT(elapsed, std::chrono::seconds(10)) << "the watchdog did not fail the stuck collective";
  ASSERT_NE(failure, nullptr) << "the stuck collective completed without an error";
  const std::string error = ErrorOf([&] { std::rethrow_exception(failure); });
  EXPECT_NE(error.find("timed out"), std::string::npos) << error;
  EXPECT_NE(error.find("aborted by the watchdog"), std::string::npos) << error;
  // Sticky: the next collective fails at once, naming the earlier failure.
  const std::string later = ErrorOf([&] { group->barrier()->wait(); });
  EXPECT_NE(later.find("aborted by the watchdog"), std::string::npos) << later;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

#endif  // FSDP_WITH_CUDA

}  // namespace
}  // namespace fsdp::comm
