// The large-output cache behind redistribute: outputs are what at::empty makes, a freed
// large block is reused for the next output it fits (no fresh pages), at most
// kMaxCachedBlocks are kept, small and non-CPU outputs bypass it.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "dtensor/large_output_cache.h"

namespace fsdp::dtensor {
namespace {

constexpr int64_t kLargeFloats = static_cast<int64_t>(kMinCachedBytes / 4);

TEST(LargeOutputCache, OutputsAreWhatEmptyMakes) {
  ReleaseCachedOutputs();
  const at::Tensor ours = EmptyOutput({kLargeFloats / 8, 8}, at::kFloat);
  const at::Tensor reference = at::empty({2, 8}, at::kFloat);
  EXPECT_EQ(ours.sizes(), (std::vector<int64_t>{kLargeFloats / 8, 8}));
  EXPECT_TRUE(ours.is_contiguous());
  EXPECT_EQ(ours.key_set(), reference.key_set());
  EXPECT_EQ(ours.scalar_type(), at::kFloat);
  EXPECT_EQ(static_cast<size_t>(ours.storage().nbytes()), kMinCachedBytes);
  ours.fill_(3);
  EXPECT_EQ(ours.sum().item<double>(), 3.0 * kLargeFloats);
  // Resizable like at::empty's storage: growing it frees the block back to the cache.
  at::Tensor grown = ours.clone();
  at::Tensor resized = EmptyOutput({kLargeFloats}, at::kFloat);
  resized.resize_({kLargeFloats + 1});
  EXPECT_EQ(resized.numel(), kLargeFloats + 1);
  EXPECT_EQ(CachedOutputBytes(), kMinCachedBytes);
  ReleaseCachedOutputs();
}

TEST(LargeOutputCache, AFreedBlockIsReusedAndAtMostTwoAreKept) {
  ReleaseCachedOutputs();
  const size_t a_bytes = kMinCachedBytes + 4000;
  const void* first = nullptr;
  {
    const at::Tensor a = EmptyOutput({kLargeFloats + 1000}, at::kFloat);
    first = a.data_ptr();
    EXPECT_EQ(CachedOutputBytes(), 0u);
  }
  EXPECT_EQ(CachedOutputBytes(), a_bytes);
  {
    const at::Tensor b = EmptyOutput({kLargeFloats}, at::kFloat);  // fits a's block: reused
    EXPECT_EQ(b.data_ptr(), first);
    EXPECT_EQ(CachedOutputBytes(), 0u);
    const at::Tensor c = EmptyOutput({kLargeFloats * 3}, at::kFloat);  // larger than any cached block
    EXPECT_NE(c.data_ptr(), first);
  }
  EXPECT_EQ(CachedOutputBytes(), a_bytes + 3 * kMinCachedBytes);
  {  // a third freed block evicts the oldest (c's: c was freed before b at the scope's end)
    const at::Tensor d = EmptyOutput({kLargeFloats * 8}, at::kFloat);
  }
  EXPECT_EQ(CachedOutputBytes(), a_bytes + 8 * kMinCachedBytes);
  EXPECT_EQ(ReleaseCachedOutputs(), a_bytes + 8 * kMinCachedBytes);
  EXPECT_EQ(CachedOutputBytes(), 0u);
  {  // a block more than twice the size needed is not taken
    { const at::Tensor big = EmptyOutput({kLargeFloats * 8}, at::kFloat); }
    const at::Tensor e = EmptyOutput({kLargeFloats}, at::kFloat);
    EXPECT_EQ(CachedOutputBytes(), 8 * kMinCachedBytes);
  }
  ReleaseCachedOutputs();
}

TEST(LargeOutputCache, SmallOutputsBypassIt) {
  ReleaseCachedOutputs();
  { const at::Tensor small = EmptyOutput({16}, at::kFloat); }
  EXPECT_EQ(CachedOutputBytes(), 0u);
  EXPECT_THROW(EmptyOutput({-1}, at::kFloat), c10::Error);
}

}  // namespace
}  // namespace fsdp::dtensor
