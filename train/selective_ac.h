// torchtitan 0.3.0's SelectiveAC (torchtitan/distributed/activation_checkpoint.py) as a policy of
// the C++ selective checkpoint (fsdp/activation_checkpointing/selective_checkpoint.h): keep the
// outputs of the operators torchtitan keeps (_get_default_save_ops: matmuls, attention kernels,
// max, functional reduce-scatter / all-to-all; testdata/golden_sac_save_ops.txt is torchtitan's
// own list), except every second matmul (aten::mm / aten::linear), which is recomputed to balance
// memory and compute, and except matmuls whose weight shape is that of a Linear named in
// force_recompute_mm_shapes_by_fqns (any matmul of that shape, as torchtitan's note says).
//
// Contract: TorchtitanSelectivePolicy reads `block`'s modules once (an error naming the key and
// the module if a name matches a module that is no torch::nn::Linear); the factory it returns
// makes a fresh policy (its matmul count at zero) per checkpointed forward. Thread-compatible.
#ifndef FSDP_TRAIN_SELECTIVE_AC_H_
#define FSDP_TRAIN_SELECTIVE_AC_H_

#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "fsdp/activation_checkpointing/selective_checkpoint.h"

namespace fsdp::train {

// The kept operators, as "namespace::name" (default overload) or "namespace::name.overload".
const std::vector<std::string>& TorchtitanSaveOps();

// `block_fqn` is the block's name in the model ("model.layers.3"): torchtitan matches the names
// in `force_recompute_mm_shapes_by_fqns` as substrings of "<block_fqn>.<module name>".
activation_checkpointing::SelectivePolicyFactory TorchtitanSelectivePolicy(
    torch::nn::Module& block, const std::string& block_fqn,
    const std::vector<std::string>& force_recompute_mm_shapes_by_fqns);

}  // namespace fsdp::train

#endif  // FSDP_TRAIN_SELECTIVE_AC_H_
