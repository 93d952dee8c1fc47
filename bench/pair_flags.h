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

// Removes every --pair_repetitions=N from `args` (argv without argv[0]'s ownership) and
// returns the last N (at least 1), or `fallback` when absent.
inline int TakePairRepetitions(std::vector<char*>& args, int fallback = 3) {
  int repetitions = fallback;
  for (auto it = args.begin() + 1; it != args.end();) {
    if (std::strncmp(*it, "--pair_repetitions=", 19) == 0) {
      repetitions = std::max(1, std::atoi(*it + 19));
      it = args.erase(it);
    } else {
      ++it;
    }
  }
  return repetitions;
}

// Multi-process benchmarks: every rank runs the same benchmarks with fixed iteration counts
// (so their collectives line up), and only rank 0 reports. On other ranks this drops
// --benchmark_out* from `args` and silences stdout.
inline void QuietUnlessRankZero(std::vector<char*>& args, int rank) {
  if (rank == 0) return;
  args.erase(std::remove_if(args.begin() + 1, args.end(),
                            [](char* a) { return std::strncmp(a, "--benchmark_out", 15) == 0; }),
             args.end());
  std::freopen("/dev/null", "w", stdout);
}

}  // namespace fsdp::bench

#endif  // FSDP_BENCH_PAIR_FLAGS_H_
