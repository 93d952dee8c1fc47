#include "bench/peak_memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <sys/resource.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>

namespace fsdp::bench {

// A profiler state that only profiles memory: c10's allocators look for it in the thread's
// PROFILER_STATE slot (and LibTorch code that finds it there expects a ProfilerStateBase;
// being Disabled, it records nothing else).
struct AllocationWindow::Reporter final : torch::profiler::impl::ProfilerStateBase {
  Reporter()
      : ProfilerStateBase(torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::Disabled,
                                                                /*report_input_shapes=*/false,
                                                                /*profile_memory=*/true)) {}
  // Threads that inherit this thread's debug info (autograd, intra-op workers) report too.
  void reportMemoryUsage(void*, int64_t, size_t total_allocated, size_t, c10::Device device) override {
    if (device.type() != c10::DeviceType::CPU) return;
    const auto total = static_cast<int64_t>(total_allocated);
    current.store(total);
    int64_t seen = peak.load();
    while (total > seen && !peak.compare_exchange_weak(seen, total)) {
    }
  }
  torch::profiler::impl::ActiveProfilerType profilerType() override {
    return torch::profiler::impl::ActiveProfilerType::NONE;
  }
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
};

AllocationWindow::AllocationWindow()
    : reporter_(std::make_shared<Reporter>()),
      guard_(std::make_unique<c10::DebugInfoGuard>(c10::DebugInfoKind::PROFILER_STATE, reporter_)) {
  FLAGS_caffe2_report_cpu_memory_usage = true;
}

AllocationWindow::~AllocationWindow() { FLAGS_caffe2_report_cpu_memory_usage = false; }

void AllocationWindow::Mark() { reporter_->peak = reporter_->current.load(); }
int64_t AllocationWindow::current() const { return reporter_->current; }
int64_t AllocationWindow::peak() const { return reporter_->peak; }

int64_t RssBytes() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE);
}

int64_t RssPeakBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // Linux: KiB
}

}  // namespace fsdp::bench
