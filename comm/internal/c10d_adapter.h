// The adapter behind WrapC10dBackend and the Gloo and NCCL backends (//comm:internal, visible
// to //comm only): a c10d::Backend as a comm::ProcessGroup, with the Gloo backend's extras
// (naming lost peers, its own sub-group construction) as options.
#ifndef FSDP_COMM_INTERNAL_C10D_ADAPTER_H_
#define FSDP_COMM_INTERNAL_C10D_ADAPTER_H_

#include <c10/core/DeviceType.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/internal/gloo_liveness.h"
#include "comm/process_group.h"

namespace fsdp::comm::internal {

struct C10dAdapterOptions {
  Timeout timeout = kDefaultTimeout;
  // Names peers that are gone in failure messages; null: the backend's message alone.
  std::shared_ptr<const PeerLiveness> liveness;
  // Builds the sub-group this rank is `index` of (ranks of this group); null: the backend's
  // split() on `split_store`, or an error without one.
  std::function<ProcessGroupPtr(const std::vector<int>& ranks, int index, uint64_t serial)> new_subgroup;
  c10::intrusive_ptr<c10d::Store> split_store;
  // Every tensor must be on this device type (NCCL: CUDA): a c10::Error naming the collective,
  // the argument and its device otherwise, before the backend sees it. Unset: no check.
  std::optional<c10::DeviceType> tensor_device_type;
  // ProcessGroup::object_collective_device(); unset: the CPU.
  std::optional<c10::Device> object_collective_device;
};

ProcessGroupPtr MakeC10dProcessGroup(c10::intrusive_ptr<c10d::Backend> backend, C10dAdapterOptions options);

// An error's message without LibTorch's C++ backtrace, and without gloo's source location
// ("[.../pair.cc:561] ") and generic advice (" This is typically caused by ...").
std::string BackendMessage(const std::exception& e);

}  // namespace fsdp::comm::internal

#endif  // FSDP_COMM_INTERNAL_C10D_ADAPTER_H_
