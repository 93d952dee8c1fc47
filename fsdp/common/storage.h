// Freeing and re-allocating a tensor's storage in place (PyTorch's _free_storage /
// _alloc_storage), shared by both FSDPs.
#ifndef FSDP_FSDP_COMMON_STORAGE_H_
#define FSDP_FSDP_COMMON_STORAGE_H_

#include <ATen/core/Tensor.h>

namespace fsdp {

// Frees / re-allocates a tensor's storage in place, keeping the StorageImpl (autograd's
// saved views of an unsharded parameter see the re-gathered data after an unshard).
// FreeStorage leaves the storage at 0 bytes; AllocStorage sizes it to cover the tensor
// (storage_offset + numel elements); both are no-ops when already so.
void FreeStorage(const at::Tensor& t);
void AllocStorage(const at::Tensor& t);

// Bytes the tensor's storage holds now (0 after FreeStorage).
int64_t StorageNbytes(const at::Tensor& t);

}  // namespace fsdp

#endif  // FSDP_FSDP_COMMON_STORAGE_H_
