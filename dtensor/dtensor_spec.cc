#include "dtensor/dtensor_spec.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp::dtensor {
namespace {

// Positions [pos, pos + len) of the concatenation of `runs`, as runs of the same indices.
void AppendSlice(const std::vector<Segment>& runs, int64_t pos, int64_t len, std::vector<Segment>* out) {
  int64_t run_begin = 0;
  for (const Segment& run : runs) {
    if (len == 0) return;
    const int64_t run_end = run_begin + run.length;
    if (pos < run_end) {
      const int64_t take = std::min(len, run_end - pos);
      const int64_t start = run.start + (pos - run_begin);
      if (!out->empty() && out->back().start + out->back().length == start) {
        out->back().length += take;  // adjacent runs stay one run
      } else {
        out->push_back({start, take});
      }
      pos += take;
      len -= take;
    }
    run_begin = run_end;
  }
}

int64_t TotalLength(const std::vector<Segment>& runs) {
  int64_t n = 0;
  for (const Segment& run : runs) n += run.length;
  return n;
}

}  // namespace

Chunk ChunkOf(int64_t n, int64_t pieces, int64_t index) {
  const int64_t full = (n + pieces - 1) / pieces;
  const int64_t begin = full * index;
  if (begin >= n) return {0, n};
  return {std::min(n, begin + full) - begin, begin};
}

// PyTorch 2.15's _StridedShard._split_tensor (torch/distributed/tensor/placement_types.py):
// torch.chunk the dim into split_factor pieces first (the virtual "right" sharding), then
// each piece over the mesh dimension; rank c holds piece j's chunk c for every j. Shard is
// the split_factor 1 case. (Older PyTorch cut N * split_factor equal pieces; the two agree
// only when the sizes divide evenly.)
std::vector<Chunk> ShardPieceChunks(const Placement& shard, int64_t n, int64_t mesh_size, int64_t coordinate) {
  const int64_t sf = shard.split_factor();
  std::vector<Chunk> chunks;
  chunks.reserve(sf);
  for (int64_t j = 0; j < sf; ++j) {
    const Chunk outer = sf == 1 ? Chunk{n, 0} : ChunkOf(n, sf, j);
    const Chunk inner = ChunkOf(outer.size, mesh_size, coordinate);
    // An empty piece reports the dim's end, as ChunkOf does for Shard.
    chunks.push_back(inner.size == 0 ? Chunk{0, n} : Chunk{inner.size, outer.offset + inner.offset});
  }
  return chunks;
}

std::vector<Segment> ShardPieces(const Placement& shard, int64_t n, int64_t mesh_size, int64_t coordinate) {
  std::vector<Segment> pieces;
  for (const Chunk& c : ShardPieceChunks(shard, n, mesh_size, coordinate)) {
    if (c.size > 0) AppendSlice({{0, n}}, c.offset, c.size, &pieces);
  }
  return pieces;
}

std::vector<std::vector<Segment>> LocalSegments(const std::vector<int64_t>& global_shape,
                                                const std::vector<int64_t>& mesh_shape,
                                                const std::vector<int64_t>& coordinate, const Placements& placements) {
  std::vector<std::vector<Segment>> runs;
  for (int64_t size : global_shape) {
    runs.push_back(size > 0 ? std::vector<Segment>{{0, size}} : std::vector<Segment>{});
  }
  for (size_t m = 0; m < placements.size(); ++m) {
    if (!placements[m].is_shard()) continue;
    std::vector<Segment>& dim_runs = runs[placements[m].dim()];
    std::vector<Segment> next;
    for (const Segment& piece : ShardPieces(placements[m], TotalLength(dim_runs), mesh_shape[m], coordinate[m])) {
      AppendSlice(dim_runs, piece.start, piece.length, &next);
    }
    dim_runs = std::move(next);
  }
  return runs;
}

