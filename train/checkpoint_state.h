// The Stateful objects (dcp/stateful.h) the trainer checkpoints beside the model and optimizer,
// under torchtitan's names (torchtitan/components/checkpointer/base.py) where it has them:
//
//   "train_state"   {"step": int, "ntokens_seen": int}       torchtitan's Trainer.state_dict
//   "lr_scheduler"  {"last_epoch": int}                      LRSchedulersContainer.state_dict
//   "dataloader"    {"epoch", "windows_consumed", "seed"}    DataLoaderState (global, so a resume
//                                                            at another data-parallel degree
//                                                            continues the same token stream;
//                                                            torchtitan pickles its per-rank loader)
//   "rng"           {"cpu": uint8 tensor[, "cuda": ...]}     the default CPU generator's state and,
//                                                            where CUDA is available, the current
//                                                            device's (not in torchtitan)
//
// Contract: each object refers to what it saves (which must outlive it); load_state_dict checks
// every key and type (a c10::Error naming the object, the key and what it holds) and hands the
// values to the object's own loader (DataLoader::LoadState, LRSchedulers::LoadLastEpoch), which
// check them in turn. Not thread-safe.
#ifndef FSDP_TRAIN_CHECKPOINT_STATE_H_
#define FSDP_TRAIN_CHECKPOINT_STATE_H_

#include <cstdint>

#include "dcp/stateful.h"
#include "train/dataloader.h"
#include "train/lr_scheduler.h"

namespace fsdp::train {

// The step counter and this rank's tokens seen (torchtitan saves rank 0's, as DCP writes an
// entry once).
struct TrainProgress {
  int64_t step = 0;
  int64_t ntokens_seen = 0;
};

class TrainStateStateful : public dcp::Stateful {
 public:
  explicit TrainStateStateful(TrainProgress& progress) : progress_(progress) {}
  dcp::StateDict state_dict() const override;
  void load_state_dict(const dcp::StateDict& state) override;

 private:
  TrainProgress& progress_;
};

class LRSchedulersStateful : public dcp::Stateful {
 public:
  explicit LRSchedulersStateful(LRSchedulers& schedulers) : schedulers_(schedulers) {}
  dcp::StateDict state_dict() const override;
  void load_state_dict(const dcp::StateDict& state) override;

 private:
  LRSchedulers& schedulers_;
};

class DataLoaderStateful : public dcp::Stateful {
 public:
  explicit DataLoaderStateful(DataLoader& loader) : loader_(loader) {}
  dcp::StateDict state_dict() const override;
  void load_state_dict(const dcp::StateDict& state) override;

 private:
  DataLoader& loader_;
};

class RngStateful : public dcp::Stateful {
 public:
  dcp::StateDict state_dict() const override;
  void load_state_dict(const dcp::StateDict& state) override;
};

}  // namespace fsdp::train

#endif  // FSDP_TRAIN_CHECKPOINT_STATE_H_
