// Save planning of //dcp, internal to it: the boxes of a global tensor a rank holds, and
// DCP's de-duplication of items several ranks hold (replicated tensors).
//
// Contract:
//  * A Box is a block of a global tensor a rank holds in its local tensor: its offsets in
//    the global tensor and where it sits in the local one. The box helpers are pure.
//  * WholeBox: the whole tensor. RunBoxes: the boxes of a local tensor whose indices along
//    each dim are the concatenation of index runs (one box per combination of one run per
//    dim; empty boxes left out): e.g. an FSDP2 shard of a TP local tensor
//    (dtensor::LocalSegments), or any DTensor's local tensor. FlatRangeBoxes: the boxes of a
//    flat range (FSDP1), below.
//  * DedupSavePlans: torch/distributed/checkpoint/_dedup_save_plans.py dedup_save_plans
//    (PyTorch 2.15, save_to_lowest_rank=False), the default planner's step: every item key
//    that several plans hold is kept by exactly one of them, the one with the least storage
//    planned so far (ties: the lowest rank), visiting keys in first-appearance order (plans
//    in rank order, items in plan order); a bytes item counts 1. Returns, per plan, whether
//    each of its items stays. Pure; the same answer on every rank given the same plans.
//  * EncodePlan / DecodePlan: a plan as bytes (for comm::GatherBytes) and back; DecodePlan
//    checks every length against the buffer (c10::Error naming `source`).
#ifndef FSDP_DCP_PLAN_H_
#define FSDP_DCP_PLAN_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "comm/process_group.h"
#include "dtensor/dtensor_spec.h"

namespace fsdp::dcp::internal {

struct Box {
  std::vector<int64_t> global_offsets;
  std::vector<int64_t> local_offsets;
  std::vector<int64_t> sizes;
  // >= 0: the local tensor is 1-D (an FSDP1 flat-shard piece) and the box's elements are
  // local[flat_local_offset, + numel()) in row-major order; local_offsets is unused.
  int64_t flat_local_offset = -1;
  int64_t numel() const;
};

// One box: the whole tensor of `sizes`.
Box WholeBox(const std::vector<int64_t>& sizes);

// `runs[d]`: the global indices of dim d the local tensor holds, in local order. Boxes in
// row-major order of the runs, local offsets counting along the runs.
std::vector<Box> RunBoxes(const std::vector<std::vector<dtensor::Segment>>& runs);

// The boxes that make up the elements [flat_start, flat_start + numel) of the row-major
// flattening of a tensor of `global` size (an FSDP1 flat-shard piece of a parameter): per
// dimension at most a partial leading run, full rows and a partial trailing run, so at most
// 2 * dims - 1 boxes, in flat order, with flat_local_offset counting from flat_start.
std::vector<Box> FlatRangeBoxes(const std::vector<int64_t>& global, int64_t flat_start, int64_t numel);

// The part of `local` a box covers (a view).
at::Tensor BoxOf(const at::Tensor& local, const Box& box);

// One write item of a plan: its MetadataIndex (fqn and chunk offsets; bytes: fqn only) as a
// string, and its storage size in bytes (0 for bytes items).
struct PlannedItem {
  std::string key;
  int64_t storage_size = 0;
  bool is_bytes = false;
};

// The MetadataIndex key of a tensor chunk / a bytes item.
std::string ChunkKey(const std::string& fqn, const std::vector<int64_t>& offsets);
std::string BytesKey(const std::string& fqn);

std::vector<std::vector<bool>> DedupSavePlans(const std::vector<std::vector<PlannedItem>>& plans);

// DCP's central planning, collective over `world` (null: one rank): rank 0 gathers every
// rank's plan, dedups them (DedupSavePlans) and sends each rank its decisions, keep[i] for
// mine[i] (no other rank holds the W plans). A rank with a non-empty `error` makes every
// rank throw (collectives.h GatherOrThrow).
std::vector<char> DedupOverWorld(const comm::ProcessGroupPtr& world, const std::string& error,
                                 const std::vector<PlannedItem>& mine, const char* caller);

std::vector<char> EncodePlan(const std::vector<PlannedItem>& plan);
std::vector<PlannedItem> DecodePlan(const std::vector<char>& bytes, const std::string& source);

}  // namespace fsdp::dcp::internal

#endif  // FSDP_DCP_PLAN_H_
