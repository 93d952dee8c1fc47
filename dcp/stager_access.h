// What dcp/save.cc's AsyncSave does with a Stager (dcp/stager.h); internal to //dcp.
#ifndef FSDP_DCP_STAGER_ACCESS_H_
#define FSDP_DCP_STAGER_ACCESS_H_

#include <ATen/core/Tensor.h>

#include <future>
#include <memory>
#include <vector>

#include "dcp/stager.h"

namespace fsdp::dcp::internal {

struct StagerAccess {
  // Blocks until the previous save through `stager` has written its file.
  static void WaitIdle(Stager& stager);
  // Copies `sources` (CPU or device tensors) into the buffers, (re)allocated to their layout;
  // returns the buffers (contiguous host tensors), valid until the next Stage.
  static std::vector<at::Tensor> Stage(Stager& stager, const std::vector<at::Tensor>& sources);
  // A save now uses the buffers: the next WaitIdle blocks until the returned promise is set.
  static std::shared_ptr<std::promise<void>> MarkBusy(Stager& stager);
};

}  // namespace fsdp::dcp::internal

#endif  // FSDP_DCP_STAGER_ACCESS_H_
