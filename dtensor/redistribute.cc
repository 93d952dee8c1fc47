#include "dtensor/redistribute.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "dtensor/large_output_cache.h"

namespace fsdp::dtensor {
namespace {

int64_t Product(const std::vector<int64_t>& v) {
  int64_t p = 1;
  for (int64_t x : v) p *= x;
  return p;
}

// The shape the tensor has at mesh dimension m: global shape cut by current[0..m).
std::vector<int64_t> LogicalShape(const DTensorSpec& spec, const Placements& current, int m) {
  const Placements prefix(current.begin(), current.begin() + m);
  std::vector<int64_t> shape;
  for (const auto& runs : LocalSegments(spec.shape, spec.mesh->shape(), spec.mesh->coordinate(), prefix)) {
    int64_t n = 0;
    for (const Segment& s : runs) n += s.length;
    shape.push_back(n);
  }
  return shape;
}

int64_t RowsOf(const std::vector<Chunk>& chunks) {
  int64_t rows = 0;
  for (const Chunk& c : chunks) rows += c.size;
  return rows;
}

int64_t MaxRows(const Placement& shard, int64_t n, int64_t group_size) {
  int64_t rows = 0;
  for (int64_t r = 0; r < group_size; ++r) {
    rows = std::max(rows, RowsOf(ShardPieceChunks(shard, n, group_size, r)));
  }
  return rows;
}

bool EvenPlainShard(const Placement& shard, int64_t n, int64_t group_size) {
  return shard.split_factor() == 1 && n % group_size == 0;
}

// PyTorch's Shard (not _StridedShard, which PyTorch 2.15 does not count as a shard when
// planning: its is_shard() is false) on tensor dim `dim`, or on any dim when dim < 0.
bool IsPlainShard(const Placement& p, int64_t dim = -1) {
  return p.kind() == PlacementKind::kShard && (dim < 0 || p.dim() == dim);
}

int64_t NumShards(const mesh::DeviceMesh& mesh, const Placements& placements) {
  int64_t n = 1;
  for (size_t m = 0; m < placements.size(); ++m) {
    if (placements[m].is_shard()) n *= mesh.size(static_cast<int>(m));
  }
  return n;
}

int64_t StepBytes(const TransformStep& step, int64_t group_size, int64_t element_size) {
  const std::vector<int64_t>& shape = step.logical_shape;
  switch (step.kind) {
    case TransformKind::kAllGather:
    case TransformKind::kReduceScatter: {
      const Placement& shard = step.kind == TransformKind::kAllGather ? step.src : step.dst;
      const int64_t d = shard.dim();
      const int64_t rest = shape[d] == 0 ? 0 : Product(shape) / shape[d];
      return group_size * MaxRows(shard, shape[d], group_size) * rest * element_size;
    }
    case TransformKind::kAllReduce: return Product(shape) * element_size;
    case TransformKind::kAllToAll: {
      const int64_t d = step.src.dim();
      const int64_t rest = shape[d] == 0 ? 0 : Product(shape) / shape[d];
      return rest * RowsOf(ShardPieceChunks(step.src, shape[d], group_size, 0)) * element_size;
    }
    default: return 0;
  }
}

// The steps of one placement change cur -> tgt on mesh dim m, as
// torch/distributed/tensor/_redistribute.py's redistribute_local_tensor runs one transform:
// one collective at most, with a local chunk after it where PyTorch goes through Replicate
// (a StridedShard on either side, Partial -> StridedShard).
void AppendTransform(const DTensorSpec& src, const Placements& current, int m, const Placement& cur,
                     const Placement& tgt, RedistributePlan* plan) {
  const mesh::DeviceMesh& mesh = *src.mesh;
  // One rank on this mesh dim: the local tensor already is the result (PyTorch skips it).
  if (cur == tgt || mesh.size(m) == 1) return;
  const auto add = [&](const Placement& from, const Placement& to, TransformKind kind) {
    TransformStep step{m, from, to, kind, LogicalShape(src, current, m), 0};
    step.bytes = StepBytes(step, mesh.size(m), c10::elementSize(src.dtype));
    plan->steps.push_back(std::move(step));
  };
  const Placement replicate = Placement::Replicate();
  if (tgt.is_replicate()) {
    add(cur, tgt, cur.is_partial() ? TransformKind::kAllReduce : TransformKind::kAllGather);
  } else if (tgt.is_partial()) {
    if (cur.is_replicate()) {
      add(cur, tgt, TransformKind::kLocalPartition);
    } else if (cur.is_partial()) {
      TORCH_CHECK(false, "redistribute: redistribution from one partial type (", cur.ToString(), ") to another (",
                  tgt.ToString(), ") is unsupported");
    } else {
      TORCH_CHECK(IsPlainShard(cur) && tgt.reduce_op().kind() == comm::ReduceOpKind::kSum, "redistribute from ",
                  cur.ToString(), " to ", tgt.ToString(), " not supported yet");
      add(cur, tgt, TransformKind::kLocalZeroFill);
    }
  } else if (IsPlainShard(tgt) && !cur.is_strided_shard()) {
    if (cur.is_partial()) {
      add(cur, tgt, TransformKind::kReduceScatter);
    } else if (cur.is_replicate()) {
      add(cur, tgt, TransformKind::kLocalChunk);
    } else {
      add(cur, tgt, TransformKind::kAllToAll);
    }
  } else {  // through Replicate: a StridedShard on either side
    if (!cur.is_replicate())
      add(cur, replicate, cur.is_partial() ? TransformKind::kAllReduce : TransformKind::kAllGather);
    add(replicate, tgt, TransformKind::kLocalChunk);
  }
}

// PyTorch 2.15's greedy planner (DTensorRedistributePlanner.generate_greedy_transform_infos
// in torch/distributed/tensor/_redistribute.py): when the source shards, first walk the mesh
// dims from the innermost out, replicating a dim whose target Shard(d) is nested under a
// different set of earlier mesh dims sharding d than the source has; then walk outermost in
// and finish every dim. At most one transform per mesh dim per walk, so at most 2 * ndim.
// PyTorch plans a StridedShard with a min-cost graph search instead (its greedy walks would
// miss a nested StridedShard: "TODO: extend nested sharding detection to _StridedShard");
// here a StridedShard counts as a shard of its dim in the nesting check, so the same walks
// stay correct with it, possibly with other collectives than PyTorch's search picks.
std::shared_ptr<const RedistributePlan> BuildPlan(const DTensorSpec& src, const Placements& dst) {
  auto plan = std::make_shared<RedistributePlan>();
  plan->src = src.placements;
  plan->dst = dst;
  Placements current = src.placements;
  const int ndim = static_cast<int>(current.size());
  // The shards of tensor_dim on the mesh dims before `before` (PyTorch compares which mesh
  // dims shard it; with a StridedShard the split factor matters too). Size-1 mesh dims count
  // as PyTorch counts them (their transforms are skipped, but they can force a replicate).
  const auto sharding_dims = [](const Placements& placements, int before, int64_t tensor_dim) {
    std::vector<std::pair<int, Placement>> dims;
    for (int i = 0; i < before; ++i) {
      if (placements[i].is_shard(tensor_dim)) dims.emplace_back(i, placements[i]);
    }
    return dims;
  };
  if (NumShards(*src.mesh, src.placements) > 1) {
    for (int m = ndim - 1; m >= 0; --m) {
      Placement tgt = dst[m];
      if (tgt.is_shard() && sharding_dims(current, m, tgt.dim()) != sharding_dims(dst, m, tgt.dim())) {
        tgt = Placement::Replicate();
      }
      if (current[m] == tgt) continue;
      AppendTransform(src, current, m, current[m], tgt, plan.get());
      current[m] = tgt;
    }
  }
  for (int m = 0; m < ndim; ++m) {
    if (current[m] == dst[m]) continue;
    AppendTransform(src, current, m, current[m], dst[m], plan.get());
    current[m] = dst[m];
  }
  return plan;
}

// ---- execution: one function per transform, each with its copy-in / copy-out ----

at::Tensor AllGatherShards(const at::Tensor& local, const Placement& shard, const std::vector<int64_t>& logical,
                           const comm::ProcessGroupPtr& group) {
  const int64_t d = shard.dim(), n = logical[d], world = group->size();
  const int64_t max_rows = MaxRows(shard, n, world);
  at::Tensor rows = local.movedim(d, 0);
  if (rows.size(0) < max_rows) {  // pad to the largest shard so every rank sends equal bytes
    std::vector<int64_t> pad_shape = rows.sizes().vec();
    pad_shape[0] = max_rows - rows.size(0);
    rows = at::cat({rows, at::zeros(pad_shape, rows.options())}, 0);
  }
  rows = rows.contiguous();
  std::vector<int64_t> out_shape = rows.sizes().vec();
  out_shape[0] = world * max_rows;
  at::Tensor gathered = EmptyOutput(out_shape, rows.options());
  group->all_gather_into_tensor(gathered, rows)->wait();
  if (!EvenPlainShard(shard, n, world)) {  // drop padding, put pieces in global order
    std::vector<at::Tensor> ordered(world * shard.split_factor());
    for (int64_t r = 0; r < world; ++r) {
      int64_t offset = r * max_rows;
      const auto chunks = ShardPieceChunks(shard, n, world, r);
      for (size_t j = 0; j < chunks.size(); ++j) {
        ordered[r + j * world] = gathered.narrow(0, offset, chunks[j].size);
        offset += chunks[j].size;
      }
    }
    gathered = at::cat(ordered, 0);
  }
  return gathered.movedim(0, d).contiguous();
}

at::Tensor ReduceScatterShards(const at::Tensor& local, const Placement& shard, const comm::ReduceOp& op,
                               const std::vector<int64_t>& logical, const comm::ProcessGroupPtr& group) {
  const int64_t d = shard.dim(), n = logical[d], world = group->size();
  const int64_t max_rows = MaxRows(shard, n, world);
  const at::Tensor rows = local.movedim(d, 0);
  at::Tensor input;
  if (EvenPlainShard(shard, n, world)) {
    input = rows.contiguous();
  } else {  // rank r's pieces first, each rank's block padded to max_rows
    std::vector<at::Tensor> blocks;
    for (int64_t r = 0; r < world; ++r) {
      std::vector<at::Tensor> parts;
      for (const Chunk& c : ShardPieceChunks(shard, n, world, r)) parts.push_back(rows.narrow(0, c.offset, c.size));
      at::Tensor block = at::cat(parts, 0);
      if (block.size(0) < max_rows) {
        std::vector<int64_t> pad_shape = block.sizes().vec();
        pad_shape[0] = max_rows - block.size(0);
        block = at::cat({block, at::zeros(pad_shape, block.options())}, 0);
      }
      blocks.push_back(block);
    }
    input = at::cat(blocks, 0);
  }
  std::vector<int64_t> out_shape = rows.sizes().vec();
  out_shape[0] = max_rows;
  at::Tensor out = EmptyOutput(out_shape, rows.options());
  group->reduce_scatter_tensor(out, input, op)->wait();
  const int64_t mine = RowsOf(ShardPieceChunks(shard, n, world, group->rank()));
  return out.narrow(0, 0, mine).movedim(0, d).contiguous();
}

at::Tensor AllReducePartial(const at::Tensor& local, const comm::ReduceOp& op, const comm::ProcessGroupPtr& group) {
  at::Tensor out = local.clone(at::MemoryFormat::Contiguous);
  group->all_reduce(out, op)->wait();
  return out;
}

at::Tensor ChunkLocally(const at::Tensor& local, const Placement& shard, const std::vector<int64_t>& logical,
                        int64_t world, int64_t coordinate) {
  const int64_t d = shard.dim();
  const auto pieces = ShardPieces(shard, logical[d], world, coordinate);
  if (pieces.empty()) return local.narrow(d, 0, 0).contiguous();
  if (pieces.size() == 1) return local.narrow(d, pieces[0].start, pieces[0].length).contiguous();
  std::vector<at::Tensor> parts;
  for (const Segment& s : pieces) parts.push_back(local.narrow(d, s.start, s.length));
  return at::cat(parts, d);
}

// Replicate -> Partial: the ranks' values must reduce back to the replicated value.
at::Tensor PartitionLocally(const at::Tensor& local, const comm::ReduceOp& op, int64_t world, int64_t coordinate) {
  if (op.kind() != comm::ReduceOpKind::kSum) return local.clone();  // avg/max/min of copies
  if (at::isFloatingType(local.scalar_type()) || at::isComplexType(local.scalar_type())) {
    return local / static_cast<double>(world);  // as PyTorch's Partial._partition_value
  }
  // Integers cannot be divided exactly: coordinate 0 keeps the value, the others add 0.
  return coordinate == 0 ? local.clone() : at::zeros_like(local);
}

// Shard -> Partial(sum): this rank's shard at its place in a zero tensor of the logical
// shape, so that the ranks' sum is the tensor (PyTorch's Shard._to_partial_tensor).
at::Tensor ZeroFillShard(const at::Tensor& local, const Placement& shard, const std::vector<int64_t>& logical,
                         int64_t world, int64_t coordinate) {
  const int64_t d = shard.dim();
  std::vector<int64_t> shape = local.sizes().vec();
  shape[d] = logical[d];
  at::Tensor out = at::zeros(shape, local.options());
  const Chunk mine = ChunkOf(logical[d], world, coordinate);
  if (mine.size > 0) out.narrow(d, mine.offset, mine.size).copy_(local);
  return out;
}

at::Tensor AllToAllShards(const at::Tensor& local, const Placement& src, const Placement& dst,
                          const std::vector<int64_t>& logical, const comm::ProcessGroupPtr& group) {
  const int64_t i = src.dim(), j = dst.dim(), world = group->size(), me = group->rank();
  std::vector<at::Tensor> sends;
  std::vector<int64_t> in_splits, out_splits;
  std::vector<std::vector<int64_t>> recv_shapes;
  for (int64_t r = 0; r < world; ++r) {
    const Chunk to_r = ChunkOf(logical[j], world, r);
    sends.push_back(local.narrow(j, to_r.offset, to_r.size).contiguous().view(-1));
    in_splits.push_back(sends.back().numel());
    std::vector<int64_t> shape = local.sizes().vec();
    shape[i] = ChunkOf(logical[i], world, r).size;
    shape[j] = ChunkOf(logical[j], world, me).size;
    out_splits.push_back(Product(shape));
    recv_shapes.push_back(std::move(shape));
  }
  const at::Tensor input = at::cat(sends, 0);
  at::Tensor output = at::empty({std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0})}, local.options());
  group->all_to_all_single(output, input, out_splits, in_splits)->wait();
  std::vector<at::Tensor> parts;
  int64_t offset = 0;
  for (int64_t r = 0; r < world; ++r) {
    parts.push_back(output.narrow(0, offset, out_splits[r]).view(recv_shapes[r]));
    offset += out_splits[r];
  }
  return at::cat(parts, i);
}

}  // namespace

