#include "metrics/allocation_window.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <sys/resource.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <unistd.h>

#include <c10/util/Backtrace.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "env/environment.h"

namespace fsdp::metrics {
// Named, not anonymous: AllocationWindow::Reporter (external linkage) holds a LiveBlocks.
namespace allocation_window_internal {

// FSDP_PEAK_BLOCKS: the large blocks live now, and those live at the highest total since
// Mark(), with where each was allocated.
class LiveBlocks {
 public:
  static constexpr int64_t kMinBytes = 100000;
  void Report(void* ptr, int64_t bytes, int64_t total) {
    std::lock_guard<std::mutex> lock(mu_);
    if (bytes > 0) {
      // Raw frames now, symbolized only when printed: a symbolized backtrace per block took
      // long enough to move the peak it was meant to show (the Gloo threads ran ahead).
      live_[ptr] = {bytes, bytes >= kMinBytes ? c10::get_lazy_backtrace(/*frames_to_skip=*/1,
                                                                        /*maximum_number_of_frames=*/40,
                                                                        /*skip_python_frames=*/true)
                                              : nullptr};
    } else {
      live_.erase(ptr);
    }
    if (!marked_ || total <= peak_) return;
    peak_ = total;
    at_peak_.clear();
    for (const auto& [p, block] : live_) {
      if (block.first >= kMinBytes) at_peak_.push_back({p, block.first, block.second});
    }
  }
  void Mark(int64_t total) {
    std::lock_guard<std::mutex> lock(mu_);
    marked_ = true;
    peak_ = total;
  }
  void Print() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t listed = 0;
    for (const auto& block : at_peak_) listed += block.bytes;
    // A block freed on a thread this window does not see (a backend's worker, which drops
    // ProcessGroupGloo's copy of a reduce-scatter input when it lets go of the Work last) stays
    // listed: the listed bytes then exceed the peak, which counts every thread's frees.
    std::fprintf(stderr, "FSDP_PEAK_BLOCKS: peak %lld bytes, %zu blocks of >= %lld bytes live (%lld bytes listed%s)\n",
                 static_cast<long long>(peak_), at_peak_.size(), static_cast<long long>(kMinBytes),
                 static_cast<long long>(listed),
                 listed > peak_ ? ": more than the peak, some were freed on a thread this window does not see" : "");
    for (const auto& [ptr, bytes, where] : at_peak_) {
      std::fprintf(stderr, "---- %lld bytes at %p\n%s\n", static_cast<long long>(bytes), ptr,
                   where ? where->get().c_str() : "");
    }
  }

 private:
  std::mutex mu_;
  std::unordered_map<void*, std::pair<int64_t, c10::Backtrace>> live_;
  struct Block {
    void* ptr;
    int64_t bytes;
    c10::Backtrace where;
  };
  std::vector<Block> at_peak_;
  bool marked_ = false;
  int64_t peak_ = 0;
};

bool PeakBlocksWanted() {
  const std::optional<std::string> wanted = env::Get(env::kPeakBlocks);
  return wanted && *wanted == env::Get(env::kRank).value_or("0");
}

}  // namespace allocation_window_internal

using allocation_window_internal::LiveBlocks;
using allocation_window_internal::PeakBlocksWanted;

// A profiler state that only profiles memory: c10's allocators look for it in the thread's
// PROFILER_STATE slot (and LibTorch code that finds it there expects a ProfilerStateBase;
// being Disabled, it records nothing else).
struct AllocationWindow::Reporter final : torch::profiler::impl::ProfilerStateBase {
  Reporter()
      : ProfilerStateBase(torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::Disabled,
                                                                /*report_input_shapes=*/false,
                                                                /*profile_memory=*/true)) {}
  // Threads that inherit this thread's debug info (autograd, intra-op workers) report too.
  void reportMemoryUsage(void* ptr, int64_t bytes, size_t total_allocated, size_t, c10::Device device) override {
    if (device.type() != c10::DeviceType::CPU) return;
    const auto total = static_cast<int64_t>(total_allocated);
    current.store(total);
    int64_t seen = peak.load();
    while (total > seen && !peak.compare_exchange_weak(seen, total)) {
    }
    if (blocks) blocks->Report(ptr, bytes, total);
  }
  torch::profiler::impl::ActiveProfilerType profilerType() override {
    return torch::profiler::impl::ActiveProfilerType::NONE;
  }
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  const std::unique_ptr<LiveBlocks> blocks{PeakBlocksWanted() ? std::make_unique<LiveBlocks>() : nullptr};
};

AllocationWindow::AllocationWindow()
    : reporter_(std::make_shared<Reporter>()),
      guard_(std::make_unique<c10::DebugInfoGuard>(c10::DebugInfoKind::PROFILER_STATE, reporter_)) {
  FLAGS_caffe2_report_cpu_memory_usage = true;
}

AllocationWindow::~AllocationWindow() {
  FLAGS_caffe2_report_cpu_memory_usage = false;
  if (reporter_->blocks) reporter_->blocks->Print();
}

void AllocationWindow::Mark() {
  reporter_->peak = reporter_->current.load();
  if (reporter_->blocks) reporter_->blocks->Mark(reporter_->peak);
}
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

}  // namespace fsdp::metrics
