#include "fsdp/per_param/fsdp_collectives.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/strings/str_join.h"
#include "fsdp/common/grad_divide.h"

namespace fsdp::per_param {
namespace {

at::Tensor AsBytes(const at::Tensor& t) { return t.contiguous().view(-1).view(at::kByte); }

}  // namespace

at::Tensor AllGatherBufferPool::Take(int64_t bytes, const at::TensorOptions& options) {
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->numel() >= bytes && it->device() == options.device() &&
        (best == free_.end() || it->numel() < best->numel())) {
      best = it;
    }
  }
  if (best == free_.end()) return at::empty({bytes}, options.dtype(at::kByte));
  at::Tensor buffer = std::move(*best);
  free_.erase(best);
  return buffer;
}

void AllGatherBufferPool::Give(at::Tensor buffer) {
  if (!buffer.defined() || max_buffers_ == 0) return;
  free_.push_back(std::move(buffer));
  if (free_.size() <= max_buffers_) return;
  free_.erase(std::min_element(free_.begin(), free_.end(),
                               [](const at::Tensor& a, const at::Tensor& b) { return a.numel() < b.numel(); }));
}

AllGatherResult ForeachAllGather(const std::vector<FSDPParam*>& params, const comm::ProcessGroupPtr& group,
                                 AllGatherBufferPool* pool) {
  at::NoGradGuard no_grad;
  AllGatherResult result;
  result.world_size = group ? group->size() : 1;  // no group: DDP, nothing to gather
  std::vector<at::Tensor> inputs;
  int64_t total = 0;
  for (FSDPParam* p : params) {
    inputs.push_back(AsBytes(p->AllGatherInput()));
    result.input_bytes.push_back(inputs.back().numel());
    total += inputs.back().numel();
  }
  const auto options = params.front()->sharded_param_data().options().dtype(at::kByte);
  const int64_t bytes = result.world_size * total;
  result.pool = pool;
  result.buffer = pool ? pool->Take(bytes, options) : at::empty({bytes}, options);
  result.output = result.buffer.narrow(0, 0, bytes);
  at::Tensor slot = result.output.narrow(0, (group ? group->rank() : 0) * total, total);
  // Copy-in (the all-gather input is a view into the output). On the CPU, one memcpy per
  // parameter: ATen's cat_out costs ~1 us of dispatch per input (bench/fsdp2 at 1 MiB).
  if (slot.is_cpu()) {
    auto* dst = static_cast<uint8_t*>(slot.data_ptr());
    for (const at::Tensor& in : inputs) {
      std::memcpy(dst, in.data_ptr(), static_cast<size_t>(in.numel()));
      dst += in.numel();
    }
  } else {
    at::cat_out(slot, inputs, 0);
  }
  result.work = group ? group->all_gather_into_tensor(result.output, slot)
                      : comm::MakeCompletedWork("copy (no shard group)");
  return result;
}

void ForeachAllGatherCopyOut(AllGatherResult& result, const std::vector<FSDPParam*>& params) {
  at::NoGradGuard no_grad;
  result.work->wait();
  const int64_t world = result.world_size;
  std::vector<at::Tensor> outs;
  std::vector<std::pair<FSDPParam*, at::Tensor>> chunk_cats;
  for (FSDPParam* p : params) {
    const at::Tensor& output = p->InitAllGatherOutput(world);
    p->AllocAllGatherOutput();
    at::Tensor bytes = output.view(at::kByte).view({world, -1});
    if (p->shard_dim() != 0 && p->sharded_state() == ShardedState::kSharded) {
      bytes = at::empty_like(bytes);  // chunk-cat below into the unsharded layout
      chunk_cats.emplace_back(p, bytes);
    }
    outs.push_back(bytes);
  }
  if (result.output.is_cpu()) {  // W x P memcpys (see copy-in)
    const int64_t total = result.output.numel() / world;
    const auto* src = static_cast<const uint8_t*>(result.output.data_ptr());
    for (int64_t r = 0; r < world; ++r) {
      int64_t offset = r * total;
      for (size_t i = 0; i < outs.size(); ++i) {
        const int64_t n = result.input_bytes[i];
        std::memcpy(static_cast<uint8_t*>(outs[i].data_ptr()) + r * n, src + offset, static_cast<size_t>(n));
        offset += n;
      }
    }
  } else {
    at::split_with_sizes_copy_out(outs, result.output.view({world, -1}), result.input_bytes, 1);
  }
  for (auto& [p, bytes] : chunk_cats) {
    const at::Tensor& output = p->all_gather_output();
    std::vector<int64_t> gathered = p->layout().padded_sharded_size;
    gathered[0] *= world;
    const auto chunks = bytes.view(output.scalar_type()).view(gathered).chunk(world, 0);
    std::vector<int64_t> unsharded = p->layout().padded_sharded_size;
    unsharded[p->shard_dim()] *= world;
    at::Tensor cat_out = output.view(unsharded);
    at::cat_out(cat_out, chunks, p->shard_dim());
  }
  result.output = at::Tensor();
  if (result.pool) result.pool->Give(std::move(result.buffer));
  result.buffer = at::Tensor();  // freed unless the pool keeps it
}

