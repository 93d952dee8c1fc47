// Flags shared by the paired (ours vs raw) benchmarks, parsed before Google Benchmark sees
// the command line.
#ifndef FSDP_BENCH_PAIR_FLAGS_H_
#define FSDP_BENCH_PAIR_FLAGS_H_

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace fsdp::bench {

// Removes every `prefix`N (e.g. "--callgrind_iterations=") from `args` (argv without
// argv[0]'s ownership) and returns the last N, or `fallback` when absent.
inline int TakeIntFlag(std::vector<char*>& args, const char* prefix, int fallback) {
  int value = fallback;
  const size_t n = std::strlen(prefix);
  for (auto it = args.begin() + 1; it != args.end();) {
    if (std::strncmp(*it, prefix, n) == 0) {
      value = std::atoi(*it + n);
      it = args.erase(it);
    } else {
      ++it;
    }
  }
  return value;
}

// --pair_repetitions=N (at least 1), or `fallback` when absent.
inline int TakePairRepetitions(std::vector<char*>& args, int fallback = 3) {
  return std::max(1, TakeIntFlag(args, "--pair_repetitions=", fallback));
}

// Multi-process benchmarks: every rank runs the same benchmarks with fixed iteration counts
// (so their collectives line up), and only rank 0 reports. On other ranks this drops
// --benchmark_out* from `args` and silences stdout.
inline void QuietUnlessRankZero(std::vector<char*>& args, int rank) {
  if (rank == 0) return;
  args.erase(
      std::remove_if(args.begin() + 1, args.end(), [](char* a) { return std::strncmp(a, "--benchmark_out", 15) == 0; }),
      args.end());
  if (std::freopen("/dev/null", "w", stdout) == nullptr) std::perror("freopen /dev/null");
}

}  // namespace fsdp::bench

#endif  // FSDP_BENCH_PAIR_FLAGS_H_