const char* TransformKindName(TransformKind kind) {
  switch (kind) {
    case TransformKind::kAllGather: return "all_gather";
    case TransformKind::kAllReduce: return "all_reduce";
    case TransformKind::kReduceScatter: return "reduce_scatter";
    case TransformKind::kAllToAll: return "all_to_all";
    case TransformKind::kLocalChunk: return "local_chunk";
    case TransformKind::kLocalPartition: return "local_partition";
    case TransformKind::kLocalZeroFill: return "local_zero_fill";
  }
  return "?";
}

std::string RedistributePlan::ToString(const mesh::DeviceMesh& mesh) const {
  if (steps.empty()) return absl::StrCat(dtensor::ToString(src), " -> ", dtensor::ToString(dst), ": no-op");
  std::vector<std::string> lines;
  for (const TransformStep& s : steps) {
    const std::string name = mesh.dim_names().empty() ? "" : absl::StrCat(" (", mesh.dim_names()[s.mesh_dim], ")");
    lines.push_back(absl::StrCat("mesh dim ", s.mesh_dim, name, ": ", s.src.ToString(), " -> ", s.dst.ToString(), ": ",
                                 TransformKindName(s.kind), " over ", mesh.size(s.mesh_dim), " ranks, logical [",
                                 absl::StrJoin(s.logical_shape, ", "), "], ", s.bytes, " B"));
  }
  return absl::StrJoin(lines, "\n");
}

