// Sharding math shared by both FSDPs: torch.chunk with empty chunks and padding.
#ifndef FSDP_FSDP_COMMON_SHARDING_H_
#define FSDP_FSDP_COMMON_SHARDING_H_

#include <cstdint>
#include <vector>

namespace fsdp {

// How one rank holds a tensor of `orig_size` sharded on `shard_dim` over `world_size` ranks
// (FSDP2's _init_sharded_param): torch.chunk's ceil-sized chunks, trailing ones shorter or
// empty; every rank stores a buffer of the padded (rank-0) chunk size, zero-padded past its
// rows, so all-gather inputs are equal-sized.
struct DimShardLayout {
  std::vector<int64_t> orig_size;
  int64_t shard_dim = 0;
  int64_t world_size = 1;
  int64_t rank = 0;
  std::vector<int64_t> sharded_size;         // this rank's rows (may be 0 along shard_dim)
  std::vector<int64_t> padded_sharded_size;  // the chunk size every rank stores
  int64_t offset = 0;                        // first global row along shard_dim

  int64_t sharded_numel() const;
  int64_t padded_sharded_numel() const;
  // orig_size with shard_dim padded to world_size * chunk.
  std::vector<int64_t> padded_unsharded_size() const;
};

// Checked: orig_size has at least one dimension, 0 <= shard_dim < orig_size.size(),
// 0 <= rank < world_size.
DimShardLayout MakeDimShardLayout(const std::vector<int64_t>& orig_size, int64_t shard_dim, int64_t world_size,
                                  int64_t rank);

int64_t Numel(const std::vector<int64_t>& size);

}  // namespace fsdp

#endif  // FSDP_FSDP_COMMON_SHARDING_H_
