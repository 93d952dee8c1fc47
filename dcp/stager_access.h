// What dcp/save.cc's AsyncSave does with a Stager (dcp/stager.h); internal to //dcp.
#ifndef FSDP_DCP_STAGER_ACCESS_H_
#define FSDP_DCP_STAGER_ACCESS_H_

#include <ATen/core/Tensor.h>

#include <future>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/dcp_storage.h"
#include "dcp/stager.h"

namespace fsdp::dcp::internal {

// What a save through a stager keeps for the next one (PyTorch's DefaultSavePlanner with
// enable_plan_caching, torch/distributed/checkpoint/default_planner.py): while every rank's
// plan and items stay the same, the next save skips the plan's gather and scatter and this
// rank's fragment prediction.
struct SavePlanCache {
  bool has_plan = false, has_fragment = false;
  std::vector<char> plan;            // this rank's encoded plan (plan.h EncodePlan)
  std::vector<char> keep;            // rank 0's decisions for it
  std::string items;                 // the signature of this rank's items: keys, dtypes, shapes, byte lengths
  checkpoint::DcpFragment fragment;  // their predicted fragment, with object paths
  std::vector<char> payload;         // and its serialization, for rank 0
};

struct StagerAccess {
  static SavePlanCache& Cache(Stager& stager);
  // Blocks until the previous save through `stager` has written its file.
  static void WaitIdle(Stager& stager);
  // Copies `sources` (CPU or device tensors) into the buffers, (re)allocated to their layout;
  // returns the buffers (contiguous host tensors), valid until the next Stage. With async
  // staging the copy is launched, not done: StagingEvent completes when it is.
  static std::vector<at::Tensor> Stage(Stager& stager, const std::vector<at::Tensor>& sources);
  // The completion of the last Stage's copy (null without async staging).
  static device::EventPtr StagingEvent(Stager& stager);
  // A save now uses the buffers: the next WaitIdle blocks until the returned promise is set.
  static std::shared_ptr<std::promise<void>> MarkBusy(Stager& stager);
};

}  // namespace fsdp::dcp::internal

#endif  // FSDP_DCP_STAGER_ACCESS_H_
