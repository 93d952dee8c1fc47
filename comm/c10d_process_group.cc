#include "comm/c10d_process_group.h"

#include <utility>

#include "comm/internal/c10d_adapter.h"

namespace fsdp::comm {

ProcessGroupPtr WrapC10dBackend(c10::intrusive_ptr<c10d::Backend> backend, C10dOptions options) {
  internal::C10dAdapterOptions adapter;
  adapter.timeout = options.timeout;
  adapter.split_store = std::move(options.store);
  adapter.object_collective_device = options.object_collective_device;
  return internal::MakeC10dProcessGroup(std::move(backend), std::move(adapter));
}

}  // namespace fsdp::comm
