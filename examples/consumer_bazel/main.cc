// Trains a small MLP with FSDP2 (fully_shard) on W threaded ranks, then on one rank without
// FSDP, and compares: PASS (exit 0) or FAIL (exit 1).
//   bazel run //:consumer_demo -- [W=4] [steps=10]
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "comm/main_guard.h"
#include "train.h"

int main(int argc, char** argv) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain([&]() -> int {
    consumer::TrainConfig config;
    if (argc > 1) config.world = std::atoi(argv[1]);
    if (argc > 2) config.steps = std::atoi(argv[2]);
    const double tol = consumer::ParityTolerance(config);
    try {
      const consumer::TrainResult fsdp = consumer::TrainFsdp2(config);
      const consumer::TrainResult ref = consumer::TrainSingleRank(config);
      std::printf("FSDP2 (fully_shard) on %d threaded ranks vs one rank, %d AdamW steps\n", config.world, config.steps);
      std::printf("%4s %12s %12s\n", "step", "loss fsdp2", "loss 1 rank");
      for (size_t i = 0; i < ref.losses.size(); ++i) {
        std::printf("%4zu %12.6f %12.6f\n", i, i < fsdp.losses.size() ? fsdp.losses[i] : -1.0, ref.losses[i]);
      }
      std::printf("parameter elements: %ld in the model, per rank:", long(fsdp.full_numel));
      for (int64_t n : fsdp.local_numel) std::printf(" %ld", long(n));
      std::printf("\n");
      const consumer::Comparison c = consumer::Compare(fsdp, ref);
      for (const auto& p : c.problems) std::printf("problem: %s\n", p.c_str());
      const bool ok = c.problems.empty() && c.max_loss_diff <= tol && c.max_param_diff <= tol;
      std::printf("max loss diff %.1e, max param diff %.1e (tol %.1e) over %zu tensors: %s\n", c.max_loss_diff,
                  c.max_param_diff, tol, ref.params.size(), ok ? "PASS" : "FAIL");
      return ok ? 0 : 1;
    } catch (const std::exception& e) {
      std::printf("FAIL: %s\n", e.what());
      return 1;
    }
  });
}
