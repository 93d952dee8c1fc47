// The timed loop of a Google Benchmark, bracketed for instruction counting: under
// `valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no`
// (tools/callgrind_bench.sh) only the loop is instrumented and its instructions collected,
// and each run is dumped as "<label> iters=<N>". Outside valgrind the client requests are a
// few no-op instructions.
#ifndef FSDP_BENCH_CALLGRIND_LOOP_H_
#define FSDP_BENCH_CALLGRIND_LOOP_H_

#include <benchmark/benchmark.h>

#include <string>

#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#else  // valgrind's headers missing: nothing to bracket
#define CALLGRIND_START_INSTRUMENTATION
#define CALLGRIND_STOP_INSTRUMENTATION
#define CALLGRIND_TOGGLE_COLLECT
#define CALLGRIND_DUMP_STATS_AT(x) ((void)(x))
#endif

namespace fsdp::bench {

template <class Body>
void TimedLoop(benchmark::State& state, const std::string& label, Body&& body) {
  CALLGRIND_START_INSTRUMENTATION;
  CALLGRIND_TOGGLE_COLLECT;
  for (auto _ : state) body();
  CALLGRIND_TOGGLE_COLLECT;
  const std::string dump = label + " iters=" + std::to_string(state.iterations());
  CALLGRIND_DUMP_STATS_AT(dump.c_str());
  CALLGRIND_STOP_INSTRUMENTATION;
}

}  // namespace fsdp::bench

#endif  // FSDP_BENCH_CALLGRIND_LOOP_H_
