// Default (CPU-only) build: CUDA streams need --config=cuda.
#include <c10/util/Exception.h>

#include "device/internal/pools.h"

namespace fsdp::device::internal {

std::shared_ptr<StreamPool> CreateCudaStreamPool(c10::Device device, const StreamOptions&) {
  TORCH_CHECK(false, "StreamPool::Create(", device,
              "): CUDA streams not built: rebuild with --config=cuda (needs nvcc)");
}

}  // namespace fsdp::device::internal
