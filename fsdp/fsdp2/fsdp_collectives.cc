#include "fsdp/fsdp2/fsdp_collectives.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/strings/str_join.h"
#include "fsdp/common/grad_divide.h"
#include "fsdp/common/storage.h"

namespace fsdp::fsdp2 {
AllGatherBufferPool::Buffer AllGatherBufferPool::Take(int64_t bytes, const at::TensorOptions& options) {
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->bytes.numel() >= bytes && it->bytes.device() == options.device() &&
        (best == free_.end() || it->bytes.numel() < best->bytes.numel())) {
      best = it;
    }
  }
  if (best == free_.end()) {
    if (!shells_.empty() && options.device().is_cpu() && !options.pinned_memory() && bytes < min_cpu_bytes_) {
      at::Tensor shell = std::move(shells_.back());
      shells_.pop_back();
      shell.unsafeGetTensorImpl()->set_sizes_contiguous({bytes});
      AllocStorage(shell);
      return {std::move(shell), nullptr};
    }
    return {EmptyBuffer({bytes}, options.dtype(at::kByte)), nullptr};
  }
  Buffer buffer = std::move(*best);
  free_.erase(best);
  return buffer;
}

void AllGatherBufferPool::Give(at::Tensor buffer, device::EventPtr ready) {
  if (!buffer.defined() || max_buffers_ == 0) return;
  if (buffer.is_cpu() && static_cast<int64_t>(buffer.nbytes()) < min_cpu_bytes_) {
    // Freed now. Its tensor and storage objects stay for the next Take when nothing can read
    // the memory any more: its last reader finished and nobody else holds the tensor or the
    // storage (then freeing in place is what dropping it would do).
    c10::StorageImpl* storage = buffer.storage().unsafeGetStorageImpl();
    if (shells_.size() < kMaxShells && (!ready || ready->Query()) && buffer.use_count() == 1 &&
        buffer.storage().use_count() == 1 && storage->allocator() == CpuBufferAllocator()) {
      FreeStorage(buffer);
      shells_.push_back(std::move(buffer));
    }
    return;
  }
  free_.push_back({std::move(buffer), std::move(ready)});
  if (free_.size() <= max_buffers_) return;
  free_.erase(std::min_element(free_.begin(), free_.end(),
                               [](const Buffer& a, const Buffer& b) { return a.bytes.numel() < b.bytes.numel(); }));
}

const CommStreams& ThreadInlineStreams() {
  thread_local const device::StreamPoolPtr pool = device::StreamPool::Create(c10::Device(c10::kCPU), {});
  thread_local const device::StreamPtr side = pool->NewStream("inline");
  thread_local const CommStreams streams{&pool->current(), side.get(), side.get(),
                                         side.get(),       side.get(), &pool->sequencer()};
  return streams;
}

AllGatherResult ForeachAllGather(const std::vector<FSDPParam*>& params, const comm::ProcessGroupPtr& group,
                                 AllGatherBufferPool* pool) {
  const CommStreams& s = ThreadInlineStreams();
  return ForeachAllGather(params, group, *s.all_gather_copy_in, *s.all_gather, *s.sequencer, pool);
}

