// PipelineSchedule: runs one training step of a pipeline on this rank, as PyTorch 2.15's
// torch/distributed/pipelining/schedules.py _PipelineScheduleRuntime: the schedule's
// compute-only action order (pipelining/schedule_orders.h), lowered with its sends, receives,
// waits, unshards and gradient reductions (pipelining/lowering.h), executed action by action.
//
//   pipelining::PipelineSchedule schedule(pipelining::ScheduleKind::k1F1B, {stage},
//                                         {.n_microbatches = 4, .loss_fn = mse});
//   std::vector<at::Tensor> losses;
//   schedule.step({inputs}, target, &losses);   // inputs on the first stage's rank, target on the last's
//   optimizer.step();
//
// Semantics (PyTorch's): the batch is split along dim 0 into n_microbatches; the last stage
// computes loss_fn(outputs, target piece) per microbatch and backpropagates it; gradients
// accumulate over the microbatches in each stage's parameters and, with scale_grads, are
// divided by n_microbatches at the stage's REDUCE_GRAD (so a mean loss gives the batch mean's
// gradient). step() returns the merged outputs on the rank holding the last stage (empty
// elsewhere) and fills `losses` there with one loss per microbatch.
//
// Contract: every rank of the stages' group builds the same schedule (kind or compute order,
// n_microbatches) over its own stages (one for GPipe / 1F1B; stages_per_rank for the others;
// the stage indices those of this rank under the schedule's placement: StageRank) and calls
// step() the same number of times. Point-to-point Works wait with the group's timeout, so a
// peer that never sends fails the step with a timeout naming peer and tag, not a hang (the
// flight recorder shows which stage stopped: docs/guide/debugging.md). An error during a step
// names the action, its position and this rank's lowered action list. Not thread-safe.
#ifndef FSDP_PIPELINING_PIPELINE_SCHEDULE_H_
#define FSDP_PIPELINING_PIPELINE_SCHEDULE_H_

#include <ATen/core/Tensor.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "pipelining/action.h"
#include "pipelining/lowering.h"
#include "pipelining/schedule_orders.h"
#include "pipelining/stage.h"

namespace fsdp::pipelining {

// The loss of one microbatch from the last stage's outputs and the target's piece.
using PipelineLossFn = std::function<at::Tensor(const std::vector<at::Tensor>& outputs, const at::Tensor& target)>;

struct PipelineScheduleOptions {
  int n_microbatches = 1;
  // Without one, step() runs forwards only (no backward actions are executed).
  PipelineLossFn loss_fn;
  bool scale_grads = true;
  LoweringOptions lowering;
  // Optional per-action timing (for profiling and bench/pipelining_bench.cc's bubble
  // fraction): called on this rank's thread after each action step() executes, every lowered
  // action (communication included; an OVERLAP_F_B's sub-actions one by one), with the
  // steady-clock times around it. For F, B and I, `start` is taken after the action's waits
  // (its receive, a pending UNSHARD), so [start, end) is the computation alone. Unset (the
  // default): no clock is read. It must not call back into the schedule.
  std::function<void(const Action& action, std::chrono::steady_clock::time_point start,
                     std::chrono::steady_clock::time_point end)>
      on_action;
};

class PipelineSchedule {
 public:
  // A built-in schedule (ScheduleKindFromName reads PyTorch's names).
  PipelineSchedule(ScheduleKind kind, std::vector<std::shared_ptr<PipelineStage>> stages,
                   PipelineScheduleOptions options);
  // A custom schedule: the compute-only order of every rank (e.g. ReadScheduleCsv, PyTorch's
  // _load_csv), stage placement by `stage_to_rank`.
  PipelineSchedule(const PipelineOrder& compute_order, std::function<int(int)> stage_to_rank,
                   std::vector<std::shared_ptr<PipelineStage>> stages, PipelineScheduleOptions options);

  // One step (see above). `args`: the whole batch's arguments of the first stage (ignored on
  // other ranks); `target`: the whole batch's target (used on the last stage's rank);
  // `kwargs`: whole-batch tensors every rank passes (PyTorch's keyword arguments of step(), as
  // torchtitan passes the positions), split into microbatches and given to every stage's
  // forward after its inputs: never sent between stages.
  std::vector<at::Tensor> step(const std::vector<at::Tensor>& args, const at::Tensor& target = {},
                               std::vector<at::Tensor>* losses = nullptr, const std::vector<at::Tensor>& kwargs = {});
  // PyTorch's eval(): the same step with the forwards only (no backward action runs, no
  // gradient changes); the last stage computes loss_fn per microbatch where `target` is given
  // and fills `losses`. Run it under at::NoGradGuard to keep no autograd graph.
  std::vector<at::Tensor> eval(const std::vector<at::Tensor>& args, const at::Tensor& target = {},
                               std::vector<at::Tensor>* losses = nullptr, const std::vector<at::Tensor>& kwargs = {});

  // This rank's lowered action list (PyTorch's pipeline_order_with_comms[rank]).
  const std::vector<Action>& actions() const { return actions_; }
  const std::map<int, std::vector<Action>>& all_actions() const { return lowered_; }
  int n_microbatches() const { return options_.n_microbatches; }

 private:
  void Init(const PipelineOrder& compute_order);
  std::vector<at::Tensor> Run(const std::vector<at::Tensor>& args, const at::Tensor& target,
                              std::vector<at::Tensor>* losses, const std::vector<at::Tensor>& kwargs, bool backward);
  void InferMetaIfNeeded(const std::vector<std::vector<at::Tensor>>& arg_mbs,
                         const std::vector<std::vector<at::Tensor>>& kwarg_mbs);
  // Perform, timed for options_.on_action when set.
  void TimedPerform(const Action& action, const std::vector<std::vector<at::Tensor>>& arg_mbs,
                    const std::vector<at::Tensor>& target_mbs);
  void Perform(const Action& action, const std::vector<std::vector<at::Tensor>>& arg_mbs,
               const std::vector<at::Tensor>& target_mbs);
  PipelineStage& StageOf(const Action& action);
  int LocalIndex(int stage) const;  // into stages_; -1 where the stage is not on this rank

  std::vector<std::shared_ptr<PipelineStage>> stages_;
  PipelineScheduleOptions options_;
  std::function<int(int)> stage_to_rank_;
  int num_stages_ = 0;
  std::vector<int> local_index_;  // by stage index
  std::map<int, std::vector<Action>> lowered_;
  std::vector<Action> actions_;
  // (stage, microbatch) of each I in actions_ whose next action, past waits for sends, is its
  // own W: that I runs the whole backward (nothing can use its input gradient before W ends;
  // docs/design/measured-choices.md, "One autograd pass for an I followed by its own W").
  std::set<std::pair<int, int>> input_with_weight_;
  struct StepState;
  std::unique_ptr<StepState> state_;

 public:
  ~PipelineSchedule();
  PipelineSchedule(PipelineSchedule&&) noexcept;
};

}  // namespace fsdp::pipelining

#endif  // FSDP_PIPELINING_PIPELINE_SCHEDULE_H_
