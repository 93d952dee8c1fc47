// FSDP2 inside a pipeline stage: pipelining::StageDataParallel over the stage module's
// fully_shard handles, as PyTorch 2.15's pipelining runtime drives an FSDPModule stage
// (torch/distributed/pipelining/schedules.py UNSHARD / RESHARD / REDUCE_GRAD, stage.py
// backward_maybe_with_nosync and start_gradient_reduction) and torchtitan composes them
// (torchtitan/distributed/pipeline_parallel.py).
//
//   for (auto& block : stage_blocks) blocks.push_back(fsdp2::fully_shard(block, dp_options));
//   fsdp2::FSDPModule root = fsdp2::fully_shard(stage_module, dp_options);
//   options.data_parallel = std::make_shared<train::FsdpStageDataParallel>(root, blocks);
//
// UNSHARD all-gathers every given module (async, waited before the stage computes); each
// backward runs with gradient sync and reshard-after-backward off under manual backward
// finalization, so the microbatches' unsharded gradients accumulate; REDUCE_GRAD turns both
// back on and finalizes: one reduce-scatter per parameter group per step, then reshard.
//
// Contract: `root` is the fully_shard root of the stage's module, `modules` the stage's other
// fully_shard'ed modules (its blocks); all of one stage on one rank, used by its schedule
// only. Errors: FSDP2's (c10::Error).
#ifndef FSDP_TRAIN_PIPELINE_FSDP_H_
#define FSDP_TRAIN_PIPELINE_FSDP_H_

#include <torch/nn/module.h>

#include <vector>

#include "comm/process_group.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "pipelining/stage.h"

namespace fsdp::train {

class FsdpStageDataParallel final : public pipelining::StageDataParallel {
 public:
  FsdpStageDataParallel(fsdp2::FSDPModule root, std::vector<fsdp2::FSDPModule> modules);
  void Unshard() override;
  void WaitUnshard() override;
  void Reshard() override;
  void BeforeBackward() override;
  void ReduceGrad() override;

 private:
  fsdp2::FSDPModule root_;
  std::vector<fsdp2::FSDPModule> all_;  // modules, then the root
};

// torchtitan's clip_grad_norm_ with a pp mesh (torchtitan/distributed/utils.py): the total
// p-norm of the gradients of this rank's stage modules (each one's through
// fsdp2::clip_grad_norm_, over its FSDP and TP meshes) combined over the pipeline group
// `pp` (the p-th powers summed, or the max for p = inf), so every rank gets the norm one
// rank training the whole model would; then every gradient of the stages scaled by
// clamp(max_norm / (total + 1e-6), max = 1). Returns the total before clipping. Collective
// over `pp` and the stages' meshes; call after the step's schedule, before the optimizer.
double ClipGradNormAcrossStages(const std::vector<torch::nn::Module*>& stage_modules, const comm::ProcessGroupPtr& pp,
                                double max_norm, double norm_type = 2.0);

}  // namespace fsdp::train

#endif  // FSDP_TRAIN_PIPELINE_FSDP_H_
