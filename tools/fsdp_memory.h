// fsdp_plan --memory: the per-rank allocation peak of a training step, predicted from the
// sharding plan of one FSDP unit (a block) repeated `units` times, FULL_SHARD, the steady
// state after the first optimizer step (optimizer state allocated).
//
// The model walks the step as FSDP runs it (both FSDPs alike; bench/e2e's measured peaks
// against it: docs/development/benchmarks.md) and takes the largest total of:
//   persistent   units x (sharded parameters + optimizer state), all steps long;
//   forward k    + activations of the units before k + unit k's unsharded parameters and
//                the next unit's (prefetched);
//   backward k   (units n-1 .. 0) + the sharded gradients of the units after k + the
//                activations of units 0..k + unit k's and the prefetched unit k-1's
//                unsharded parameters (with reshard_after_forward false: those of all units
//                0..k, kept since forward) + unit k's unsharded gradients, and then its
//                reduce-scatter input: FSDP1's flat gradient next to the original parameters'
//                gradients, all of them beside the unsharded unit; FSDP2's copy-in buffer
//                after the unit was resharded (FSDPParamGroup::PostBackward reshards first),
//                so in its place;
//   optimizer    + every sharded gradient + two temporaries the size of the largest
//                parameter shard (torch::optim's AdamW: sqrt and the division).
// Activations are what the caller says each unit saves for backward (`activation_bytes`):
// the model cannot see the forward. Not modelled: the backend's own copies (Gloo's
// reduce-scatter clones its input), allocator fragmentation, CPU offload, HSDP's all-reduce.
#ifndef TOOLS_FSDP_MEMORY_H_
#define TOOLS_FSDP_MEMORY_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "tools/fsdp_plan_lib.h"

namespace fsdp_plan {

struct MemoryOptions {
  int64_t units = 1;             // FSDP units of the plan's shapes (identical blocks)
  int64_t optimizer_states = 2;  // per parameter element: AdamW / Adam 2, SGD 0, momentum 1
  bool reshard_after_forward = true;
  int64_t activation_bytes = 0;  // per unit per rank, saved for backward
};

// The --memory flags as typed.
struct RawMemoryFlags {
  std::string units = "1";
  std::string optimizer = "adamw";  // adamw|adam -> 2 states, sgd -> 0, sgd_momentum|adagrad|rmsprop -> 1
  std::string activation_bytes = "0";
  bool reshard_after_forward = true;
};

// "" on success, else one line naming the flag and the offending value.
std::string ParseMemoryOptions(const RawMemoryFlags& flags, MemoryOptions* out);

struct MemoryEstimate {
  int64_t sharded_params = 0;   // all units, per rank, as stored (padded)
  int64_t optimizer_state = 0;  // all units
  int64_t sharded_grads = 0;    // all units
  int64_t unsharded_unit = 0;   // one unit's unsharded parameters (the unsharded dtype)
  int64_t unsharded_grads = 0;  // one unit's unsharded gradients
  int64_t reduce_scatter_input = 0;
  int64_t activations = 0;  // all units
  int64_t peak = 0;
  std::string peak_phase;  // "backward of unit 1", "optimizer step", ...
};

// Preconditions: plan from MakePlan; options.units >= 1, the rest >= 0.
MemoryEstimate EstimateMemory(const Plan& plan, const MemoryOptions& options);

std::string FormatMemoryText(const MemoryEstimate& m);
// The JSON object's members without braces ("\"memory\": {...}"), for FormatJson's caller.
std::string FormatMemoryJson(const MemoryEstimate& m);

}  // namespace fsdp_plan

#endif  // TOOLS_FSDP_MEMORY_H_
