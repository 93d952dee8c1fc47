// Memory measurements of training steps (metrics/step_metrics.h) and of the end-to-end
// benchmark, defined so that tests/peer/peer_common.py
// measures PyTorch the same way:
//
// AllocationWindow: while it lives, this thread's LibTorch CPU allocations are reported to it
// by c10's CPU allocator (the hook PyTorch's profiler uses with profile_memory=True), each
// with the allocator's running total of the bytes allocated since reporting started and not
// yet freed. The total counts every thread's allocations and frees (c10's
// caffe2_report_cpu_memory_usage flag, on while a window lives): without it, memory freed on
// another thread (a Gloo worker dropping a finished collective's tensors) stayed in the total
// for good, and the figures moved by megabytes from run to run. peak() is the largest total
// since Mark() (or construction), current() the total now. The Python side reads the same
// counter from the profiler's allocation events, with the same flag.
//
// FSDP_PEAK_BLOCKS=R (debugging what a peak holds): rank R's window (RANK from torchrun or
// `./x run`) also keeps a backtrace of every live block of at least 100 kB and, when it is
// destroyed, prints to stderr the blocks live at its peak since Mark(), one backtrace each
// (frames of our binary print as "<unknown function> + 0xOFFSET (... in .../e2e_bench)";
// `addr2line -f -C -e BINARY 0xOFFSET` names them). Slow; measurements only without it.
//
// RssBytes / RssPeakBytes: this process's resident set now (/proc/self/statm) and its
// high-water mark (getrusage ru_maxrss).
#ifndef FSDP_METRICS_ALLOCATION_WINDOW_H_
#define FSDP_METRICS_ALLOCATION_WINDOW_H_

#include <c10/util/ThreadLocalDebugInfo.h>

#include <cstdint>
#include <memory>

namespace fsdp::metrics {

class AllocationWindow {
 public:
  AllocationWindow();
  ~AllocationWindow();
  AllocationWindow(const AllocationWindow&) = delete;
  AllocationWindow& operator=(const AllocationWindow&) = delete;

  void Mark();  // peak() restarts from current()
  int64_t current() const;
  int64_t peak() const;

  struct Reporter;

 private:
  std::shared_ptr<Reporter> reporter_;
  std::unique_ptr<c10::DebugInfoGuard> guard_;
};

int64_t RssBytes();
int64_t RssPeakBytes();

}  // namespace fsdp::metrics

#endif  // FSDP_METRICS_ALLOCATION_WINDOW_H_
