// Periodic checkpoints of one training run under one root directory, and finding the one to
// resume from after a restart (torchrun --max-restarts relaunches every rank; each starts
// from the latest complete checkpoint).
//
//   root/step-<N>/   a dcp::Save / AsyncSave directory; N = the step training resumes at
//
// A checkpoint is complete only once rank 0 wrote its `.metadata`, which dcp::Save writes
// last and atomically (temporary file + rename, after every rank's data file is on disk),
// and removes first when it overwrites a directory. A directory without a valid
// `.metadata` is the leftover of a save that did not finish (a rank died during the write):
// it is reported and skipped, never loaded.
//
// Local (no collective): call on every rank; ranks that see the same filesystem get the
// same answer (check that across ranks when they may not). Thread-compatible. Errors: a
// root that exists but cannot be listed throws c10::Error naming it.
#ifndef FSDP_DCP_CHECKPOINT_DIRS_H_
#define FSDP_DCP_CHECKPOINT_DIRS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::dcp {

// root + "/step-<step>"; `step` >= 0.
std::string StepCheckpointDir(const std::string& root, int64_t step);

struct IncompleteCheckpoint {
  std::string dir;
  int64_t step = 0;
  std::string reason;  // e.g. "no .metadata (the save did not finish)"
};

struct CheckpointScan {
  // The complete checkpoint with the highest step; empty (and step -1) when there is none.
  std::string latest_dir;
  int64_t latest_step = -1;
  // The steps of every complete checkpoint, ascending (latest_step is the last).
  std::vector<int64_t> complete_steps;
  // Every step-<N> directory that is not a complete checkpoint, by step.
  std::vector<IncompleteCheckpoint> incomplete;
};

// Scans `root`'s step-<N> subdirectories (other names are ignored; a missing root holds
// none). `.metadata` is read with the validating reader (checkpoint/dcp_storage.h).
CheckpointScan ScanCheckpoints(const std::string& root);

}  // namespace fsdp::dcp

#endif  // FSDP_DCP_CHECKPOINT_DIRS_H_
