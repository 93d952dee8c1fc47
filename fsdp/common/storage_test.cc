// The in-place storage helpers: FreeStorage / AllocStorage keep the StorageImpl, and
// AliasStorage makes what `at::empty({0}).set_(storage, offset, sizes)` makes.
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Flags.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "fsdp/common/storage.h"
#include "testing/expect_error.h"

C10_DECLARE_bool(caffe2_cpu_allocator_do_zero_fill);

namespace fsdp {
namespace {

// What c10's CPU allocators report while memory profiling is on (the profiler's hook): each
// allocation and free with its pointer and size.
struct RecordedAllocations final : c10::MemoryReportingInfoBase {
  void reportMemoryUsage(void* ptr, int64_t bytes, size_t, size_t, c10::Device device) override {
    if (device.is_cpu()) events.emplace_back(ptr, bytes);
  }
  bool memoryProfilingEnabled() const override { return true; }
  std::vector<std::pair<void*, int64_t>> events;
};

TEST(AliasStorage, IsWhatSetMakesWithoutBeingAView) {
  const at::Tensor base = at::arange(24, at::kFloat).requires_grad_(false);
  const at::Tensor alias = AliasStorage(base, 6, {3, 4});
  at::Tensor reference = at::empty({0}, base.options());
  reference.set_(base.storage(), 6, {3, 4}, {4, 1});
  EXPECT_TRUE(at::equal(alias, reference));
  EXPECT_EQ(alias.sizes(), reference.sizes());
  EXPECT_EQ(alias.strides(), reference.strides());
  EXPECT_EQ(alias.storage_offset(), 6);
  EXPECT_EQ(alias.key_set(), reference.key_set());
  EXPECT_TRUE(alias.is_alias_of(base));
  EXPECT_FALSE(alias.is_view());
  EXPECT_FALSE(alias.requires_grad());
  // Writes go through to the base; the version counter is the alias's own.
  const int64_t base_version = base._version();
  alias.fill_(-1);
  EXPECT_EQ(base[6].item<float>(), -1);
  EXPECT_EQ(base[17].item<float>(), -1);
  EXPECT_EQ(base[18].item<float>(), 18);
  EXPECT_EQ(base._version(), base_version);
  // What optimizers do to gradients: detach_ and zero_ (a view of a leaf refuses detach_).
  at::Tensor grad = AliasStorage(base, 0, {2});
  grad.detach_();
  grad.zero_();
  EXPECT_EQ(base[0].item<float>(), 0);
  // Other dtypes, empty and 0-d sizes.
  const at::Tensor bytes = at::zeros({8}, at::kByte);
  EXPECT_EQ(AliasStorage(bytes, 8, {0}).numel(), 0);
  EXPECT_EQ(AliasStorage(bytes, 3, {}).dim(), 0);
  EXPECT_EQ(AliasStorage(bytes, 3, {}).scalar_type(), at::kByte);
}

TEST(AliasStorage, RangesOutsideTheStorageAreErrors) {
  const at::Tensor base = at::zeros({10}, at::kDouble);
  EXPECT_ERROR_CONTAINS(AliasStorage(base, 4, {7}), "7 elements at offset 4 do not fit a storage of 80 bytes");
  EXPECT_ERROR_CONTAINS(AliasStorage(base, -1, {1}), "at offset -1");
  EXPECT_ERROR_CONTAINS(AliasStorage(base, 0, {2, -1}), "negative size");
  EXPECT_ERROR_CONTAINS(AliasStorage(at::Tensor(), 0, {1}), "base has no storage");
}

TEST(FreeStorage, KeepsTheStorageImplAndAllocRestoresTheSize) {
  const at::Tensor t = at::ones({4, 4});
  const c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  const at::Tensor alias = AliasStorage(t, 4, {4});
  FreeStorage(t);
  EXPECT_EQ(StorageNbytes(t), 0);
  AllocStorage(t);
  EXPECT_EQ(StorageNbytes(t), 64);
  EXPECT_EQ(t.storage().unsafeGetStorageImpl(), impl);
  EXPECT_EQ(alias.storage().unsafeGetStorageImpl(), impl);
}

TEST(BytesOf, HoldsTheStorageAsBytes) {
  at::Tensor t = at::arange(6, at::kInt);
  const at::Tensor bytes = BytesOf(t.storage());
  EXPECT_EQ(bytes.scalar_type(), at::kByte);
  EXPECT_EQ(bytes.numel(), 24);
  EXPECT_EQ(bytes.data_ptr(), t.data_ptr());
  EXPECT_EQ(bytes.key_set(), at::empty({0}, at::kByte).key_set());
  const void* data = t.data_ptr();
  t = at::Tensor();  // the bytes keep the memory
  EXPECT_EQ(bytes.data_ptr(), data);
}

TEST(EmptyBuffer, IsWhatEmptyMakes) {
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    const auto options = at::TensorOptions().dtype(dtype);
    const at::Tensor ours = EmptyBuffer({3, 5}, options);
    const at::Tensor reference = at::empty({3, 5}, options);
    EXPECT_EQ(ours.sizes(), reference.sizes());
    EXPECT_EQ(ours.strides(), reference.strides());
    EXPECT_EQ(ours.scalar_type(), dtype);
    EXPECT_EQ(ours.key_set(), reference.key_set());
    EXPECT_FALSE(ours.requires_grad());
  }
}

TEST(EmptyLike0, IsWhatEmptyMakes) {
  for (auto dtype : {at::kFloat, at::kHalf, at::kLong}) {
    const at::Tensor like = at::ones({3}, dtype);
    const at::Tensor ours = EmptyLike0(like);
    const at::Tensor reference = at::empty({0}, like.options());
    EXPECT_EQ(ours.sizes(), reference.sizes());
    EXPECT_EQ(ours.scalar_type(), dtype);
    EXPECT_EQ(ours.key_set(), reference.key_set());
    EXPECT_EQ(StorageNbytes(ours), 0);
    EXPECT_FALSE(ours.is_alias_of(like));
    EXPECT_FALSE(ours.is_alias_of(EmptyLike0(like)));  // each its own storage
    ours.resize_({4});                                 // resizable, as at::empty's
    EXPECT_EQ(StorageNbytes(ours), 4 * static_cast<int64_t>(like.element_size()));
  }
}

TEST(CpuBufferAllocator, SmallBlocksComeFromMallocAndAreReportedAsTheDefaultAllocatorsAre) {
  auto recorded = std::make_shared<RecordedAllocations>();
  c10::DebugInfoGuard profiling(c10::DebugInfoKind::PROFILER_STATE, recorded);
  c10::Allocator* const ours = CpuBufferAllocator();
  c10::Allocator* const standard = c10::GetDefaultCPUAllocator();
  ASSERT_NE(ours, standard);
  {
    const at::Tensor small = EmptyBuffer({10}, at::kFloat);  // 40 bytes: malloc
    ASSERT_EQ(recorded->events.size(), 1u);
    EXPECT_EQ(recorded->events.back(), std::make_pair(small.data_ptr(), int64_t{40}));
    EXPECT_EQ(small.storage().allocator(), ours);
    EXPECT_NE(small.storage().data_ptr().get_deleter(), standard->raw_deleter());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data_ptr()) % 16, 0u);
    small.fill_(1.5);
    EXPECT_EQ(small.sum().item<float>(), 15);
    recorded->events.clear();
  }
  ASSERT_EQ(recorded->events.size(), 1u);  // the free, reported with the negative size
  EXPECT_EQ(recorded->events.back().second, -40);
  // Above 4096 bytes, c10's default allocator's own blocks (64-byte aligned, its deleter).
  const at::Tensor large = EmptyBuffer({1025}, at::kFloat);
  EXPECT_EQ(large.storage().data_ptr().get_deleter(), standard->raw_deleter());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(large.data_ptr()) % 64, 0u);
  // AllocStorage moves a default-allocated storage to ours; FreeStorage reports the free.
  at::Tensor param = at::arange(6, at::kFloat);
  EXPECT_EQ(param.storage().allocator(), standard);
  FreeStorage(param);
  recorded->events.clear();
  AllocStorage(param);
  EXPECT_EQ(param.storage().allocator(), ours);
  ASSERT_EQ(recorded->events.size(), 1u);
  EXPECT_EQ(recorded->events.back(), std::make_pair(param.data_ptr(), int64_t{24}));
  param.copy_(at::arange(6, at::kFloat));
  EXPECT_EQ(param.sum().item<float>(), 15);
}

// A process whose CPU allocator was replaced, or that asked c10 to zero-fill, keeps its own.
struct CountingAllocator final : c10::Allocator {
  at::DataPtr allocate(size_t nbytes) override {
    ++allocations;
    return c10::GetDefaultCPUAllocator()->allocate(nbytes);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
  int allocations = 0;
};

TEST(CpuBufferAllocator, IsTheProcesssOwnWhenReplacedOrFilling) {
  CountingAllocator counting;
  c10::SetCPUAllocator(&counting);
  EXPECT_EQ(CpuBufferAllocator(), &counting);
  const at::Tensor buffer = EmptyBuffer({4}, at::kFloat);
  EXPECT_EQ(counting.allocations, 1);
  c10::SetCPUAllocator(c10::GetDefaultCPUAllocator());
  EXPECT_NE(CpuBufferAllocator(), c10::GetDefaultCPUAllocator());
  FLAGS_caffe2_cpu_allocator_do_zero_fill = true;
  EXPECT_EQ(CpuBufferAllocator(), c10::GetDefaultCPUAllocator());
  FLAGS_caffe2_cpu_allocator_do_zero_fill = false;
}

}  // namespace
}  // namespace fsdp
