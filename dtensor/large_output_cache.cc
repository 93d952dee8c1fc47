#include "dtensor/large_output_cache.h"

#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <deque>
#include <mutex>
#include <utility>

namespace fsdp::dtensor {
namespace {

// Memory from the CPU allocator (so allocation reporting sees it once, when first taken,
// and its free when evicted or released).
struct Block {
  c10::DataPtr memory;
  size_t bytes = 0;
};

class BlockCache {
 public:
  // A block of at least `bytes` (at most twice that), or a new one.
  Block* Take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if ((*it)->bytes >= bytes && (*it)->bytes / 2 <= bytes) {
          Block* block = *it;
          free_.erase(it);
          held_ -= block->bytes;
          return block;
        }
      }
    }
    return new Block{c10::GetCPUAllocator()->allocate(bytes), bytes};
  }

  void Give(Block* block) {
    Block* evicted = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back(block);
      held_ += block->bytes;
      if (free_.size() > kMaxCachedBlocks) {
        evicted = free_.front();
        free_.pop_front();
        held_ -= evicted->bytes;
      }
    }
    if (evicted != nullptr) Free(evicted);
  }

  size_t ReleaseAll() {
    std::deque<Block*> blocks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      blocks.swap(free_);
      held_ = 0;
    }
    size_t bytes = 0;
    for (Block* block : blocks) {
      bytes += block->bytes;
      Free(block);
    }
    return bytes;
  }

  size_t held() {
    std::lock_guard<std::mutex> lock(mu_);
    return held_;
  }

 private:
  static void Free(Block* block) { delete block; }

  std::mutex mu_;
  std::deque<Block*> free_;
  size_t held_ = 0;
};

// Never destroyed: a tensor may free its block during static destruction.
BlockCache& Cache() {
  static auto* cache = new BlockCache();
  return *cache;
}

void ReturnBlock(void* ctx) { Cache().Give(static_cast<Block*>(ctx)); }

}  // namespace

at::Tensor EmptyOutput(c10::IntArrayRef shape, const at::TensorOptions& options) {
  int64_t numel = 1;
  for (int64_t s : shape) {
    TORCH_CHECK(s >= 0, "EmptyOutput: negative size in ", shape);
    numel *= s;
  }
  const size_t bytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  if (options.device().type() != c10::kCPU || options.layout() != c10::kStrided || options.pinned_memory() ||
      bytes < kMinCachedBytes) {
    return at::empty(shape, options);
  }
  Block* block = Cache().Take(bytes);
  c10::DataPtr data(block->memory.get(), block, &ReturnBlock, c10::Device(c10::kCPU));
  // Resizable with the CPU allocator, as at::empty's: growing it frees this block back here.
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data), c10::GetCPUAllocator(),
                       /*resizable=*/true);
  const c10::DispatchKeySet keys(
      c10::computeDispatchKey(options.dtype().toScalarType(), c10::kStrided, c10::Device(c10::kCPU)));
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys, options.dtype());
  out.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return out;
}

size_t ReleaseCachedOutputs() { return Cache().ReleaseAll(); }

size_t CachedOutputBytes() { return Cache().held(); }

}  // namespace fsdp::dtensor
