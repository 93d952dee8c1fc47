// Multi-process demo of the communication layer: run with the torchrun environment, e.g.
//   ./x run -n 4 bazel-bin/examples/collectives_demo
// Every rank runs each collective on real data, checks the result against the expected
// values, and rank 0 prints a summary with the achieved bandwidth.
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "comm/comm_trace.h"
#include "comm/gloo_process_group.h"
#include "comm/main_guard.h"

ABSL_FLAG(int64_t, mib, 16, "payload per rank in MiB for the bandwidth runs");
ABSL_FLAG(int, iters, 5, "timed iterations per collective");

namespace {

using fsdp::comm::ProcessGroup;
using fsdp::comm::ReduceOp;

struct Row {
  std::string name;
  bool correct;
  double ms;
  double gib_per_s;  // algorithm bandwidth: bytes of the full buffer / time
};

template <typename Fn>
double TimeMs(ProcessGroup& pg, int iters, Fn&& fn) {
  pg.barrier()->wait();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) fn();
  const auto end = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::milli>(end - start).count() / iters;
}

}  // namespace

int main(int argc, char** argv) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain([&]() -> int {
    absl::ParseCommandLine(argc, argv);
    auto trace = std::make_shared<fsdp::comm::CommTrace>(fsdp::comm::CreateGlooProcessGroupFromEnv());
    ProcessGroup& pg = *trace;
    const int W = pg.size();
    const int me = pg.rank();
    const int64_t n = absl::GetFlag(FLAGS_mib) * (1 << 20) / 4;
    const int iters = absl::GetFlag(FLAGS_iters);
    std::vector<Row> rows;
    const double gib = 1024.0 * 1024.0 * 1024.0;

    {  // all_gather: chunk r of the output holds rank r's values.
      at::Tensor in = at::full({n}, static_cast<float>(me));
      at::Tensor out = at::empty({W, n});
      const double ms = TimeMs(pg, iters, [&] { pg.all_gather_into_tensor(out, in)->wait(); });
      bool ok = true;
      for (int r = 0; r < W; ++r) ok = ok && at::equal(out[r], at::full({n}, static_cast<float>(r)));
      rows.push_back({"all_gather_into_tensor", ok, ms, out.nbytes() / gib / (ms / 1e3)});
    }
    {  // reduce_scatter AVG: every element = mean of ranks.
      at::Tensor in = at::full({W * n}, static_cast<float>(me));
      at::Tensor out = at::empty({n});
      const double ms = TimeMs(pg, iters, [&] { pg.reduce_scatter_tensor(out, in, ReduceOp::Avg())->wait(); });
      const bool ok = at::allclose(out, at::full({n}, (W - 1) / 2.0f));
      rows.push_back({"reduce_scatter_tensor(AVG)", ok, ms, in.nbytes() / gib / (ms / 1e3)});
    }
    {  // all_reduce SUM, checked once on fresh data.
      at::Tensor t = at::full({n}, static_cast<float>(me + 1));
      pg.all_reduce(t)->wait();
      const bool ok = at::allclose(t, at::full({n}, W * (W + 1) / 2.0f));
      const double ms = TimeMs(pg, iters, [&] { pg.all_reduce(t, ReduceOp::Max())->wait(); });
      rows.push_back({"all_reduce(SUM, then MAX)", ok, ms, t.nbytes() / gib / (ms / 1e3)});
    }
    {  // broadcast from the last rank.
      at::Tensor t = at::full({n}, static_cast<float>(me));
      const double ms = TimeMs(pg, iters, [&] { pg.broadcast(t, W - 1)->wait(); });
      const bool ok = at::equal(t, at::full({n}, static_cast<float>(W - 1)));
      rows.push_back({"broadcast(root=W-1)", ok, ms, t.nbytes() / gib / (ms / 1e3)});
    }
    {  // all_to_all: rank i sends value 100*i + j to rank j.
      const int64_t per_peer = n / W;
      at::Tensor in = at::empty({W * per_peer});
      for (int j = 0; j < W; ++j) in.narrow(0, j * per_peer, per_peer).fill_(100.0 * me + j);
      at::Tensor out = at::empty({W * per_peer});
      const double ms = TimeMs(pg, iters, [&] { pg.all_to_all_single(out, in)->wait(); });
      bool ok = true;
      for (int j = 0; j < W; ++j) {
        ok = ok &&
             at::equal(out.narrow(0, j * per_peer, per_peer), at::full({per_peer}, static_cast<float>(100.0 * j + me)));
      }
      rows.push_back({"all_to_all_single", ok, ms, in.nbytes() / gib / (ms / 1e3)});
    }
    // Every rank's correctness, combined.
    at::Tensor all_ok = at::ones({1}, at::kLong);
    for (const Row& row : rows) {
      if (!row.correct) all_ok.zero_();
    }
    pg.all_reduce(all_ok, ReduceOp::Min())->wait();

    if (me == 0) {
      std::printf("\nlibtorch-fsdp collectives demo: %d ranks as processes, Gloo over TCPStore on %s\n", W,
                  "127.0.0.1");
      std::printf("payload %lld MiB per rank, %d timed iterations each\n\n",
                  static_cast<long long>(absl::GetFlag(FLAGS_mib)), iters);
      std::printf("%-28s %-8s %10s %12s\n", "collective", "result", "ms/iter", "GiB/s (alg)");
      for (const Row& row : rows) {
        std::printf("%-28s %-8s %10.2f %12.2f\n", row.name.c_str(), row.correct ? "ok" : "WRONG", row.ms,
                    row.gib_per_s);
      }
      std::printf("\nall ranks correct: %s; collectives issued by rank 0: %zu (%.1f MiB in)\n",
                  all_ok.item<int64_t>() == 1 ? "yes" : "NO", trace->records().size(),
                  trace->total_input_bytes() / (1024.0 * 1024.0));
    }
    pg.barrier()->wait();
    return all_ok.item<int64_t>() == 1 ? 0 : 1;
  });
}
