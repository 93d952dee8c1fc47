// FSDP1 flat-parameter layout as plain integers (PyTorch's fsdp/_flat_param.py): where each
// original parameter and each padding stretch sits in the unsharded FlatParameter, and which
// part of it every rank's shard holds. Used by fsdp/fsdp1 (tensors) and tools/fsdp_plan.
#ifndef FSDP_FSDP_COMMON_FLAT_LAYOUT_H_
#define FSDP_FSDP_COMMON_FLAT_LAYOUT_H_

#include <cstdint>
#include <vector>

namespace fsdp {

// PyTorch's ALIGNMENT (from TorchInductor): with use_orig_params every original parameter
// starts at a multiple of this many bytes of the flat parameter.
inline constexpr int64_t kFlatParamAlignmentBytes = 16;

// _get_aligned_numel: elements per 16 bytes of the unsharded (forward/backward) dtype.
// Checked: 0 < element_size <= 16.
int64_t FlatAlignedNumel(int64_t element_size);

// One stretch of the unsharded FlatParameter: an original parameter or padding.
struct FlatSegment {
  int64_t param_index = -1;  // index among the original parameters; -1: padding
  int64_t start = 0;         // first element in the unsharded flat parameter
  int64_t numel = 0;
  bool is_padding() const { return param_index < 0; }
};

// FlatParamHandle._init_flat_param_and_metadata's padding: with aligned_numel > 0 each
// parameter is preceded by padding up to a multiple of aligned_numel, and the total is then
// padded to a multiple of world_size; with aligned_numel == 0 there is no padding at all.
// `numels`: the original parameters' numels in flattening order (duplicates already
// removed). Checked: aligned_numel >= 0, world_size >= 1, numels >= 0.
std::vector<FlatSegment> MakeFlatSegments(const std::vector<int64_t>& numels, int64_t aligned_numel,
                                          int64_t world_size);
// The unpadded unsharded numel: the end of the last segment (0 if none).
int64_t FlatTotalNumel(const std::vector<FlatSegment>& segments);

// _ShardParamInfo for one original parameter, same names and conventions: when in_shard,
// flat_shard[offset_in_shard : offset_in_shard + numel_in_shard] is
// param.flatten()[intra_param_start_idx : intra_param_end_idx + 1] (end inclusive); when not,
// PyTorch's None fields are 0 here.
struct FlatShardParamInfo {
  int64_t index = 0;  // the original parameter's index
  bool in_shard = false;
  int64_t offset_in_shard = 0;
  int64_t numel_in_shard = 0;
  int64_t intra_param_start_idx = 0;
  int64_t intra_param_end_idx = 0;  // inclusive
};

// _get_shard_metadata: one entry per non-padding segment for the shard covering
// [unsharded_start_idx, unsharded_end_idx] (inclusive) of the unsharded flat parameter.
// Checked: 0 <= unsharded_start_idx <= unsharded_end_idx.
std::vector<FlatShardParamInfo> FlatShardParamInfos(const std::vector<FlatSegment>& segments,
                                                    int64_t unsharded_start_idx, int64_t unsharded_end_idx);

// _get_unpadded_shard / _get_shard on a flat tensor of `total_numel` elements: torch.chunk
// into world_size chunks of ceil(total / world) elements (trailing ranks short or empty);
// every rank stores `chunk` elements, the last `numel_padded` of them padding.
// The shard covers [rank * chunk, (rank + 1) * chunk - 1] of the padded unsharded flat
// parameter (world_size * chunk elements); [start, end) is the real data in it.
struct FlatChunk {
  int64_t chunk = 0;
  int64_t start = 0;
  int64_t end = 0;
  int64_t numel_padded = 0;
};
// Checked: total_numel >= 0, world_size >= 1, 0 <= rank < world_size.
FlatChunk MakeFlatChunk(int64_t total_numel, int64_t world_size, int64_t rank);

}  // namespace fsdp

#endif  // FSDP_FSDP_COMMON_FLAT_LAYOUT_H_
