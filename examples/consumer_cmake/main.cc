// FSDP2 (fully_shard) training on the processes of a torchrun-style launch, built against the
// installed CMake package (find_package(LibtorchFsdp)), compared with the same training on one
// rank without FSDP. Every rank prints its verdict and exits 0 on PASS, 1 on FAIL.
//
//   ./x run -n 2 build/consumer-cmake/consumer_fsdp2 [steps=10]
//   (or torchrun's variables: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; tools/cmake_package_check.sh)
//
// The model, data, training loop and comparison are examples/consumer_bazel/train.cc's, which
// CMakeLists.txt compiles from there: the Bazel consumer runs them on threaded ranks.
#include <cstdio>
#include <cstdlib>

#include "comm/init_process_group.h"
#include "comm/main_guard.h"
#include "train.h"

int main(int argc, char** argv) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain([&]() -> int {
    // Gloo over a TCPStore at MASTER_ADDR:MASTER_PORT, as PyTorch's init_process_group on CPU.
    const fsdp::comm::DeviceProcessGroup pg = fsdp::comm::InitProcessGroupFromEnv("cpu");
    const int rank = pg.group->rank();
    consumer::TrainConfig config;
    config.world = pg.group->size();
    if (argc > 1) config.steps = std::atoi(argv[1]);

    const consumer::TrainResult fsdp = consumer::TrainFsdp2Rank(config, pg.group);
    const consumer::TrainResult ref = consumer::TrainSingleRank(config);
    const consumer::Comparison c = consumer::Compare(fsdp, ref);

    const double tol = consumer::ParityTolerance(config);
    // Sharded: between steps this rank holds at most ceil(dim0 / W) rows of every parameter.
    const int64_t held = fsdp.local_numel.front();
    const bool sharded = config.world == 1 || (held <= fsdp.max_chunk_numel && held < fsdp.full_numel);
    const bool ok = sharded && c.problems.empty() && c.max_loss_diff <= tol && c.max_param_diff <= tol;

    if (rank == 0) {
      std::printf("FSDP2 (fully_shard) on %d processes vs one rank, %d AdamW steps\n", config.world, config.steps);
      std::printf("loss per step (fsdp2 / one rank):");
      for (size_t i = 0; i < ref.losses.size() && i < fsdp.losses.size(); ++i) {
        std::printf(" %.5f/%.5f", fsdp.losses[i], ref.losses[i]);
      }
      std::printf("\n");
      for (const auto& p : c.problems) std::printf("problem: %s\n", p.c_str());
    }
    std::printf(
        "[rank %d] holds %ld of %ld parameter elements; max loss diff %.1e, max param diff %.1e "
        "(tol %.1e) over %zu tensors: %s\n",
        rank, long(held), long(fsdp.full_numel), c.max_loss_diff, c.max_param_diff, tol, ref.params.size(),
        ok        ? "PASS"
        : sharded ? "FAIL"
                  : "FAIL (not sharded)");
    return ok ? 0 : 1;
  });
}
