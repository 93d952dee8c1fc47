// What the file-IO benchmarks (bench/dcp_bench.cc, bench/hf_bench.cc) share: ranks as threads
// of one process, the plain-IO side they are compared with (write + fsync, pread), and the
// medians of their runs. A failure aborts with one line: a rank thread cannot leave its peers
// waiting in a collective.
#ifndef FSDP_BENCH_THREADED_IO_H_
#define FSDP_BENCH_THREADED_IO_H_

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <map>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"

namespace fsdp::bench {

[[noreturn]] inline void Die(const char* program, const std::string& message) {
  std::fprintf(stderr, "%s: %s\n", program, message.c_str());
  std::abort();
}

inline void CheckErrno(const char* program, bool ok, const char* what, const std::string& path) {
  if (!ok) Die(program, absl::StrCat(what, " '", path, "': ", std::strerror(errno)));
}

// The plain-IO save: one write() loop of `bytes` into `path`, fsync, close.
inline void WriteAndFsync(const char* program, const std::string& path, const std::vector<char>& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  CheckErrno(program, fd >= 0, "open", path);
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    CheckErrno(program, n > 0, "write", path);
    done += static_cast<size_t>(n);
  }
  CheckErrno(program, ::fsync(fd) == 0, "fsync", path);
  CheckErrno(program, ::close(fd) == 0, "close", path);
}

// The plain-IO load: bytes [offset, offset + size) of `path` into `out` with pread.
inline void PreadRange(const char* program, const std::string& path, int64_t offset, size_t size, char* out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  CheckErrno(program, fd >= 0, "open", path);
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::pread(fd, out + done, size - done, static_cast<off_t>(offset + static_cast<int64_t>(done)));
    if (n < 0 && errno == EINTR) continue;
    CheckErrno(program, n > 0, "pread", path);
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

// Runs body(rank) for every rank on its own thread (set-up: collectives need all ranks at once).
template <class Rank>
void OnRanks(const char* program, std::vector<Rank>& ranks, const std::function<void(Rank&)>& body) {
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ranks.size(); ++r) {
    threads.emplace_back([&, r] {
      try {
        body(ranks[r]);
      } catch (const std::exception& e) {
        Die(program, absl::StrCat("rank ", r, ": ", e.what()));
      }
    });
  }
  for (auto& t : threads) t.join();
}

// The median of `v` (NaN when empty: a benchmark filtered out).
inline double Median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The timed loop of a rank thread: `body` once untimed (the first call after another
// benchmark pays the allocator's growth: glibc's heap and mmap threshold adapt to the sizes;
// and the page cache is warmed on both sides of a pair), then once per iteration, after
// `untimed` (when given) with the timer paused; an exception aborts naming `what`. Then the
// rank's bytes per second as the "rank_bytes/s" counter (Google Benchmark sums counters and
// real times over the threads, so the rate is one rank's).
inline void RunRankLoop(const char* program, benchmark::State& state, const std::string& what, double rank_bytes,
                        const std::function<void()>& body, const std::function<void()>& untimed = nullptr) {
  auto guarded = [&] {
    try {
      body();
    } catch (const std::exception& e) {
      Die(program, absl::StrCat(what, ": ", e.what()));
    }
  };
  guarded();
  for (auto _ : state) {
    if (untimed) {
      state.PauseTiming();
      untimed();
      state.ResumeTiming();
    }
    guarded();
  }
  state.counters["rank_bytes/s"] =
      benchmark::Counter(rank_bytes * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

// The console output, keeping every run's time (ms) for a summary by name.
class MedianReporter : public benchmark::ConsoleReporter {
 public:
  MedianReporter() : ConsoleReporter(OO_None) {}
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (!run.error_occurred) times_[run.run_name.function_name].push_back(run.GetAdjustedRealTime());
    }
    ConsoleReporter::ReportRuns(runs);
  }
  double Median(const std::string& name) { return fsdp::bench::Median(times_[name]); }

 private:
  std::map<std::string, std::vector<double>> times_;
};

}  // namespace fsdp::bench

#endif  // FSDP_BENCH_THREADED_IO_H_
