#include "fsdp/common/flat_layout.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp {

int64_t FlatAlignedNumel(int64_t element_size) {
  TORCH_CHECK(element_size > 0 && element_size <= kFlatParamAlignmentBytes,
              "FlatAlignedNumel: element_size must be in [1, ", kFlatParamAlignmentBytes, "] but got ", element_size);
  return kFlatParamAlignmentBytes / element_size;
}

std::vector<FlatSegment> MakeFlatSegments(const std::vector<int64_t>& numels, int64_t aligned_numel,
                                          int64_t world_size) {
  TORCH_CHECK(aligned_numel >= 0, "Expects non-negative `aligned_numel` but got ", aligned_numel);
  TORCH_CHECK(world_size >= 1, "MakeFlatSegments: world_size must be >= 1 but got ", world_size);
  std::vector<FlatSegment> segments;
  int64_t total = 0;
  // numel_to_pad = multiple - total % multiple, kept only if in (0, multiple).
  auto pad_to = [&](int64_t multiple) {
    const int64_t to_pad = multiple - total % multiple;
    if (to_pad > 0 && to_pad < multiple) {
      segments.push_back({-1, total, to_pad});
      total += to_pad;
    }
  };
  for (size_t i = 0; i < numels.size(); ++i) {
    TORCH_CHECK(numels[i] >= 0, "MakeFlatSegments: numels[", i, "] must be >= 0 but got ", numels[i]);
    if (aligned_numel > 0) pad_to(aligned_numel);
    segments.push_back({static_cast<int64_t>(i), total, numels[i]});
    total += numels[i];
  }
  // Pad to be divisible by world size to avoid a copy for the post-backward reduce-scatter
  // (PyTorch does this only together with alignment).
  if (aligned_numel > 0) pad_to(world_size);
  return segments;
}

int64_t FlatTotalNumel(const std::vector<FlatSegment>& segments) {
  return segments.empty() ? 0 : segments.back().start + segments.back().numel;
}

std::vector<FlatShardParamInfo> FlatShardParamInfos(const std::vector<FlatSegment>& segments,
                                                    int64_t unsharded_start_idx, int64_t unsharded_end_idx) {
  TORCH_CHECK(unsharded_start_idx >= 0 && unsharded_start_idx <= unsharded_end_idx,
              "unsharded_start_idx: ", unsharded_start_idx, " unsharded_end_idx: ", unsharded_end_idx);
  const int64_t sharded_numel = unsharded_end_idx - unsharded_start_idx + 1;
  std::vector<FlatShardParamInfo> infos;
  for (const FlatSegment& seg : segments) {
    if (seg.is_padding()) continue;
    // [param_start, param_end] inclusive, as _get_flat_param_offsets. As in PyTorch, a
    // 0-numel parameter strictly inside the shard counts as in it with numel_in_shard 0.
    const int64_t param_start = seg.start, param_end = seg.start + seg.numel - 1;
    FlatShardParamInfo info;
    info.index = seg.param_index;
    info.in_shard = unsharded_start_idx <= param_end && unsharded_end_idx >= param_start;
    if (info.in_shard) {
      if (unsharded_start_idx <= param_start) {
        info.intra_param_start_idx = 0;
        info.offset_in_shard = param_start - unsharded_start_idx;
      } else {
        info.intra_param_start_idx = unsharded_start_idx - param_start;
        info.offset_in_shard = 0;
      }
      TORCH_INTERNAL_ASSERT(info.offset_in_shard >= 0 && info.offset_in_shard < sharded_numel,
                            "Invalid `offset_in_shard` of ", info.offset_in_shard, " for sharded flat parameter with ",
                            sharded_numel, " numel");
      info.intra_param_end_idx = std::min(param_end, unsharded_end_idx) - param_start;
      info.numel_in_shard = info.intra_param_end_idx - info.intra_param_start_idx + 1;
    }
    infos.push_back(info);
  }
  return infos;
}

FlatChunk MakeFlatChunk(int64_t total_numel, int64_t world_size, int64_t rank) {
  TORCH_CHECK(total_numel >= 0, "MakeFlatChunk: total_numel must be >= 0 but got ", total_numel);
  TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "MakeFlatChunk: rank ", rank, " not in [0, ",
              world_size, ")");
  FlatChunk c;
  c.chunk = (total_numel + world_size - 1) / world_size;
  // torch.chunk yields ceil(total / chunk) chunks; a rank past them gets an empty one.
  c.start = std::min(total_numel, rank * c.chunk);
  c.end = std::min(total_numel, c.start + c.chunk);
  c.numel_padded = c.chunk - (c.end - c.start);
  return c;
}

}  // namespace fsdp
