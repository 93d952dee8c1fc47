#include "context_parallel/load_balancer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

namespace fsdp::context_parallel {
namespace {

int64_t Pieces(int64_t cp_size, bool load_balanced) { return load_balanced ? 2 * cp_size : cp_size; }

void CheckLayout(const char* what, int64_t seq_len, int64_t cp_rank, int64_t cp_size, bool load_balanced) {
  TORCH_CHECK(cp_size >= 1 && cp_rank >= 0 && cp_rank < cp_size, what, ": cp_rank ", cp_rank,
              " outside [0, cp_size = ", cp_size, ")");
  const int64_t pieces = Pieces(cp_size, load_balanced);
  TORCH_CHECK(
      seq_len % pieces == 0, what, ": the sequence length ", seq_len, " must be divisible by ", pieces,
      load_balanced ? " (2 x the context-parallel degree: head-tail chunks)" : " (the context-parallel degree)");
}

}  // namespace

at::Tensor ShardPositions(int64_t seq_len, int64_t cp_rank, int64_t cp_size, bool load_balanced) {
  CheckLayout("ShardPositions", seq_len, cp_rank, cp_size, load_balanced);
  const int64_t chunk = seq_len / Pieces(cp_size, load_balanced);
  at::Tensor first = at::arange(cp_rank * chunk, (cp_rank + 1) * chunk, at::kLong);
  if (!load_balanced) return first;
  const int64_t tail = 2 * cp_size - 1 - cp_rank;
  return at::cat({first, at::arange(tail * chunk, (tail + 1) * chunk, at::kLong)});
}

at::Tensor ShardSequence(const at::Tensor& buffer, int64_t seq_dim, int64_t cp_rank, int64_t cp_size,
                         bool load_balanced) {
  TORCH_CHECK(seq_dim >= -buffer.dim() && seq_dim < buffer.dim(), "ShardSequence: seq_dim ", seq_dim, " outside a ",
              buffer.dim(), "-D tensor");
  const int64_t dim = seq_dim < 0 ? seq_dim + buffer.dim() : seq_dim;
  CheckLayout("ShardSequence", buffer.size(dim), cp_rank, cp_size, load_balanced);
  return buffer.index_select(dim,
                             ShardPositions(buffer.size(dim), cp_rank, cp_size, load_balanced).to(buffer.device()));
}

at::Tensor UnshardSequence(const at::Tensor& local, int64_t seq_dim, const comm::ProcessGroupPtr& group,
                           bool load_balanced) {
  TORCH_CHECK(group != nullptr, "UnshardSequence: group is null");
  TORCH_CHECK(seq_dim >= -local.dim() && seq_dim < local.dim(), "UnshardSequence: seq_dim ", seq_dim, " outside a ",
              local.dim(), "-D tensor");
  const int64_t dim = seq_dim < 0 ? seq_dim + local.dim() : seq_dim;
  const int64_t world = group->size(), seq_len = local.size(dim) * world;
  CheckLayout("UnshardSequence", seq_len, group->rank(), world, load_balanced);
  // Gathered along dim 0 of a contiguous copy with the sequence first.
  const at::Tensor moved = local.movedim(dim, 0).contiguous();
  at::Tensor gathered = at::empty({world * moved.numel()}, moved.options());
  group->all_gather_into_tensor(gathered, moved.reshape(-1))->wait();
  std::vector<int64_t> shape = moved.sizes().vec();
  shape[0] = seq_len;
  gathered = gathered.view(shape);
  // Gathered row j holds position positions[j]: scatter them back.
  std::vector<at::Tensor> positions;
  for (int64_t r = 0; r < world; ++r) positions.push_back(ShardPositions(seq_len, r, world, load_balanced));
  at::Tensor restored = at::empty_like(gathered);
  restored.index_copy_(0, at::cat(positions).to(gathered.device()), gathered);
  return restored.movedim(0, dim);
}

}  // namespace fsdp::context_parallel
