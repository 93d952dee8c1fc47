// The per-device StreamPool factories behind StreamPool::Create.
#ifndef FSDP_DEVICE_INTERNAL_POOLS_H_
#define FSDP_DEVICE_INTERNAL_POOLS_H_

#include "device/stream.h"

namespace fsdp::device::internal {

std::shared_ptr<StreamPool> CreateCpuStreamPool(const StreamOptions& options);
// cuda_stream.cc in --config=cuda builds; otherwise a c10::Error saying how to get it.
std::shared_ptr<StreamPool> CreateCudaStreamPool(c10::Device device, const StreamOptions& options);

// Drops the finished collectives from a stream's pending list (their wait is instant and
// runs any completion step), so a stream only ever waited through events stays short
// instead of copying an ever longer list into each event.
void PruneFinished(std::vector<comm::WorkPtr>& pending);

}  // namespace fsdp::device::internal

#endif  // FSDP_DEVICE_INTERNAL_POOLS_H_
