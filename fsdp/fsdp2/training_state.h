// FSDP2's explicit state machines (torch/distributed/fsdp/_fully_shard/_fsdp_common.py).
#ifndef FSDP_FSDP_FSDP2_TRAINING_STATE_H_
#define FSDP_FSDP_FSDP2_TRAINING_STATE_H_

namespace fsdp {

// Where a module / parameter group is in the training step (PyTorch's TrainingState).
enum class TrainingState { kIdle, kForward, kPreBackward, kPostBackward };

// Which parameter representation is registered on the module (PyTorch's ShardedState):
// kSharded: the sharded parameter (a view into FSDP's padded sharded storage);
// kShardedPostForward: resharded after forward to a smaller post-forward mesh;
// kUnsharded: the full parameter (a view into the all-gather output).
enum class ShardedState { kSharded, kShardedPostForward, kUnsharded };

inline const char* ToString(TrainingState s) {
  switch (s) {
    case TrainingState::kIdle: return "IDLE";
    case TrainingState::kForward: return "FORWARD";
    case TrainingState::kPreBackward: return "PRE_BACKWARD";
    case TrainingState::kPostBackward: return "POST_BACKWARD";
  }
  return "?";
}

inline const char* ToString(ShardedState s) {
  switch (s) {
    case ShardedState::kSharded: return "SHARDED";
    case ShardedState::kShardedPostForward: return "SHARDED_POST_FORWARD";
    case ShardedState::kUnsharded: return "UNSHARDED";
  }
  return "?";
}

}  // namespace fsdp

#endif  // FSDP_FSDP_FSDP2_TRAINING_STATE_H_