int64_t RedistributePlan::total_bytes() const {
  int64_t total = 0;
  for (const TransformStep& s : steps) total += s.bytes;
  return total;
}

std::shared_ptr<const RedistributePlan> PlanRedistribute(const DTensorSpec& src, const Placements& dst) {
  const Placements target =
      ValidatePlacements(dst, src.mesh->ndim(), static_cast<int64_t>(src.shape.size()), "redistribute");
  // Plans depend only on this key; a thread owns one rank, so a per-thread cache needs no lock.
  thread_local absl::flat_hash_map<std::string, std::shared_ptr<const RedistributePlan>> cache;
  std::string key = absl::StrCat(absl::StrJoin(src.mesh->shape(), ","), "|", absl::StrJoin(src.mesh->coordinate(), ","),
                                 "|", absl::StrJoin(src.shape, ","), "|", static_cast<int>(src.dtype), "|",
                                 ToString(src.placements), "|", ToString(target));
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (cache.size() > 4096) cache.clear();  // bound memory for programs with many shapes
  auto plan = BuildPlan(src, target);
  cache.emplace(std::move(key), plan);
  return plan;
}

at::Tensor RunRedistributePlan(const at::Tensor& local, const DTensorSpec& src, const RedistributePlan& plan) {
  const mesh::DeviceMesh& mesh = *src.mesh;
  at::Tensor t = local;
  for (const TransformStep& s : plan.steps) {
    const comm::ProcessGroupPtr& group = mesh.group(s.mesh_dim);
    switch (s.kind) {
      case TransformKind::kAllGather: t = AllGatherShards(t, s.src, s.logical_shape, group); break;
      case TransformKind::kAllReduce: t = AllReducePartial(t, s.src.reduce_op(), group); break;
      case TransformKind::kReduceScatter:
        t = ReduceScatterShards(t, s.dst, s.src.reduce_op(), s.logical_shape, group);
        break;
      case TransformKind::kAllToAll: t = AllToAllShards(t, s.src, s.dst, s.logical_shape, group); break;
      case TransformKind::kLocalChunk:
        t = ChunkLocally(t, s.dst, s.logical_shape, mesh.size(s.mesh_dim), mesh.coordinate()[s.mesh_dim]);
        break;
      case TransformKind::kLocalPartition:
        t = PartitionLocally(t, s.dst.reduce_op(), mesh.size(s.mesh_dim), mesh.coordinate()[s.mesh_dim]);
        break;
      case TransformKind::kLocalZeroFill:
        t = ZeroFillShard(t, s.src, s.logical_shape, mesh.size(s.mesh_dim), mesh.coordinate()[s.mesh_dim]);
        break;
    }
  }
  return t;
}

}  // namespace fsdp::dtensor
