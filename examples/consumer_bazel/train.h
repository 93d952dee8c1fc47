// A small residual MLP trained with FSDP2 (fully_shard) on W ranks, threads of one process
// (libtorch_fsdp's Threaded backend) or processes of a torchrun-style launch, and the same
// training on one rank without FSDP, so that callers can check that sharded training computes
// what plain training does. examples/consumer_cmake compiles this file too.
#ifndef CONSUMER_BAZEL_TRAIN_H_
#define CONSUMER_BAZEL_TRAIN_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "comm/process_group.h"

namespace consumer {

struct TrainConfig {
  int world = 4;   // ranks; must divide kGlobalBatch
  int steps = 10;  // AdamW steps
  double lr = 1e-2;
};

// Rows of the global batch per step, split evenly over the ranks.
inline constexpr int64_t kGlobalBatch = 24;

struct TrainResult {
  std::vector<double> losses;                // global (all-rank mean) loss per step
  std::map<std::string, at::Tensor> params;  // full parameters after training, by name
  int64_t full_numel = 0;                    // elements of the unsharded model
  std::vector<int64_t> local_numel;          // per rank: elements it holds between steps
  int64_t max_chunk_numel = 0;               // sum over parameters of ceil(dim0 / W) rows
};

// FSDP2: every block, then the root, fully_shard'ed over a 1-D mesh of `world` threaded
// ranks; each rank trains on its slice of every global batch. Throws when a rank fails.
TrainResult TrainFsdp2(const TrainConfig& config);

// One rank of that training, on `group` (config.world ranks: a thread's group of
// fsdp::comm::CreateThreadedProcessGroups, or a process's of fsdp::comm::InitProcessGroupFromEnv).
// Collective. Every rank returns the losses and the full parameters; local_numel holds this
// rank's count only.
TrainResult TrainFsdp2Rank(const TrainConfig& config, const fsdp::comm::ProcessGroupPtr& group);

// The reference: the same model, initial values, data and optimizer on one rank, whole
// global batch per step.
TrainResult TrainSingleRank(const TrainConfig& config);

struct Comparison {
  double max_loss_diff = 0;           // relative to max(1, |reference|)
  double max_param_diff = 0;          // max |fsdp - ref| / max(1, max |ref|), over all parameters
  std::vector<std::string> problems;  // missing / extra / mis-shaped parameters
};
Comparison Compare(const TrainResult& fsdp, const TrainResult& reference);

// The tolerance of Comparison's differences, from AdamW and float32 rather than from what one
// machine produced. AdamW moves a parameter by about lr per step whatever the gradient's scale
// (lr * m / sqrt(v)), so `steps` steps move it by at most about steps * lr. FSDP2 sums every
// gradient in another order than one rank does (a mean over each rank's rows, then the
// reduce-scatter's average), and the two orders round differently: sums of this model's sizes
// (<= 24 terms, a few in a chain) differ by ~100 float32 ulps of a step. Allowed: 2^-10 of the
// total movement, i.e. 2^13 ulps (float32's epsilon is 2^-23), ~100x that rounding, for it
// compounding through the network over the steps. A wrong shard, a lost rank's gradient or a
// stale parameter is wrong by a whole step, lr, from the first step on. The loss follows the
// parameters, to the same relative accuracy.
double ParityTolerance(const TrainConfig& config);

}  // namespace consumer

#endif  // CONSUMER_BAZEL_TRAIN_H_
