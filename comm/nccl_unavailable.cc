// The default (non-cuda) build of :nccl: same API, no NCCL. Callers check NcclAvailable().
#include <c10/util/Exception.h>

#include "comm/nccl_process_group.h"

namespace fsdp::comm {
namespace {
constexpr const char* kNotBuilt = "NCCL backend not built: rebuild with --config=cuda (needs nvcc and NCCL)";
}  // namespace

ProcessGroupPtr CreateNcclProcessGroupWithTcpStore(const TorchrunEnv&, const NcclOptions&) {
  TORCH_CHECK(false, kNotBuilt);
}

ProcessGroupPtr CreateNcclProcessGroupFromEnv(const NcclOptions&) { TORCH_CHECK(false, kNotBuilt); }

bool NcclAvailable() { return false; }

}  // namespace fsdp::comm
