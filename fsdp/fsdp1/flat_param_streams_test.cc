// FlatParamStreams' collective rule: on inline CPU streams the host waits for each collective
// right after issuing it (PyTorch's FSDP1 async_op=False); async CPU streams keep it in flight.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>

#include "comm/work.h"
#include "device/stream.h"
#include "fsdp/fsdp1/flat_param_streams.h"

namespace fsdp::fsdp1 {
namespace {

// A collective that finishes at once and records whether anybody waited for it.
class RecordingWork final : public comm::Work {
 public:
  explicit RecordingWork(std::atomic<bool>* waited) : Work("recording", comm::Timeout(1000)), waited_(waited) {}
  bool is_completed() override { return true; }
  std::exception_ptr exception() override { return nullptr; }

 protected:
  bool WaitFor(comm::Timeout) override {
    *waited_ = true;
    return true;
  }

 private:
  std::atomic<bool>* waited_;
};

TEST(FlatParamStreams, InlineCpuStreamsWaitForEachCollectiveAsPyTorchsFsdp1) {
  if (std::getenv("FSDP_CPU_STREAMS") != nullptr) GTEST_SKIP() << "FSDP_CPU_STREAMS overrides the mode";
  FlatParamStreamContext context(c10::Device(c10::kCPU), device::StreamOptions{});
  const FlatParamStreams& s = context.streams();
  std::atomic<bool> waited{false};
  LaunchCollective(s, *s.unshard, [&] { return std::make_shared<RecordingWork>(&waited); });
  EXPECT_TRUE(waited);  // an inline stream alone would leave it pending until its next use
}

TEST(FlatParamStreams, AsyncCpuStreamsLeaveTheCollectiveInFlight) {
  if (std::getenv("FSDP_CPU_STREAMS") != nullptr) GTEST_SKIP() << "FSDP_CPU_STREAMS overrides the mode";
  // The host returns before the worker issued (a 50 ms delay before each task), so nothing
  // can have waited yet.
  device::StreamOptions options;
  options.cpu_mode = device::CpuStreamMode::kAsync;
  options.cpu_task_delay = std::chrono::milliseconds(50);
  FlatParamStreamContext context(c10::Device(c10::kCPU), options);
  const FlatParamStreams& s = context.streams();
  EXPECT_FALSE(s.host_waits_for_collectives);
  std::atomic<bool> waited{false};
  LaunchCollective(s, *s.unshard, [&] { return std::make_shared<RecordingWork>(&waited); });
  EXPECT_FALSE(waited);
  s.unshard->Synchronize();
  EXPECT_TRUE(waited);  // the worker waited for it in its turn
}

}  // namespace
}  // namespace fsdp::fsdp1
