// What a training program needs to survive a lost rank (the examples use it): periodic
// sharded checkpoints written in the background, resuming from the latest complete one when
// torchrun relaunches the job, and an environment-driven fault hook that tests kill a rank
// with (not a sleep race).
//
//   PeriodicCheckpointer ckpt(root, /*every=*/5, world, ReadInjectedFault());
//   int64_t first = ckpt.Resume(*model, &opt);        // 0, or the step the latest save resumes at
//   for (int64_t step = first; step < total; ++step) {
//     ckpt.fault().MaybeKillAt(world->rank(), step);  // test hook, first launch only
//     ...train step...
//     ckpt.AfterStep(step, total, *model, opt);       // async DCP save every `every` steps
//   }
//   ckpt.Finish();                                    // waits for the last save
//
// A dcp::CheckpointManager (dcp/checkpoint_manager.h: async, every checkpoint kept) for the
// examples' 0-based step loop, with their log lines and fault hooks. Checkpoints go to
// root/step-<N>, N = the next step to run (the manager's steps done), with a Stateful "train"
// {"step": N} (the data order is a function of the step here, so the step is the whole sampler
// state). A save waits for the previous one first (one in flight, as torchtitan's). The model
// and optimizer of the first Resume / AfterStep are the ones checkpointed. Collective: every
// rank calls every method in the same order.
#ifndef FSDP_EXAMPLES_TRAINING_CHECKPOINTS_H_
#define FSDP_EXAMPLES_TRAINING_CHECKPOINTS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "comm/process_group.h"
#include "dcp/checkpoint_manager.h"
#include "dcp/stateful.h"

namespace fsdp::examples {

// FSDP_FAULT=kill_at_step:<rank>:<step>  rank <rank> sends itself SIGKILL as step <step> starts;
// FSDP_FAULT=kill_in_save:<rank>:<step>  ... right after it wrote its data file of the periodic
//                                         checkpoint of step <step> (before `.metadata`).
// Only on torchrun's first attempt (TORCHELASTIC_RESTART_COUNT unset or 0), so that the
// relaunched job runs clean. Unset or empty: no fault. A malformed value throws c10::Error
// naming FSDP_FAULT and the value.
struct InjectedFault {
  enum class Kind { kNone, kKillAtStep, kKillInSave };
  Kind kind = Kind::kNone;
  int rank = -1;
  int64_t step = -1;

  void MaybeKillAt(int this_rank, int64_t step_now) const;
  void MaybeKillInSave(int this_rank, int64_t save_step) const;
};
InjectedFault ReadInjectedFault(const std::function<std::optional<std::string>(const std::string&)>& getenv = {});

class PeriodicCheckpointer {
 public:
  // every == 0: no periodic checkpoints (Resume returns 0, AfterStep does nothing).
  // `world`: the model's world group, untraced (the saves' own collectives).
  PeriodicCheckpointer(std::string root, int64_t every, comm::ProcessGroupPtr world, InjectedFault fault, bool log);
  ~PeriodicCheckpointer();

  // Loads the latest complete checkpoint under root (dcp::Load: any world size) and returns
  // the step it resumes at; 0 when there is none. Rank 0 prints what it loaded and every
  // incomplete checkpoint it skipped. Throws when the ranks disagree on the latest one.
  int64_t Resume(torch::nn::Module& model, torch::optim::Optimizer* optimizer);
  // After step `step` (0-based) of `total` ran: starts an async save of root/step-<step+1>
  // when step + 1 is a multiple of `every` and below `total`.
  void AfterStep(int64_t step, int64_t total, torch::nn::Module& model, torch::optim::Optimizer& optimizer);
  // Waits for the save in flight (throws its error).
  void Finish();

  const InjectedFault& fault() const { return fault_; }
  int64_t saves() const { return saves_; }

 private:
  dcp::CheckpointManager& Manager(torch::nn::Module& model, torch::optim::Optimizer* optimizer);

  std::string root_;
  int64_t every_;
  comm::ProcessGroupPtr world_;
  InjectedFault fault_;
  bool log_;
  std::unique_ptr<dcp::Stateful> step_;  // {"step": N}
  std::unique_ptr<dcp::CheckpointManager> manager_;
  int64_t saves_ = 0;
};

}  // namespace fsdp::examples

#endif  // FSDP_EXAMPLES_TRAINING_CHECKPOINTS_H_
