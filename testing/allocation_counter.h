// Counts the CPU memory a thread allocates through c10's CPU allocator (every CPU tensor's
// storage): current and peak bytes of the allocations made while a counter is active on
// that thread, freed from any thread. Each threaded rank is a thread, so a rank measures
// its own memory. For memory tests only: it installs a wrapping allocator process-wide.
#ifndef FSDP_TESTING_ALLOCATION_COUNTER_H_
#define FSDP_TESTING_ALLOCATION_COUNTER_H_

#include <atomic>
#include <cstdint>
#include <memory>

namespace fsdp::testing {

class ScopedAllocationCounter {
 public:
  ScopedAllocationCounter();  // active on this thread until destroyed (not nestable)

  // Installs the counting allocator (the first counter does it too). Call it on the main
  // thread before starting threads that allocate when counters will be created on those
  // threads: replacing c10's CPU allocator while other threads allocate is a data race (TSan
  // reported it). Not at load time: c10 may register its own CPU allocator only later.
  static void Install();
  ~ScopedAllocationCounter();
  ScopedAllocationCounter(const ScopedAllocationCounter&) = delete;
  ScopedAllocationCounter& operator=(const ScopedAllocationCounter&) = delete;

  int64_t current() const { return counts_->current.load(); }  // bytes still live
  int64_t peak() const { return counts_->peak.load(); }        // the most live at once

  // From now on an allocation on this thread that would take current() above `bytes` throws
  // a c10::Error instead (as an out-of-memory would): what "a rank may allocate at most N
  // bytes" means in a test. Negative: no limit (the default).
  void set_limit(int64_t bytes) { counts_->limit = bytes; }

  // Shared with the allocations, which may be freed after the counter is gone.
  struct Counts {
    std::atomic<int64_t> current{0};
    std::atomic<int64_t> peak{0};
    std::atomic<int64_t> limit{-1};
    void Add(int64_t bytes);
  };

 private:
  std::shared_ptr<Counts> counts_;
};

}  // namespace fsdp::testing

#endif  // FSDP_TESTING_ALLOCATION_COUNTER_H_
