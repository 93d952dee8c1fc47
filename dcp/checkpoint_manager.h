// The checkpoints of a training run: torchtitan's CheckpointManager
// (torchtitan/components/checkpoint.py, components/checkpointer/dcp.py, torchtitan 0.3.0) over
// dcp::Save / AsyncSave / Load, for one model, its optimizer and the run's Stateful objects
// (data position, schedule, step counter, RNG: dcp/stateful.h).
//
//   CheckpointManager ckpt(*model, &optim, {{"train_state", &train}, {"dataloader", &data}},
//                          {.folder = "/ckpt/run1", .interval = 500, .keep_latest_k = 3}, world);
//   int64_t step = std::max<int64_t>(ckpt.Load(), 0);   // the latest complete checkpoint, if any
//   while (step < steps) { Train(++step); ckpt.Save(step, step == steps); }
//
// Layout: folder/step-<N>/ (dcp::Save directories, N = the step after which it was saved), as
// torchtitan's. A checkpoint is complete once rank 0 wrote its `.metadata`, last and
// atomically; a directory without a valid one is never loaded (dcp/checkpoint_dirs.h).
//
// Behaviour, as torchtitan's where it has one:
//  * Save(step, last_step) saves when step % interval == 0, when last_step, or at step 1 with
//    enable_first_step_checkpoint. The last save holds only the model with
//    last_save_model_only (torchtitan's default; a run then cannot resume from it, only export),
//    in export_dtype.
//    With `async`, the save is a dcp::AsyncSave into reused staging buffers (dcp/stager.h): the
//    step waits only for the copy into them, or with async_staging not even for that (call
//    MaybeWaitForStaging() before the optimizer step changes what was saved); at most one save
//    is in flight (the next Save waits for it first: last_wait_seconds()).
//  * keep_latest_k > 0: once a save is complete (for an async one: when it is waited for),
//    rank 0 removes the older complete checkpoints beyond the newest k and any incomplete
//    directory older than the newest complete one (but a Hugging Face export's): an older checkpoint is removed only
//    after a newer one is complete. A directory is removed `.metadata` first, so a removal cut short never leaves one
//    that looks complete.
//  * Load() loads step-<load_step>, or with load_step -1 the newest complete checkpoint, and
//    returns its step; -1 when there is none (a fresh run; load_step >= 0 must exist). Objects
//    and "optimizer" named in exclude_from_loading keep their state ("model" cannot be
//    excluded). The ranks must agree on the newest complete step (a c10::Error otherwise: the
//    folder must be shared).
//  * Errors: a failed save throws on every rank, naming the directory and the cause (the OS
//    error); no older checkpoint has been removed for it. A synchronous one fails its Save; an
//    async one at the first Save (or Wait) after every rank's writer ended, so at the step
//    after it: Save is to be called at every step (a step without a save costs one small
//    all-reduce while a save is in flight). With continue_on_save_failure it is a warning instead
//    (failures(), last_failure()), and a save due at that step still starts.
//
// Contract: the constructor stores references (model, optimizer, objects must outlive the
// manager) and checks the options (c10::Error naming the option). Load, Save and Wait are
// collective over `world`, the model's world group. The destructor waits for a save in flight
// (a failure is reported on stderr). Not thread-safe.
#ifndef FSDP_DCP_CHECKPOINT_MANAGER_H_
#define FSDP_DCP_CHECKPOINT_MANAGER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/process_group.h"
#include "dcp/checkpoint_dirs.h"
#include "dcp/dcp.h"
#include "dcp/stager.h"
#include "dcp/stateful.h"

namespace fsdp::dcp {

struct CheckpointManagerOptions {
  std::string folder;                             // required
  int64_t interval = 500;                         // >= 1
  int64_t keep_latest_k = 10;                     // 0: keep every checkpoint; else >= 2 (torchtitan's rule)
  int64_t load_step = -1;                         // -1: the newest complete checkpoint
  std::vector<std::string> exclude_from_loading;  // "optimizer" or names of the objects
  bool async = false;
  // Async saves copy into buffers allocated once and reused (dcp/stager.h); pinned where CUDA
  // is (torchtitan's async_with_pinned_mem).
  bool pin_memory = false;
  // The copy into them overlaps the next step (StagerOptions::async_staging; torchtitan's
  // async_with_pinned_mem): MaybeWaitForStaging() before the optimizer step.
  bool async_staging = false;
  bool enable_first_step_checkpoint = false;
  bool last_save_model_only = true;
  // The dtype of the model-only last save's floating-point tensors (torchtitan's export_dtype;
  // a load casts back). Unset: the model's.
  std::optional<at::ScalarType> export_dtype;
  // SaveOptions::flatten_optimizer_state_dict for every save (torchtitan's, and required
  // where ranks hold different parameters: pipeline stages).
  bool flatten_optimizer_state_dict = false;
  // SaveOptions::stored_fqn for every save, and its inverse (StoredLayout) for every load: the
  // checkpoint's name for each model FQN. Null: the FQNs.
  std::function<std::string(const std::string& fqn)> stored_fqn;
  // Called on each rank's writing thread once its data file of the checkpoint of `step` is on
  // disk, before `.metadata` (dcp::SaveOptions::on_rank_file_written: e.g. an upload, or a test's
  // fault). Null: none.
  std::function<void(int64_t step, const std::string& data_file)> on_rank_file_written;
  // A failed save is a warning and the run goes on (an older complete checkpoint stays
  // loadable); false: it throws, as torchtitan's does.
  bool continue_on_save_failure = false;
};

class CheckpointManager {
 public:
  CheckpointManager(torch::nn::Module& model, torch::optim::Optimizer* optimizer, StatefulItems stateful,
                    CheckpointManagerOptions options, comm::ProcessGroupPtr world);
  ~CheckpointManager();
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  int64_t Load();
  void Save(int64_t step, bool last_step = false);
  // Waits for the save in flight (rethrowing its error on every rank) and purges.
  void Wait();
  // torchtitan's maybe_wait_for_staging: blocks until the last async save's copy into its
  // buffers finished (at once without async_staging), throwing its error. Local.
  void MaybeWaitForStaging();
  // folder/step-<step>.
  std::string StepDirectory(int64_t step) const;
  // The scan of `folder` the last Load made to find the newest complete checkpoint (its
  // incomplete folders, for a log); empty when it loaded a load_step.
  const CheckpointScan& last_scan() const { return last_scan_; }
  // How long the last Save waited for the save before it (async; 0 if it did not).
  double last_wait_seconds() const { return last_wait_seconds_; }
  // With continue_on_save_failure: how many saves failed, and the last one's error.
  int64_t failures() const { return failures_; }
  const std::string& last_failure() const { return last_failure_; }

 private:
  void StartSave(int64_t step, bool last_step);
  // Runs `body`; its c10::Error propagates, or with continue_on_save_failure is counted and warned.
  void ReportFailures(const std::function<void()>& body);
  void Purge();

  torch::nn::Module& model_;
  torch::optim::Optimizer* optimizer_;
  StatefulItems stateful_;
  CheckpointManagerOptions options_;
  comm::ProcessGroupPtr world_;
  comm::ProcessGroupPtr background_;  // AsyncSave's group, made at the first async save
  std::shared_ptr<Stager> stager_;    // made at the first async save
  std::unique_ptr<AsyncSaveHandle> in_flight_;
  std::string in_flight_dir_;
  double last_wait_seconds_ = 0;
  int64_t failures_ = 0;
  std::string last_failure_;
  CheckpointScan last_scan_;
};

}  // namespace fsdp::dcp

#endif  // FSDP_DCP_CHECKPOINT_MANAGER_H_