AllGatherResult ForeachAllGather(const std::vector<FSDPParam*>& params, const comm::ProcessGroupPtr& group,
                                 device::Stream& copy_in_stream, device::Stream& all_gather_stream,
                                 device::CollectiveSequencer& sequencer, AllGatherBufferPool* pool) {
  at::NoGradGuard no_grad;
  AllGatherResult result;
  result.world_size = group ? group->size() : 1;  // no group: DDP, nothing to gather
  // Byte offsets from sizes alone, no per-parameter views: each input is packed whole, by
  // its bytes, so parameters of different dtypes share the collective.
  c10::SmallVector<at::Tensor, 4> inputs;  // moves into the copy-in task: no allocation of its own
  result.input_bytes.reserve(params.size());
  int64_t total = 0;
  for (FSDPParam* p : params) {
    at::Tensor input = p->AllGatherInput();
    if (!input.is_contiguous()) input = input.contiguous();
    result.input_bytes.push_back(static_cast<int64_t>(input.nbytes()));
    total += result.input_bytes.back();
    inputs.push_back(std::move(input));
  }
  const auto options = inputs.front().options().dtype(at::kByte);  // on the compute device
  const int64_t bytes = result.world_size * total;
  result.pool = pool;
  AllGatherBufferPool::Buffer buffer =
      pool ? pool->Take(bytes, options) : AllGatherBufferPool::Buffer{EmptyBuffer({bytes}, options), nullptr};
  // A reused buffer may still be read by the previous copy-out.
  if (buffer.ready) copy_in_stream.WaitEvent(buffer.ready);
  result.buffer = std::move(buffer.bytes);
  result.output = result.buffer.numel() == bytes ? result.buffer
                                                 : AliasStorage(result.buffer, result.buffer.storage_offset(), {bytes});
  at::Tensor slot =
      AliasStorage(result.output, result.output.storage_offset() + (group ? group->rank() : 0) * total, {total});
  // Copy-in (the all-gather input is a view into the output). On the CPU, one memcpy per
  // parameter: ATen's cat_out pays its dispatch once per input (docs/design/measured-choices.md).
  copy_in_stream.Launch([slot, inputs = std::move(inputs)]() mutable {
    if (slot.is_cpu()) {
      auto* dst = static_cast<uint8_t*>(slot.data_ptr());
      for (const at::Tensor& in : inputs) {
        const size_t n = in.nbytes();
        if (n == 0) continue;
        std::memcpy(dst, in.const_data_ptr(), n);
        dst += n;
      }
    } else {
      std::vector<at::Tensor> bytes;
      for (const at::Tensor& in : inputs) bytes.push_back(in.view(-1).view(at::kByte));
      at::cat_out(slot, bytes, 0);
    }
  });
  if (result.world_size > 1) {  // one rank gathers nothing (PyTorch skips it too)
    if (&all_gather_stream != &copy_in_stream) all_gather_stream.WaitStream(copy_in_stream);
    all_gather_stream.LaunchCollective(sequencer, [group, output = result.output, slot = std::move(slot)] {
      return group->all_gather_into_tensor(output, slot);
    });
    result.event = all_gather_stream.RecordEvent();
  } else {
    result.event = copy_in_stream.RecordEvent();
  }
  return result;
}

void ForeachAllGatherCopyOut(AllGatherResult& result, const std::vector<FSDPParam*>& params) {
  ForeachAllGatherCopyOut(result, params, *ThreadInlineStreams().current);
}

