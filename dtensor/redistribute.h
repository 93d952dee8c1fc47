// Redistribute: plans and runs the change of a DTensor's placements, one mesh dimension at a
// time, as torch.distributed.tensor._redistribute does.
#ifndef FSDP_DTENSOR_REDISTRIBUTE_H_
#define FSDP_DTENSOR_REDISTRIBUTE_H_

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "dtensor/dtensor_spec.h"

namespace fsdp::dtensor {

// What one step does on its mesh dimension's group.
enum class TransformKind {
  kAllGather,       // Shard/StridedShard -> Replicate (uneven shards padded, then unpadded)
  kAllReduce,       // Partial -> Replicate
  kReduceScatter,   // Partial -> Shard/StridedShard
  kAllToAll,        // Shard(i) -> Shard(j)
  kLocalChunk,      // Replicate -> Shard/StridedShard: no communication
  kLocalPartition,  // Replicate -> Partial: no communication (SUM divides by the group size)
  kLocalZeroFill,   // Shard -> Partial(sum): the shard in a zero tensor, no communication
};
const char* TransformKindName(TransformKind kind);

struct TransformStep {
  int mesh_dim;
  Placement src;
  Placement dst;
  TransformKind kind;
  // The tensor as this mesh dimension sees it: the global shape cut by the placements of
  // the earlier mesh dimensions at this step (for this rank).
  std::vector<int64_t> logical_shape;
  // Bytes of the collective's full buffer (all-gather output, reduce-scatter input,
  // all-reduce tensor, all-to-all input); 0 for local steps.
  int64_t bytes;
};

// The steps from one layout to another for this rank. Immutable; shared by the plan cache.
struct RedistributePlan {
  Placements src;
  Placements dst;
  std::vector<TransformStep> steps;
  // One line per step: "mesh dim 0 (dp): Shard(dim=0) -> Replicate(): all_gather over 4
  // ranks, logical [10, 3], 160 B"; "no-op" when src == dst.
  std::string ToString(const mesh::DeviceMesh& mesh) const;
  int64_t total_bytes() const;
};

// The plan from `src` to `dst` placements (validated against src's mesh and shape). Plans
// are cached per thread by (mesh shape, coordinate, shape, dtype, src, dst): a repeated
// redistribute costs a hash lookup.
std::shared_ptr<const RedistributePlan> PlanRedistribute(const DTensorSpec& src, const Placements& dst);

// Runs `plan` on `local` (the local tensor of `src`); returns the new local tensor. Never
// modifies `local`; the result may alias it when no step communicates (a Replicate ->
// Shard chunk of dim 0 is a view). Blocks until every collective completes (each waits
// with its group's timeout). No autograd: see DTensor::redistribute.
at::Tensor RunRedistributePlan(const at::Tensor& local, const DTensorSpec& src, const RedistributePlan& plan);

}  // namespace fsdp::dtensor

#endif  // FSDP_DTENSOR_REDISTRIBUTE_H_
