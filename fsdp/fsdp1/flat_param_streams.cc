#include "fsdp/fsdp1/flat_param_streams.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <string>
#include <utility>

#include "fsdp/common/storage.h"

namespace fsdp::fsdp1 {

FlatParamStreamContext::FlatParamStreamContext(c10::Device device, const device::StreamOptions& options)
    : pool_(device::StreamPool::Create(device, device::ApplyStreamEnvOverride(options))) {
  // PyTorch's names (they appear in timeout and error messages).
  for (const char* name : {"fsdp1_unshard", "fsdp1_post_backward", "fsdp1_all_reduce"}) {
    owned_.push_back(pool_->NewStream(name));
  }
  streams_ = {&pool_->current(), owned_[0].get(),     owned_[1].get(),
              owned_[2].get(),   &pool_->sequencer(), pool_->options().timeout};
  streams_.host_waits_for_collectives = device.is_cpu() && pool_->options().cpu_mode == device::CpuStreamMode::kInline;
}

const FlatParamStreams& ThreadInlineFlatParamStreams() {
  thread_local const device::StreamPoolPtr pool = device::StreamPool::Create(c10::Device(c10::kCPU), {});
  thread_local const device::StreamPtr side = pool->NewStream("fsdp1_inline");
  thread_local const FlatParamStreams streams{&pool->current(), side.get(),         side.get(),
                                              side.get(),       &pool->sequencer(), pool->options().timeout};
  return streams;
}

at::Tensor StreamAlias(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return t;  // no memory to outlive the host's view
  return NonOwningAlias(t);
}

void FreeStorageAfterStreams(const at::Tensor& t, std::initializer_list<device::Stream*> streams) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = storage->nbytes();
  if (nbytes == 0) return;
  TORCH_CHECK(storage->allocator() != nullptr, "FreeStorageAfterStreams: the storage of a ", t.scalar_type(),
              " tensor on ", t.device(), " has no allocator (it must be freed and re-allocated in place)");
  // The memory moves into a storage of its own, which each stream holds until it passed the
  // work enqueued so far; t's storage (and every view sharing it) is at 0 bytes now.
  c10::DataPtr memory = storage->set_data_ptr(storage->allocator()->allocate(0));
  storage->set_nbytes(0);
  c10::Storage owner(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                           std::move(memory), /*allocator=*/nullptr,
                                                           /*resizable=*/false));
  const at::Tensor holder = BytesOf(std::move(owner));
  for (device::Stream* stream : streams) {
    if (stream != nullptr) stream->KeepAlive(holder);
  }
}

}  // namespace fsdp::fsdp1
