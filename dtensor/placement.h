// Placement: how a DTensor is laid out along one mesh dimension.
#ifndef FSDP_DTENSOR_PLACEMENT_H_
#define FSDP_DTENSOR_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "comm/reduce_op.h"

namespace fsdp::dtensor {

enum class PlacementKind { kShard, kStridedShard, kReplicate, kPartial };

// One of (as torch.distributed.tensor):
//   Shard(dim)                   rank c of N holds torch.chunk(t, N, dim)[c] (ceil-sized
//                                chunks; trailing ranks may hold fewer rows or none);
//   StridedShard(dim, sf)        t is torch.chunk'ed into sf pieces along dim, each piece
//                                into N chunks; rank c holds chunk c of every piece,
//                                concatenated (PyTorch 2.15's _StridedShard: what FSDP's
//                                dim-0 sharding of a tensor-parallel shard looks like from
//                                the global tensor, even or uneven);
//   Replicate()                  every rank holds t;
//   Partial(op)                  t = op-reduction of the ranks' local tensors.
// Shard is StridedShard with split factor 1; both count as is_shard(). Cheap to copy.
class Placement {
 public:
  static Placement Shard(int64_t dim) { return Placement(PlacementKind::kShard, dim, 1); }
  static Placement StridedShard(int64_t dim, int64_t split_factor);
  static Placement Replicate() { return Placement(PlacementKind::kReplicate, -1, 1); }
  static Placement Partial(comm::ReduceOp op = comm::ReduceOp::Sum());

  PlacementKind kind() const { return kind_; }
  bool is_shard() const { return kind_ == PlacementKind::kShard || kind_ == PlacementKind::kStridedShard; }
  bool is_shard(int64_t dim) const { return is_shard() && dim_ == dim; }
  bool is_strided_shard() const { return kind_ == PlacementKind::kStridedShard; }
  bool is_replicate() const { return kind_ == PlacementKind::kReplicate; }
  bool is_partial() const { return kind_ == PlacementKind::kPartial; }

  // The sharded tensor dimension; only for shards.
  int64_t dim() const;
  // 1 for Shard, the split factor for StridedShard.
  int64_t split_factor() const { return split_factor_; }
  // Only for Partial.
  const comm::ReduceOp& reduce_op() const;

  // "Shard(dim=0)", "StridedShard(dim=0, sf=2)", "Replicate()", "Partial(SUM)".
  std::string ToString() const;

  friend bool operator==(const Placement& a, const Placement& b) {
    return a.kind_ == b.kind_ && a.dim_ == b.dim_ && a.split_factor_ == b.split_factor_ && a.op_ == b.op_;
  }
  friend bool operator!=(const Placement& a, const Placement& b) { return !(a == b); }

 private:
  Placement(PlacementKind kind, int64_t dim, int64_t split_factor, comm::ReduceOp op = comm::ReduceOp::Sum())
      : kind_(kind), dim_(dim), split_factor_(split_factor), op_(op) {}

  PlacementKind kind_;
  int64_t dim_;
  int64_t split_factor_;
  comm::ReduceOp op_;  // meaningful for Partial only
};

using Placements = std::vector<Placement>;

// "(Shard(dim=0), Replicate())".
std::string ToString(const Placements& placements);

// `placements` with every Partial made Replicate: how the gradient of a Partial value
// arrives (each partial term's gradient is the whole output gradient), as
// torch/distributed/tensor/_redistribute.py's backward.
Placements ReplicatePartials(Placements placements);

}  // namespace fsdp::dtensor

#endif  // FSDP_DTENSOR_PLACEMENT_H_
