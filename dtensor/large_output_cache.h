// Large CPU collective outputs from a small cache of freed blocks, for redistribute.
//
// A redistribute returns a fresh tensor each call (the caller owns it). On the CPU, glibc
// maps every allocation above 32 MiB afresh and writing it costs a zero-filling page fault
// per 4 KiB, which made a large redistribute markedly slower than the same all-gather into a
// reused buffer (docs/design/measured-choices.md). This cache does for those outputs what a
// GPU caching allocator does: when such a tensor's storage is freed its block returns here,
// and the next output of a size it fits (at most twice the size needed) reuses the
// already-mapped pages.
//
// Contract: EmptyOutput(shape, options) is at::empty(shape, options) (contiguous, resizable
// storage, same dtype / device / keys); CPU outputs of at least kMinCachedBytes come from
// the cache. At most kMaxCachedBlocks freed blocks are kept (the oldest is freed first);
// ReleaseCachedOutputs() frees them. Thread-safe; blocks may be freed on any thread.
#ifndef FSDP_DTENSOR_LARGE_OUTPUT_CACHE_H_
#define FSDP_DTENSOR_LARGE_OUTPUT_CACHE_H_

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <cstddef>

namespace fsdp::dtensor {

inline constexpr size_t kMinCachedBytes = size_t{32} << 20;  // glibc's largest mmap threshold
inline constexpr size_t kMaxCachedBlocks = 2;

at::Tensor EmptyOutput(c10::IntArrayRef shape, const at::TensorOptions& options);

// Frees every cached block; returns the bytes freed.
size_t ReleaseCachedOutputs();

// Bytes held by freed blocks now (for tests and memory accounting).
size_t CachedOutputBytes();

}  // namespace fsdp::dtensor

#endif  // FSDP_DTENSOR_LARGE_OUTPUT_CACHE_H_
