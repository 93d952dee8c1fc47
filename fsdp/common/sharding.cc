#include "fsdp/common/sharding.h"

#include <c10/util/Exception.h>

namespace fsdp {

int64_t Numel(const std::vector<int64_t>& size) {
  int64_t n = 1;
  for (int64_t s : size) n *= s;
  return n;
}

int64_t DimShardLayout::sharded_numel() const { return Numel(sharded_size); }
int64_t DimShardLayout::padded_sharded_numel() const { return Numel(padded_sharded_size); }

std::vector<int64_t> DimShardLayout::padded_unsharded_size() const {
  std::vector<int64_t> size = orig_size;
  size[shard_dim] = padded_sharded_size[shard_dim] * world_size;
  return size;
}

DimShardLayout MakeDimShardLayout(const std::vector<int64_t>& orig_size, int64_t shard_dim, int64_t world_size,
                                  int64_t rank) {
  TORCH_CHECK(!orig_size.empty(), "FSDP sharding: 0-D tensors must be viewed as 1-D first");
  TORCH_CHECK(shard_dim >= 0 && shard_dim < static_cast<int64_t>(orig_size.size()), "FSDP sharding: shard dim ",
              shard_dim, " is invalid for a ", orig_size.size(), "-D tensor");
  TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "FSDP sharding: rank ", rank, " not in [0, ",
              world_size, ")");
  DimShardLayout layout;
  layout.orig_size = orig_size;
  layout.shard_dim = shard_dim;
  layout.world_size = world_size;
  layout.rank = rank;
  const int64_t n = orig_size[shard_dim];
  const int64_t chunk = (n + world_size - 1) / world_size;
  const int64_t begin = std::min(n, chunk * rank);
  layout.offset = begin;
  layout.sharded_size = orig_size;
  layout.sharded_size[shard_dim] = std::min(n, begin + chunk) - begin;
  layout.padded_sharded_size = orig_size;
  layout.padded_sharded_size[shard_dim] = chunk;
  return layout;
}

}  // namespace fsdp
