// The flight recorder's time source (comm/flight_recorder.cc): the time-stamp counter where
// the kernel keeps time with it, else the wall clock. Tsc() and WallNs() are read per
// recorded collective, so they stay inline. Thread-safe.
#ifndef FSDP_COMM_INTERNAL_ENTRY_CLOCK_H_
#define FSDP_COMM_INTERNAL_ENTRY_CLOCK_H_

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

#include <chrono>
#include <cstdint>

namespace fsdp::comm::internal {

inline int64_t WallNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Whether the time-stamp counter can stand for the wall clock: the kernel keeps time with it
// (its clocksource is "tsc" only while it finds the counter invariant and synchronized across
// CPUs, and it demotes it otherwise). x86-64 only; elsewhere entries read the wall clock.
bool TscKeepsTime();

// The counter (0 where there is none: TscKeepsTime() is false there).
inline int64_t Tsc() {
#if defined(__x86_64__)
  return static_cast<int64_t>(__rdtsc());
#else
  return 0;
#endif
}

}  // namespace fsdp::comm::internal

#endif  // FSDP_COMM_INTERNAL_ENTRY_CLOCK_H_
