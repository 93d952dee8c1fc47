#include "fsdp/common/storage.h"

#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/Exception.h>

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

at::Tensor AliasStorage(const at::Tensor& base, int64_t storage_offset, c10::IntArrayRef sizes) {
  TORCH_CHECK(base.defined() && base.has_storage(), "AliasStorage: base has no storage");
  int64_t numel = 1;
  for (int64_t s : sizes) {
    TORCH_CHECK(s >= 0, "AliasStorage: negative size in ", sizes);
    numel *= s;
  }
  const int64_t itemsize = static_cast<int64_t>(base.element_size());
  TORCH_CHECK(storage_offset >= 0 &&
                  (numel == 0 || (storage_offset + numel) * itemsize <= static_cast<int64_t>(base.storage().nbytes())),
              "AliasStorage: ", numel, " elements at offset ", storage_offset, " do not fit a storage of ",
              base.storage().nbytes(), " bytes");
  // The dispatch keys at::empty gives a tensor of this dtype, layout and device.
  const c10::DispatchKeySet keys(c10::computeDispatchKey(base.scalar_type(), base.layout(), base.device()));
  at::Tensor alias = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(base.storage()), keys, base.dtype());
  c10::TensorImpl* impl = alias.unsafeGetTensorImpl();
  impl->set_storage_offset(storage_offset);
  impl->set_sizes_contiguous(sizes);
  return alias;
}

}  // namespace fsdp
