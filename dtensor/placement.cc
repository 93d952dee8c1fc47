#include "dtensor/placement.h"

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace fsdp::dtensor {

Placement Placement::StridedShard(int64_t dim, int64_t split_factor) {
  TORCH_CHECK(split_factor >= 1, "StridedShard: split_factor must be >= 1, got ", split_factor);
  return Placement(PlacementKind::kStridedShard, dim, split_factor);
}

Placement Placement::Partial(comm::ReduceOp op) {
  TORCH_CHECK(op.kind() != comm::ReduceOpKind::kPremulSum,
              "Partial: PREMUL_SUM is not a placement's reduce op (fold the factor into the "
              "local tensor), got ",
              op.ToString());
  return Placement(PlacementKind::kPartial, -1, 1, op);
}

int64_t Placement::dim() const {
  TORCH_CHECK(is_shard(), "Placement::dim: ", ToString(), " is not a shard placement");
  return dim_;
}

const comm::ReduceOp& Placement::reduce_op() const {
  TORCH_CHECK(is_partial(), "Placement::reduce_op: ", ToString(), " is not Partial");
  return op_;
}

std::string Placement::ToString() const {
  switch (kind_) {
    case PlacementKind::kShard: return absl::StrCat("Shard(dim=", dim_, ")");
    case PlacementKind::kStridedShard: return absl::StrCat("StridedShard(dim=", dim_, ", sf=", split_factor_, ")");
    case PlacementKind::kReplicate: return "Replicate()";
    case PlacementKind::kPartial: return absl::StrCat("Partial(", op_.ToString(), ")");
  }
  return "?";
}

std::string ToString(const Placements& placements) {
  std::string out = "(";
  for (size_t i = 0; i < placements.size(); ++i) {
    absl::StrAppend(&out, i ? ", " : "", placements[i].ToString());
  }
  return out + ")";
}

Placements ReplicatePartials(Placements placements) {
  for (Placement& p : placements) {
    if (p.is_partial()) p = Placement::Replicate();
  }
  return placements;
}

}  // namespace fsdp::dtensor
