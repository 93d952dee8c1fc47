// The NCCL backend (--config=cuda): c10d::ProcessGroupNCCL from libtorch_cuda, created over a
// TCPStore rendezvous and wrapped by the c10d adapter (comm/internal/c10d_adapter.h), which
// also checks that every tensor is a CUDA tensor.
#include "comm/nccl_process_group.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <utility>

#include "comm/internal/c10d_adapter.h"
#include "comm/internal/tcp_store.h"

// ProcessGroupNCCL's members depend on NCCL_VERSION_CODE (NCCLUtils.hpp's feature macros): a
// TU compiled against another nccl.h than the wheel's has another object layout than
// libtorch_cuda.so and corrupts the heap. `./x setup` passes the version the wheel pins (0, the
// .bazelrc default, when it could not read one).
#if defined(FSDP_TORCH_NCCL_VERSION_CODE) && FSDP_TORCH_NCCL_VERSION_CODE != 0
static_assert(NCCL_VERSION_CODE == FSDP_TORCH_NCCL_VERSION_CODE,
              "nccl.h is not the NCCL version the torch wheel was built with (include order: the wheel's "
              "nvidia/nccl/include must come before the CUDA toolkit's include directory)");
#endif

namespace fsdp::comm {

ProcessGroupPtr CreateNcclProcessGroupWithTcpStore(const TorchrunEnv& env, const NcclOptions& options) {
  constexpr const char* kFn = "CreateNcclProcessGroupWithTcpStore";
  TORCH_CHECK(options.timeout.count() > 0, kFn, ": NcclOptions.timeout must be positive, got ", options.timeout.count(),
              " ms");
  TORCH_CHECK(options.device_index >= -1, kFn, ": NcclOptions.device_index must be >= -1, got ", options.device_index);
  const int device = options.device_index >= 0 ? options.device_index : env.local_rank;
  const int device_count = c10::cuda::device_count();
  TORCH_CHECK(device >= 0 && device < device_count, kFn, ": CUDA device ", device,
              options.device_index >= 0 ? " (NcclOptions.device_index)" : " (LOCAL_RANK)",
              " does not exist: ", device_count, " visible");
  // ProcessGroupNCCL creates its communicator lazily, on the device of the first
  // collective's tensors (or the current device, for barrier).
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));

  c10::intrusive_ptr<c10d::Store> store = internal::ConnectTcpStore(env, options.timeout, kFn);
  auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
  nccl_options->timeout = options.timeout;
  auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, env.rank, env.world_size, nccl_options);

  internal::C10dAdapterOptions adapter;
  adapter.timeout = options.timeout;
  adapter.split_store = store;
  adapter.tensor_device_type = c10::DeviceType::CUDA;
  adapter.object_collective_device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
  return internal::MakeC10dProcessGroup(std::move(backend), std::move(adapter));
}

ProcessGroupPtr CreateNcclProcessGroupFromEnv(const NcclOptions& options) {
  return CreateNcclProcessGroupWithTcpStore(ReadTorchrunEnv(), options);
}

bool NcclAvailable() { return true; }

}  // namespace fsdp::comm