void ForeachAllGatherCopyOut(AllGatherResult& result, const std::vector<FSDPParam*>& params, device::Stream& current) {
  at::NoGradGuard no_grad;
  current.WaitEvent(result.event);
  const int64_t world = result.world_size;
  const bool cpu = result.output.is_cpu();
  // Per parameter, where its [world, input bytes] rows go: its all-gather output, or for a
  // dim > 0 shard a staging buffer chunk-concatenated below. On the CPU only the addresses
  // (W x P memcpys); elsewhere byte views for one split_with_sizes_copy_out.
  c10::SmallVector<uint8_t*, 16> destinations;  // inline up to 16 parameters: no allocation
  std::vector<at::Tensor> outs;
  std::vector<std::pair<FSDPParam*, at::Tensor>> chunk_cats;
  for (size_t i = 0; i < params.size(); ++i) {
    FSDPParam* p = params[i];
    const at::Tensor& output = p->InitAllGatherOutput(world);
    p->AllocAllGatherOutput();
    at::Tensor rows;
    if (p->shard_dim() != 0 && p->sharded_state() == ShardedState::kSharded) {
      rows = at::empty({world, result.input_bytes[i]}, output.options().dtype(at::kByte));
      chunk_cats.emplace_back(p, rows);
    } else if (!cpu) {
      rows = output.view(at::kByte).view({world, -1});
    }
    if (cpu) {
      destinations.push_back(static_cast<uint8_t*>(rows.defined() ? rows.data_ptr() : output.data_ptr()));
    } else {
      outs.push_back(std::move(rows));
    }
  }
  if (cpu) {
    const int64_t total = result.output.numel() / world;
    const auto* src = static_cast<const uint8_t*>(result.output.data_ptr());
    for (int64_t r = 0; r < world; ++r) {
      int64_t offset = r * total;
      for (size_t i = 0; i < destinations.size(); ++i) {
        const int64_t n = result.input_bytes[i];
        if (n > 0) std::memcpy(destinations[i] + r * n, src + offset, static_cast<size_t>(n));
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
  if (result.pool) result.pool->Give(std::move(result.buffer), current.RecordEvent());
  result.buffer = at::Tensor();  // freed unless the pool keeps it
}

GradientDivideFactors GetGradientDivideFactors(int64_t reduce_scatter_size, int64_t all_reduce_size,
                                               c10::ScalarType reduce_dtype, std::optional<double> factor,
                                               bool force_sum_reduction_for_comms) {
  const bool overflow_risk = reduce_dtype != at::kFloat && reduce_dtype != at::kBFloat16;
  const int64_t data_parallel_size = reduce_scatter_size * all_reduce_size;
  if (!overflow_risk && force_sum_reduction_for_comms) {  // SUM, then one post-divide
    return {std::nullopt, factor.value_or(static_cast<double>(data_parallel_size)), comm::ReduceOp::Sum(),
            comm::ReduceOp::Sum()};
  }
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
  // the sum leave f16's range (PyTorch's pre/post divide).
  const double pre = GradientPredivideFactor(f);
  return {pre, f / pre, comm::ReduceOp::Sum(), comm::ReduceOp::Sum()};
}

namespace {

// What the reduce's stream tasks share; the host fills in the plan and the tensors' metadata.
struct ReduceJob {
  std::vector<FSDPParam*> params;
  std::vector<at::Tensor> grads;
  // Per parameter (one array for all four): its rows and elements padded to a multiple
  // of the world size, the gradient tensor the reduced shard becomes, and the existing
  // gradient to add it into (undefined when adopted as the gradient itself).
  struct Slot {
    int64_t padded_rows = 0, padded_numel = 0;
    at::Tensor new_grad, accumulate_into;
  };
  c10::SmallVector<Slot, 4> slots;  // inline for up to 4 parameters (a Linear has 2)
  int64_t world = 1;
  c10::ScalarType reduce_dtype = at::kFloat;
  std::optional<GradientDivideFactors> factors;             // set before any task runs
  std::optional<double> local_scale;                        // one rank: the PremulSum factor, applied here
  at::Tensor input;                                         // [world * out_numel] (rows of out_numel), reduce dtype
  at::Tensor output;                                        // [out_numel], reduce dtype
  at::Tensor result;                                        // [out_numel], orig dtype: what the gradients alias
  std::vector<std::pair<at::Tensor, at::Tensor>> offloads;  // (device shard, its CPU copy)
};

// Copies a contiguous dim-0-sharded gradient of the reduce dtype on the CPU into its
// columns [offset, offset + n) of every row of the [world, row] input: row r gets the
// gradient's elements [r * n, (r + 1) * n), zeros past its end (the padding). W memcpys,
// no views.
void CopyInRowsOnCpu(const at::Tensor& grad, at::Tensor& input, int64_t world, int64_t offset, int64_t n) {
  const auto item = static_cast<int64_t>(input.element_size());
  const int64_t row_bytes = input.numel() / world * item;
  const int64_t chunk = n * item;
  const int64_t grad_bytes = static_cast<int64_t>(grad.nbytes());
  const auto* src = static_cast<const uint8_t*>(grad.data_ptr());
  auto* dst = static_cast<uint8_t*>(input.data_ptr()) + offset * item;
  for (int64_t r = 0; r < world; ++r, dst += row_bytes) {
    const int64_t begin = r * chunk;
    const int64_t have = std::clamp<int64_t>(grad_bytes - begin, 0, chunk);
    if (have > 0) std::memcpy(dst, src + begin, static_cast<size_t>(have));
    if (have < chunk) std::memset(dst + have, 0, static_cast<size_t>(chunk - have));
  }
}

// Row r of the [world, n] input (held flat) holds every gradient's r-th dim-0 chunk, padded.
void ReduceScatterCopyIn(ReduceJob& job) {
  const int64_t world = job.world;
  int64_t offset = 0;
  for (size_t i = 0; i < job.grads.size(); ++i) {
    const int64_t n = job.slots[i].padded_numel / world;
    if (n == 0) continue;
    at::Tensor g = job.grads[i];
    if (g.is_cpu() && job.input.is_cpu() && job.params[i]->shard_dim() == 0 && g.scalar_type() == job.reduce_dtype &&
        g.is_contiguous()) {
      CopyInRowsOnCpu(g, job.input, world, offset, n);
      offset += n;
      continue;
    }
    if (job.params[i]->shard_dim() != 0) {  // even by construction: move the sharded dim to 0
      g = at::cat(g.chunk(world, job.params[i]->shard_dim()), 0);
    }
    g = g.to(job.reduce_dtype);
    if (job.slots[i].padded_rows > g.size(0)) {
      std::vector<int64_t> pad = g.sizes().vec();
      pad[0] = job.slots[i].padded_rows - g.size(0);
      g = at::cat({g, at::zeros(pad, g.options())}, 0);
    }
    job.input.view({world, -1}).narrow(1, offset, n).copy_(g.reshape({world, n}));
    offset += n;
  }
  job.grads.clear();  // the copy holds the data now
  if (job.factors->pre) DivideInPlace(job.input, *job.factors->pre);
}

void PostReduce(ReduceJob& job) {
  if (job.local_scale) job.output.mul_(*job.local_scale);
  if (job.factors->post) DivideInPlace(job.output, *job.factors->post);
  if (!job.result.is_same(job.output)) job.result.copy_(job.output);
  // From pinned memory the copy is asynchronous: the host reads it after PyTorch's
  // grad_offload_event (FSDPParamGroup::WaitForPostBackward synchronizes the event).
  for (auto& [device_grad, cpu_grad] : job.offloads) {
    cpu_grad.copy_(device_grad, /*non_blocking=*/cpu_grad.is_pinned());
  }
  for (const ReduceJob::Slot& slot : job.slots) {
    if (slot.accumulate_into.defined()) slot.accumulate_into.add_(slot.new_grad);
  }
}

}  // namespace

ReduceEvents ForeachReduce(std::vector<FSDPParam*> params_in, std::vector<at::Tensor> grads,
                           const ReduceOptions& options, at::Tensor* partial_reduce_output,
                           const CommStreams& streams) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(!grads.empty(), "FSDP reduce-scatter got no gradients");
  if (std::any_of(grads.begin(), grads.end(),
                  [&](const at::Tensor& g) { return g.scalar_type() != grads[0].scalar_type(); })) {
    std::set<c10::ScalarType> dtypes;
    for (const auto& g : grads) dtypes.insert(g.scalar_type());
    std::vector<std::string> names;
    for (auto d : dtypes) names.push_back(c10::toString(d));
    TORCH_CHECK(false, "FSDP reduce-scatter expects uniform gradient dtype but got {", absl::StrJoin(names, ", "), "}");
  }
  auto job = std::make_shared<ReduceJob>();
  job->params = std::move(params_in);  // both vectors move into the job: no copy per step
  const std::vector<FSDPParam*>& params = job->params;
  // Unset: the original dtype (PyTorch 2.15's _get_reduce_dtype over unsharded_grad_dtype),
  // so bf16 gradients of fp32 parameters are summed in fp32.
  job->reduce_dtype = options.reduce_dtype.value_or(options.orig_dtype);
  job->world = options.reduce_scatter_group ? options.reduce_scatter_group->size() : 1;
  const int64_t world = job->world;
  const int64_t replicas = options.all_reduce_group ? options.all_reduce_group->size() : 1;
  // One rank reduce-scatters nothing: no collective (PyTorch's foreach_reduce copies the
  // input and applies the divide factor). PyTorch 2.15 does all-reduce over a 1-rank
  // replicate group (HSDP 1 x N), and so do we: the golden corpus counts it.
  const bool scatter = world > 1;
  job->factors = GetGradientDivideFactors(world, replicas, job->reduce_dtype, options.gradient_divide_factor,
                                          options.force_sum_reduction_for_comms);

  // The plan from shapes alone (the data may still be in flight on the compute stream).
  job->slots.resize(grads.size());
  int64_t total = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    // A dim > 0 shard moves to dim 0: world chunks stacked along the rows.
    const int64_t rows = params[i]->shard_dim() != 0 ? g.size(0) * world : g.size(0);
    ReduceJob::Slot& slot = job->slots[i];
    slot.padded_rows = (rows + world - 1) / world * world;
    slot.padded_numel = rows == 0 ? 0 : g.numel() / rows * slot.padded_rows;
    total += slot.padded_numel;
  }
  const int64_t out_numel = total / world;
  const at::TensorOptions reduce_options = grads.front().options().dtype(job->reduce_dtype);
  job->grads = std::move(grads);
  job->input = EmptyBuffer({world * out_numel}, reduce_options);
  job->output = scatter ? EmptyBuffer({out_numel}, reduce_options) : job->input;
  if (!scatter && job->factors->reduce_scatter_op.kind() == comm::ReduceOpKind::kPremulSum) {
    job->local_scale = job->factors->reduce_scatter_op.factor();  // what the collective would apply
  }

  device::Stream& rs = *streams.reduce_scatter;
  rs.WaitStream(*streams.current);  // the gradients come from the compute stream
  rs.Launch([job] { ReduceScatterCopyIn(*job); });
  if (scatter) {
    rs.LaunchCollective(*streams.sequencer, [job, group = options.reduce_scatter_group] {
      return group->reduce_scatter_tensor(job->output, job->input, job->factors->reduce_scatter_op);
    });
  }
  ReduceEvents events;
  events.reduce_scatter = rs.RecordEvent();
  device::Stream* post = &rs;
  if (options.all_reduce_group) {
    device::Stream& ar = *streams.all_reduce;
    ar.WaitEvent(events.reduce_scatter);
    post = &ar;
    if (!options.all_reduce_grads) {  // HSDP accumulation: keep the partial sum only
      if (partial_reduce_output->defined()) {
        ar.Launch([job, partial = *partial_reduce_output]() mutable { partial.add_(job->output); });
      } else {
        *partial_reduce_output = job->output;
      }
      events.post_reduce = ar.RecordEvent();
      return events;
    }
    if (partial_reduce_output->defined()) {
      ar.Launch([job, partial = *partial_reduce_output] { job->output.add_(partial); });
      *partial_reduce_output = at::Tensor();
    }
    ar.LaunchCollective(*streams.sequencer, [job, group = options.all_reduce_group, op = job->factors->all_reduce_op] {
      return group->all_reduce(job->output, op);
    });
  }
  if (options.all_reduce_hook) {
    // PyTorch runs the hook on the all-reduce stream after the reduce-scatter stream (with
    // HSDP the all-reduce stream already follows it and holds the all-reduce).
    device::Stream& ar = *streams.all_reduce;
    if (post != &ar) ar.WaitEvent(events.reduce_scatter);
    post = &ar;
    ar.Launch([job, hook = options.all_reduce_hook] { hook(job->output); });
  }
  // View out, on the host: each parameter's sharded gradient aliases the reduced buffer
  // now; the post-reduce task fills it.
  job->result = job->output.scalar_type() == options.orig_dtype
                    ? job->output
                    : at::empty({out_numel}, job->output.options().dtype(options.orig_dtype));
  int64_t offset = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    FSDPParam* p = params[i];
    // Aliases the reduced buffer without being an autograd view: optimizers detach_()
    // gradients in zero_grad, which views refuse.
    at::Tensor grad = AliasStorage(job->result, job->result.storage_offset() + offset, p->sharded_size());
    if (p->offload_to_cpu() && !grad.is_cpu()) {
      at::Tensor cpu_grad =
          at::empty(p->sharded_size(), grad.options().device(at::kCPU).pinned_memory(p->pin_memory()));
      job->offloads.emplace_back(grad, cpu_grad);
      grad = cpu_grad;
    }
    job->slots[i].new_grad = grad;
    job->slots[i].accumulate_into = p->AdoptShardedGrad(grad);
    offset += job->slots[i].padded_numel / world;
  }
  post->Launch([job = std::move(job)] { PostReduce(*job); });  // its last use on the host
  events.post_reduce = post->RecordEvent();
  return events;
}

}  // namespace fsdp::fsdp2
