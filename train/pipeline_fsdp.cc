#include "train/pipeline_fsdp.h"

#include <utility>

namespace fsdp::train {

FsdpStageDataParallel::FsdpStageDataParallel(fsdp2::FSDPModule root, std::vector<fsdp2::FSDPModule> modules)
    : root_(root), all_(std::move(modules)) {
  all_.push_back(root_);
}

void FsdpStageDataParallel::Unshard() {
  for (fsdp2::FSDPModule& m : all_) m.unshard(/*async_op=*/true);
}

void FsdpStageDataParallel::WaitUnshard() {
  for (fsdp2::FSDPModule& m : all_) m.wait_for_unshard();
}

void FsdpStageDataParallel::Reshard() {
  for (fsdp2::FSDPModule& m : all_) m.reshard();
}

void FsdpStageDataParallel::BeforeBackward() {
  root_.set_manual_backward_finalization(true);
  root_.set_reshard_after_backward(false);
  root_.set_requires_gradient_sync(false);
}

void FsdpStageDataParallel::ReduceGrad() {
  root_.set_requires_gradient_sync(true);
  root_.set_reshard_after_backward(true);
  root_.finalize_backward();
  root_.set_manual_backward_finalization(false);
}

}  // namespace fsdp::train