GradientDivideFactors GetGradientDivideFactors(int64_t reduce_scatter_size, int64_t all_reduce_size,
                                               c10::ScalarType reduce_dtype,
                                               std::optional<double> factor) {
  const bool overflow_risk = reduce_dtype != at::kFloat && reduce_dtype != at::kBFloat16;
  const int64_t data_parallel_size = reduce_scatter_size * all_reduce_size;
  if (!overflow_risk) {
    if (!factor) {
      if (data_parallel_size == 1) return {std::nullopt, std::nullopt, comm::ReduceOp::Sum(), comm::ReduceOp::Sum()};
      return {std::nullopt, std::nullopt, comm::ReduceOp::Avg(), comm::ReduceOp::Avg()};
    }
    const comm::ReduceOp rs = *factor == static_cast<double>(reduce_scatter_size)
                                  ? comm::ReduceOp::Avg()
                                  : comm::ReduceOp::PremulSum(1.0 / *factor);
    return {std::nullopt, std::nullopt, rs, comm::ReduceOp::Sum()};
  }
  const double f = factor.value_or(static_cast<double>(data_parallel_size));
  // Divide by about sqrt(f) before and the rest after, so that neither the summands nor
  // the sum leave f16's range (the seed's pre/post divide).
  const double pre = GradientPredivideFactor(f);
  return {pre, f / pre, comm::ReduceOp::Sum(), comm::ReduceOp::Sum()};
}

void ForeachReduce(const std::vector<FSDPParam*>& params, std::vector<at::Tensor> grads,
                   const ReduceOptions& options, at::Tensor* partial_reduce_output) {
  at::NoGradGuard no_grad;
  std::set<c10::ScalarType> dtypes;
  for (const auto& g : grads) dtypes.insert(g.scalar_type());
  if (dtypes.size() != 1) {
    std::vector<std::string> names;
    for (auto d : dtypes) names.push_back(c10::toString(d));
    TORCH_CHECK(false, "FSDP reduce-scatter expects uniform gradient dtype but got {",
                absl::StrJoin(names, ", "), "}");
  }
  const c10::ScalarType reduce_dtype = options.reduce_dtype.value_or(*dtypes.begin());
  const int64_t world = options.reduce_scatter_group ? options.reduce_scatter_group->size() : 1;
  const int64_t replicas = options.all_reduce_group ? options.all_reduce_group->size() : 1;
  const GradientDivideFactors f =
      GetGradientDivideFactors(world, replicas, reduce_dtype, options.gradient_divide_factor);

  // Copy-in: row r of the [world, n] input holds every gradient's r-th dim-0 chunk, padded.
  std::vector<int64_t> padded_rows, padded_numels;
  int64_t total = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (params[i]->shard_dim() != 0) {  // even by construction: move the sharded dim to 0
      grads[i] = at::cat(grads[i].chunk(world, params[i]->shard_dim()), 0);
    }
    const int64_t rows = grads[i].size(0);
    padded_rows.push_back((rows + world - 1) / world * world);
    padded_numels.push_back(rows == 0 ? 0 : grads[i].numel() / rows * padded_rows.back());
    total += padded_numels.back();
  }
  const int64_t out_numel = total / world;
  at::Tensor input = at::empty({world, out_numel}, grads.front().options().dtype(reduce_dtype));
  int64_t offset = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    const int64_t n = padded_numels[i] / world;
    if (n == 0) continue;
    at::Tensor g = grads[i].to(reduce_dtype);
    if (padded_rows[i] > g.size(0)) {
      std::vector<int64_t> pad = g.sizes().vec();
      pad[0] = padded_rows[i] - g.size(0);
      g = at::cat({g, at::zeros(pad, g.options())}, 0);
    }
    input.narrow(1, offset, n).copy_(g.reshape({world, n}));
    offset += n;
  }
  grads.clear();  // the copies hold the data now
  if (f.pre) input.div_(*f.pre);
  at::Tensor output;
  if (options.reduce_scatter_group) {
    output = at::empty({out_numel}, input.options());
    options.reduce_scatter_group->reduce_scatter_tensor(output, input.view(-1), f.reduce_scatter_op)->wait();
  } else {
    output = input.view(-1);
  }
  if (options.all_reduce_group) {
    if (!options.all_reduce_grads) {  // HSDP accumulation: keep the partial sum only
      if (partial_reduce_output->defined()) {
        partial_reduce_output->add_(output);
      } else {
        *partial_reduce_output = output;
      }
      return;
    }
    if (partial_reduce_output->defined()) {
      output.add_(*partial_reduce_output);
      *partial_reduce_output = at::Tensor();
    }
    options.all_reduce_group->all_reduce(output, f.all_reduce_op)->wait();
  }
  if (f.post) output.div_(*f.post);
  if (output.scalar_type() != options.orig_dtype) output = output.to(options.orig_dtype);
  // View out: each parameter's sharded gradient is a view into the reduced buffer.
  offset = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    FSDPParam* p = params[i];
    // Aliases the reduced buffer without being an autograd view: optimizers detach_()
    // gradients in zero_grad, which views refuse.
    at::Tensor grad = at::empty({0}, output.options());
    grad.set_(output.storage(), output.storage_offset() + offset, p->sharded_size(),
              dtensor::ContiguousStride(p->sharded_size()));
    if (p->offload_to_cpu()) grad = grad.cpu();
    p->AccumulateShardedGrad(grad);
    offset += padded_numels[i] / world;
  }
}

}  // namespace fsdp::per_param
