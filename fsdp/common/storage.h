// Freeing and re-allocating a tensor's storage in place (PyTorch's _free_storage /
// _alloc_storage), shared by both FSDPs.
#ifndef FSDP_FSDP_COMMON_STORAGE_H_
#define FSDP_FSDP_COMMON_STORAGE_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

namespace fsdp {

// The allocator of FSDP's per-step CPU storages (collective buffers from EmptyBuffer, storages
// re-allocated by AllocStorage: unsharded parameters, the reduce-scatter output that becomes the
// sharded gradient). It is c10's default CPU allocator except for blocks of 1..4096 bytes, which
// come from malloc: c10::alloc_cpu's posix_memalign(64) goes around glibc's per-thread cache
// and splits a larger chunk, several times malloc's cost, paid several times per module per
// step (docs/design/measured-choices.md). The small blocks are 16-byte aligned (malloc's;
// every dtype's alignment, ATen's vector kernels load unaligned) and reported to c10's CPU
// memory reporter as DefaultCPUAllocator reports its own, so the profiler and
// caffe2_report_cpu_memory_usage count them (metrics/allocation_window.h).
// Returns c10's CPU allocator itself when the process replaced it (c10::SetCPUAllocator) or
// asked it to zero- or junk-fill. Thread-safe; the allocator lives as long as the process.
c10::Allocator* CpuBufferAllocator();

// Frees / re-allocates a tensor's storage in place, keeping the StorageImpl (autograd's
// saved views of an unsharded parameter see the re-gathered data after an unshard).
// FreeStorage leaves the storage at 0 bytes; AllocStorage sizes it to cover the tensor
// (storage_offset + numel elements); both are no-ops when already so. AllocStorage moves a
// storage of c10's default CPU allocator to CpuBufferAllocator().
void FreeStorage(const at::Tensor& t);
void AllocStorage(const at::Tensor& t);

// True when both tensors are defined and share one storage (aliases of the same bytes).
bool SameStorage(const at::Tensor& a, const at::Tensor& b);

// Bytes the tensor's storage holds now (0 after FreeStorage).
int64_t StorageNbytes(const at::Tensor& t);

// A contiguous tensor of `sizes` over `base`'s storage (same dtype and device) starting at
// `storage_offset` elements: what `at::empty({0}, base.options()).set_(base.storage(),
// storage_offset, sizes)` makes (an alias that is not an autograd view, with its own
// version counter, so optimizers may detach_() it), built without the dispatcher, whose fixed
// cost exceeds the work for the per-step gradient and collective-buffer aliases of every
// parameter (docs/design/measured-choices.md). The caller keeps the range inside the storage
// (checked).
at::Tensor AliasStorage(const at::Tensor& base, int64_t storage_offset, c10::IntArrayRef sizes);

// A 1-D uint8 tensor over all of `storage`'s bytes (no dispatcher): a handle that keeps the
// storage alive, e.g. on a stream until its work passed.
at::Tensor BytesOf(c10::Storage storage);

// What `at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options())` makes: a tensor over
// t's current memory through a storage of its own that owns nothing (the caller keeps the
// memory alive), built without TensorMaker and the dispatcher for plain strided CPU tensors
// (docs/design/measured-choices.md). Requires `t` defined.
at::Tensor NonOwningAlias(const at::Tensor& t);

// at::empty(sizes, options), without the dispatcher for plain (unpinned, strided) CPU
// tensors (docs/design/measured-choices.md), from CpuBufferAllocator(): for the per-step
// collective buffers.
at::Tensor EmptyBuffer(c10::IntArrayRef sizes, const at::TensorOptions& options);

// `at::empty({0}, like.options())`: a fresh 0-element tensor with its own 0-byte storage,
// without the dispatcher on the CPU (what a resharded FSDP1 original parameter becomes).
at::Tensor EmptyLike0(const at::Tensor& like);

}  // namespace fsdp

#endif  // FSDP_FSDP_COMMON_STORAGE_H_
