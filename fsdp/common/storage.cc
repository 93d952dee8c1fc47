#include "fsdp/common/storage.h"

#include <c10/core/StorageImpl.h>

namespace fsdp {

void FreeStorage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == 0) return;
  storage->set_data_ptr_noswap(storage->allocator()->allocate(0));
  storage->set_nbytes(0);
}

void AllocStorage(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = (t.storage_offset() + t.numel()) * t.element_size();
  if (storage->nbytes() == nbytes) return;
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

int64_t StorageNbytes(const at::Tensor& t) { return static_cast<int64_t>(t.storage().nbytes()); }

}  // namespace fsdp
