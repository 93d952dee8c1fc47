// DTensorSpec: a global tensor's metadata and its layout over a DeviceMesh, and the
// per-rank layout math (which global rows each rank holds).
#ifndef FSDP_DTENSOR_DTENSOR_SPEC_H_
#define FSDP_DTENSOR_DTENSOR_SPEC_H_

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dtensor/placement.h"
#include "mesh/device_mesh.h"

namespace fsdp::dtensor {

// torch.chunk's rule for piece `index` of `n` rows cut into `pieces`: every piece has
// ceil(n / pieces) rows except the trailing ones, which hold fewer or none. An empty piece
// reports offset n (as PyTorch's Shard._local_shard_size_and_offset).
struct Chunk {
  int64_t size;
  int64_t offset;
};
Chunk ChunkOf(int64_t n, int64_t pieces, int64_t index);

// A run of global indices [start, start + length) along one tensor dimension.
struct Segment {
  int64_t start;
  int64_t length;
  friend bool operator==(const Segment& a, const Segment& b) { return a.start == b.start && a.length == b.length; }
};

// For each tensor dimension, the global index runs the rank at `coordinate` holds, in local
// order (Shard and StridedShard applied in mesh-dimension order, each to what the earlier
// mesh dimensions left). A dimension nobody shards is one run [0, size).
// Preconditions: ValidatePlacements passed.
std::vector<std::vector<Segment>> LocalSegments(const std::vector<int64_t>& global_shape,
                                                const std::vector<int64_t>& mesh_shape,
                                                const std::vector<int64_t>& coordinate, const Placements& placements);

// The pieces of a shard placement held by `coordinate` of a mesh dimension of `mesh_size`
// ranks over `n` rows, one Chunk per piece in local order (split_factor of them; Shard
// has one), empty pieces included.
std::vector<Chunk> ShardPieceChunks(const Placement& shard, int64_t n, int64_t mesh_size, int64_t coordinate);

// The part of a shard placement held by `coordinate` of a mesh dimension of `mesh_size`
// ranks, given that dimension's `n` current rows: runs of positions in [0, n).
std::vector<Segment> ShardPieces(const Placement& shard, int64_t n, int64_t mesh_size, int64_t coordinate);

// Local shape, and the global offset of the first local row of each dimension (when a
// StridedShard leaves the local rows in several runs, the first run's start: LocalSegments
// has all of them). Empty dimensions report offset = global size. As PyTorch 2.15's
// compute_local_shape_and_global_offset.
struct LocalShapeAndOffset {
  std::vector<int64_t> shape;
  std::vector<int64_t> offset;
};
LocalShapeAndOffset ComputeLocalShapeAndGlobalOffset(const std::vector<int64_t>& global_shape,
                                                     const std::vector<int64_t>& mesh_shape,
                                                     const std::vector<int64_t>& coordinate,
                                                     const Placements& placements);

// Checks one placement per mesh dimension and shard dims in [-ndim, ndim); returns the
// placements with negative shard dims normalized. `what` prefixes the messages.
Placements ValidatePlacements(const Placements& placements, int mesh_ndim, int64_t tensor_ndim, const char* what);

// Metadata of a DTensor: the global shape/stride/dtype and the layout over `mesh`.
struct DTensorSpec {
  mesh::DeviceMeshPtr mesh;
  Placements placements;
  std::vector<int64_t> shape;   // global
  std::vector<int64_t> stride;  // global (contiguous unless given)
  c10::ScalarType dtype = c10::ScalarType::Float;

  // Validates (non-null mesh, placements vs mesh and shape) and normalizes; empty `stride`
  // means contiguous.
  static DTensorSpec Make(mesh::DeviceMeshPtr mesh, Placements placements, std::vector<int64_t> shape,
                          c10::ScalarType dtype, std::vector<int64_t> stride = {});

  // This rank's local shape and the global offset of its block.
  std::vector<int64_t> local_shape() const;
  LocalShapeAndOffset local_shape_and_offset() const;
  int64_t numel() const;
  bool has_partial() const;
  // Same spec with other placements (validated).
  DTensorSpec WithPlacements(Placements new_placements) const;
  // "DTensorSpec(shape=[4, 3], Float, (Shard(dim=0)), DeviceMesh(...))".
  std::string ToString() const;
};

std::vector<int64_t> ContiguousStride(const std::vector<int64_t>& shape);

}  // namespace fsdp::dtensor

#endif  // FSDP_DTENSOR_DTENSOR_SPEC_H_