LocalShapeAndOffset ComputeLocalShapeAndGlobalOffset(const std::vector<int64_t>& global_shape,
                                                     const std::vector<int64_t>& mesh_shape,
                                                     const std::vector<int64_t>& coordinate,
                                                     const Placements& placements) {
  // As torch/distributed/tensor/_utils.py's compute_local_shape_and_global_offset: the
  // local size and the global index of the first local row, also when a StridedShard
  // leaves the local rows in several runs (its callers only need where the block starts).
  const auto runs = LocalSegments(global_shape, mesh_shape, coordinate, placements);
  LocalShapeAndOffset result;
  for (size_t d = 0; d < runs.size(); ++d) {
    result.shape.push_back(TotalLength(runs[d]));
    result.offset.push_back(runs[d].empty() ? global_shape[d] : runs[d][0].start);
  }
  return result;
}

Placements ValidatePlacements(const Placements& placements, int mesh_ndim, int64_t tensor_ndim, const char* what) {
  TORCH_CHECK(static_cast<int>(placements.size()) == mesh_ndim, what, ": got ", placements.size(), " placements ",
              ToString(placements), " for a ", mesh_ndim, "-D mesh; placements must have one entry per mesh dimension");
  Placements normalized;
  for (size_t m = 0; m < placements.size(); ++m) {
    const Placement& p = placements[m];
    if (!p.is_shard()) {
      normalized.push_back(p);
      continue;
    }
    const int64_t dim = p.dim();
    TORCH_CHECK(dim >= -tensor_ndim && dim < tensor_ndim, what, ": shard dim ", dim, " of placement ", m, " (",
                p.ToString(), ") is out of range for a ", tensor_ndim, "-D tensor");
    const int64_t d = dim < 0 ? dim + tensor_ndim : dim;
    normalized.push_back(p.is_strided_shard() ? Placement::StridedShard(d, p.split_factor()) : Placement::Shard(d));
  }
  return normalized;
}

std::vector<int64_t> ContiguousStride(const std::vector<int64_t>& shape) {
  std::vector<int64_t> stride(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) {
    stride[d] = stride[d + 1] * std::max<int64_t>(shape[d + 1], 1);
  }
  return stride;
}

DTensorSpec DTensorSpec::Make(mesh::DeviceMeshPtr mesh, Placements placements, std::vector<int64_t> shape,
                              c10::ScalarType dtype, std::vector<int64_t> stride) {
  TORCH_CHECK(mesh != nullptr, "DTensorSpec: mesh is null");
  for (size_t d = 0; d < shape.size(); ++d) {
    TORCH_CHECK(shape[d] >= 0, "DTensorSpec: shape[", d, "] must be >= 0, got ", shape[d]);
  }
  DTensorSpec spec;
  spec.placements = ValidatePlacements(placements, mesh->ndim(), static_cast<int64_t>(shape.size()), "DTensorSpec");
  TORCH_CHECK(stride.empty() || stride.size() == shape.size(), "DTensorSpec: stride has ", stride.size(),
              " entries for a ", shape.size(), "-D shape");
  spec.stride = stride.empty() ? ContiguousStride(shape) : std::move(stride);
  spec.mesh = std::move(mesh);
  spec.shape = std::move(shape);
  spec.dtype = dtype;
  return spec;
}

std::vector<int64_t> DTensorSpec::local_shape() const {
  std::vector<int64_t> local;
  for (const auto& runs : LocalSegments(shape, mesh->shape(), mesh->coordinate(), placements)) {
    local.push_back(TotalLength(runs));
  }
  return local;
}

LocalShapeAndOffset DTensorSpec::local_shape_and_offset() const {
  return ComputeLocalShapeAndGlobalOffset(shape, mesh->shape(), mesh->coordinate(), placements);
}

int64_t DTensorSpec::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

bool DTensorSpec::has_partial() const {
  return std::any_of(placements.begin(), placements.end(), [](const Placement& p) { return p.is_partial(); });
}

DTensorSpec DTensorSpec::WithPlacements(Placements new_placements) const {
  DTensorSpec spec = *this;
  spec.placements = ValidatePlacements(new_placements, mesh->ndim(), static_cast<int64_t>(shape.size()), "DTensorSpec");
  return spec;
}

std::string DTensorSpec::ToString() const {
  return absl::StrCat("DTensorSpec(shape=[", absl::StrJoin(shape, ", "), "], ", c10::toString(dtype), ", ",
                      dtensor::ToString(placements), ", ", mesh->ToString(), ")");
}

}  // namespace fsdp::dtensor
