// A small residual MLP trained with FSDP2 (fully_shard) on W ranks that are threads of one
// process (libtorch_fsdp's Threaded backend), and the same training on one rank without
// FSDP, so that callers can check that sharded training computes what plain training does.
#ifndef CONSUMER_BAZEL_TRAIN_H_
#define CONSUMER_BAZEL_TRAIN_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace consumer {

struct TrainConfig {
  int world = 4;   // ranks (threads); must divide kGlobalBatch
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

// The reference: the same model, initial values, data and optimizer on one rank, whole
// global batch per step.
TrainResult TrainSingleRank(const TrainConfig& config);

struct Comparison {
  double max_loss_diff = 0;           // relative to max(1, |reference|)
  double max_param_diff = 0;          // max |fsdp - ref| / max(1, max |ref|), over all parameters
  std::vector<std::string> problems;  // missing / extra / mis-shaped parameters
};
Comparison Compare(const TrainResult& fsdp, const TrainResult& reference);

}  // namespace consumer

#endif  // CONSUMER_BAZEL_TRAIN_H_
