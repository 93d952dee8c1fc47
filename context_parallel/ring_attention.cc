#include "context_parallel/ring_attention.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace fsdp::context_parallel {
namespace {

using torch::autograd::variable_list;

constexpr int64_t kSeqDim = 2;

// PyTorch's _CausalBehavior for key / value block i on `rank`.
enum class Block { kSkip, kFull, kCausal };

Block BlockBehavior(int rank, int world, int i, bool is_causal, bool load_balanced) {
  if (!is_causal) return Block::kFull;
  if (i == 0) return Block::kCausal;
  const int source = ((rank - i) % world + world) % world;
  return source < rank || load_balanced ? Block::kFull : Block::kSkip;
}

// Which part of step i's block attends with load balancing (head-tail chunks): all of it at
// step 0; then the earlier half of the key / value block from a rank before this one, or the
// later half of this rank's queries against a block from a rank after it.
enum class Part { kWhole, kEarlierKeys, kLaterQueries };

Part BlockPart(int rank, int i, bool is_causal, bool load_balanced) {
  if (i == 0 || !load_balanced || !is_causal) return Part::kWhole;
  return i <= rank ? Part::kEarlierKeys : Part::kLaterQueries;
}

// `t.narrow(dim, start, length)` without the dispatcher, for tensors made below autograd
// (which carry no view metadata either way): narrow goes through narrow, slice and
// as_strided, three dispatches that cost more than the rest of a merge
// (docs/design/measured-choices.md, "Ring attention below autograd").
at::Tensor Narrow(const at::Tensor& t, int64_t dim, int64_t start, int64_t length) {
  TORCH_INTERNAL_ASSERT(t.layout() == at::kStrided && start >= 0 && start + length <= t.size(dim));
  auto view =
      c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(t.storage()), t.key_set(), t.dtype());
  c10::SmallVector<int64_t, 5> sizes(t.sizes().begin(), t.sizes().end());
  sizes[dim] = length;
  view->set_sizes_and_strides(sizes, t.strides(), t.storage_offset() + start * t.stride(dim));
  return at::Tensor(std::move(view));
}

// chunk `half` (0 or 1) of two along the sequence.
at::Tensor Half(const at::Tensor& t, int half) {
  const int64_t length = t.size(kSeqDim) / 2;
  return Narrow(t, kSeqDim, half * length, length);
}

// Passes [k; v] buffers (k and v concatenated on dim 0) round the ring: step i's buffer is
// rank (rank - i)'s. PyTorch's _AllGatherRotater (one all-gather, then chunks) and
// _AllToAllRotater (permute_tensor to the next rank: an all_to_all_single whose only non-empty
// piece goes to rank + 1).
class Rotater {
 public:
  Rotater(comm::ProcessGroupPtr group, RotateMethod method) : group_(std::move(group)), method_(method) {}

  void Exchange(const at::Tensor& buffer) {
    ++steps_;
    const int world = group_->size(), rank = group_->rank();
    if (method_ == RotateMethod::kAllGather) {
      if (gathered_.defined()) return;  // one all-gather serves every step
      std::vector<int64_t> sizes = buffer.sizes().vec();
      sizes[0] *= world;
      gathered_ = at::empty(sizes, buffer.options());
      work_ = group_->all_gather_into_tensor(gathered_, buffer);
      return;
    }
    std::vector<int64_t> in_splits(world, 0), out_splits(world, 0);
    in_splits[(rank + 1) % world] = buffer.size(0);
    out_splits[(rank - 1 + world) % world] = buffer.size(0);
    received_ = at::empty_like(buffer);
    work_ = group_->all_to_all_single(received_, buffer, out_splits, in_splits);
  }

  at::Tensor Next() {
    if (work_) {
      work_->wait();
      work_.reset();
    }
    if (method_ == RotateMethod::kAllToAll) return received_;
    const int world = group_->size();
    const int source = ((group_->rank() - steps_) % world + world) % world;
    const int64_t rows = gathered_.size(0) / world;
    return Narrow(gathered_, 0, source * rows, rows);
  }

 private:
  comm::ProcessGroupPtr group_;
  RotateMethod method_;
  int steps_ = 0;
  at::Tensor gathered_, received_;
  comm::WorkPtr work_;
};

// `t` in `dtype`, without a dispatcher round trip when it already is.
at::Tensor Cast(const at::Tensor& t, c10::ScalarType dtype) { return t.scalar_type() == dtype ? t : t.to(dtype); }

// PyTorch's stable merge (github.com/zhuzilin/ring-flash-attention/pull/34), in one pass:
//   running_out = running_out - sigmoid(lse - running_lse) * (running_out - out), a lerp towards
//   out by that sigmoid, and running_lse = running_lse - log_sigmoid(running_lse - lse), which
//   is logaddexp(running_lse, lse);
// out [batch, heads, seq, dim] and lse [batch, heads, seq] with any strides, arithmetic in lse's
// type as ATen's lerp / logaddexp. Five ATen kernels on blocks this size cost more in dispatch
// than in arithmetic (docs/design/measured-choices.md, "Ring attention below autograd").
template <typename scalar_t>
void MergeBlock(const at::Tensor& running_out, const at::Tensor& running_lse, const at::Tensor& out,
                const at::Tensor& lse) {
  using acc_t = at::opmath_type<scalar_t>;
  TORCH_INTERNAL_ASSERT(running_out.sizes() == out.sizes() && running_lse.sizes() == lse.sizes() &&
                        lse.scalar_type() == c10::CppTypeToScalarType<acc_t>::value &&
                        running_lse.scalar_type() == lse.scalar_type());
  scalar_t* const ro = running_out.mutable_data_ptr<scalar_t>();
  const scalar_t* const o = out.const_data_ptr<scalar_t>();
  acc_t* const rl = running_lse.mutable_data_ptr<acc_t>();
  const acc_t* const l = lse.const_data_ptr<acc_t>();
  const auto ros = running_out.strides(), os = out.strides(), rls = running_lse.strides(), ls = lse.strides();
  for (int64_t b = 0; b < out.size(0); ++b) {
    for (int64_t h = 0; h < out.size(1); ++h) {
      for (int64_t q = 0; q < out.size(2); ++q) {
        acc_t& running = rl[b * rls[0] + h * rls[1] + q * rls[2]];
        const acc_t block = l[b * ls[0] + h * ls[1] + q * ls[2]];
        const acc_t weight = acc_t(1) / (acc_t(1) + std::exp(running - block));  // sigmoid(block - running)
        scalar_t* const row = ro + b * ros[0] + h * ros[1] + q * ros[2];
        const scalar_t* const block_row = o + b * os[0] + h * os[1] + q * os[2];
        for (int64_t d = 0; d < out.size(3); ++d) {
          const acc_t self = row[d * ros[3]], end = block_row[d * os[3]], diff = end - self;
          row[d * ros[3]] = std::abs(weight) < acc_t(0.5) ? self + weight * diff : end - diff * (acc_t(1) - weight);
        }
        running = std::isinf(running) && running == block
                      ? running
                      : std::max(running, block) + std::log1p(std::exp(-std::abs(running - block)));
      }
    }
  }
}

// MergeBlock's formula as ATen kernels, for tensors on a device (PyTorch's own expressions:
// the weight and the difference in lse's float32, the result cast to the running output's type).
void MergeBlockOnDevice(const at::Tensor& running_out, const at::Tensor& running_lse, const at::Tensor& out,
                        const at::Tensor& lse) {
  const at::Tensor weight = at::sigmoid(lse - running_lse).unsqueeze(-1);
  running_out.copy_(running_out - weight * (running_out - out));
  running_lse.copy_(at::logaddexp(running_lse, lse));
}

// out / lse of one block merged into the running result (PyTorch's _SDPAMerger), on the
// later half of the queries when `partial`. The running tensors are the first block's kernel
// outputs, updated in place: no copy of the other half.
class Merger {
 public:
  explicit Merger(bool convert_to_f32) : convert_to_f32_(convert_to_f32) {}

  void Step(at::Tensor out, at::Tensor lse, bool partial) {
    out_dtype_ = out.scalar_type();
    lse_dtype_ = lse.scalar_type();
    if (convert_to_f32_) {
      out = Cast(out, at::kFloat);
      lse = Cast(lse, at::kFloat);
    }
    if (!lse_.defined()) {
      out_ = out;
      lse_ = lse;
      return;
    }
    const at::Tensor running_out = partial ? Half(out_, 1) : out_, running_lse = partial ? Half(lse_, 1) : lse_;
    if (!out.device().is_cpu()) {
      MergeBlockOnDevice(running_out, running_lse, out, lse);
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "RingAttention merge",
                                    [&] { MergeBlock<scalar_t>(running_out, running_lse, out, lse); });
  }

  std::pair<at::Tensor, at::Tensor> Results() const {
    TORCH_INTERNAL_ASSERT(out_.defined(), "RingAttention: no block attended");
    return {Cast(out_, out_dtype_), Cast(lse_, lse_dtype_)};
  }

 private:
  bool convert_to_f32_;
  at::Tensor out_, lse_;
  c10::ScalarType out_dtype_ = at::kFloat, lse_dtype_ = at::kFloat;
};

// The attention kernel of one block, and its backward, as PyTorch's ring runs the SDPA kernel
// the dispatcher picked for the inputs: on the CPU the flash kernel; on CUDA the flash kernel
// for float16 / bfloat16 and the memory-efficient one for float32 (what SDPA picks for those
// dtypes; flash has no float32 kernel).
enum class Kernel { kCpuFlash, kCudaFlash, kCudaEfficient };

Kernel KernelFor(const at::Tensor& q) {
  if (q.device().is_cpu()) return Kernel::kCpuFlash;
  return q.scalar_type() == at::kFloat ? Kernel::kCudaEfficient : Kernel::kCudaFlash;
}

// The memory-efficient kernel's log-sum-exp rows are padded to a multiple of 32 (kAlignLSE in
// aten/src/ATen/native/transformers/cuda/attention.cu); its backward reads them padded.
constexpr int64_t kEfficientLseAlignment = 32;

// k / v with q's heads, and gradients summed back over each group: the memory-efficient kernel
// takes no grouped-query inputs (the flash kernels do).
at::Tensor RepeatHeads(const at::Tensor& t, int64_t heads) {
  return t.size(1) == heads ? t : t.repeat_interleave(heads / t.size(1), 1);
}

at::Tensor SumHeadGroups(const at::Tensor& t, int64_t kv_heads) {
  if (t.size(1) == kv_heads) return t;
  return t.reshape({t.size(0), kv_heads, t.size(1) / kv_heads, t.size(2), t.size(3)}).sum(2);
}

// out [batch, heads, q_len, dim] and its log-sum-exp [batch, heads, q_len] (float32).
std::pair<at::Tensor, at::Tensor> BlockForward(Kernel kernel, const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, bool causal, std::optional<double> scale) {
  switch (kernel) {
    case Kernel::kCpuFlash: {
      auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, std::nullopt, scale);
      return {out, lse};
    }
    case Kernel::kCudaFlash: {
      auto r = at::_scaled_dot_product_flash_attention(q, k, v, 0.0, causal, /*return_debug_mask=*/false, scale);
      return {std::get<0>(r), std::get<1>(r)};
    }
    case Kernel::kCudaEfficient: {
      const int64_t heads = q.size(1);
      auto r =
          at::_scaled_dot_product_efficient_attention(q, RepeatHeads(k, heads), RepeatHeads(v, heads), std::nullopt,
                                                      /*compute_log_sumexp=*/true, 0.0, causal, scale);
      return {std::get<0>(r), Narrow(std::get<1>(r), 2, 0, q.size(kSeqDim))};
    }
  }
  TORCH_INTERNAL_ASSERT(false, "RingAttention: unknown kernel");
}

// The gradients of q, k, v (k's and v's with their own heads).
std::tuple<at::Tensor, at::Tensor, at::Tensor> BlockBackward(Kernel kernel, const at::Tensor& dout, const at::Tensor& q,
                                                             const at::Tensor& k, const at::Tensor& v,
                                                             const at::Tensor& out, const at::Tensor& lse, bool causal,
                                                             std::optional<double> scale) {
  switch (kernel) {
    case Kernel::kCpuFlash:
      return at::_scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                      std::nullopt, scale);
    case Kernel::kCudaFlash: {
      // Dense inputs (no cumulative sequence lengths); the Philox seed and offset are read
      // only with dropout, which the ring does not run.
      const at::Tensor unused = at::empty({}, at::kLong);
      return at::_scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, at::Tensor(), at::Tensor(),
                                                              q.size(kSeqDim), k.size(kSeqDim), 0.0, causal, unused,
                                                              unused, scale);
    }
    case Kernel::kCudaEfficient: {
      const int64_t rows = q.size(kSeqDim);
      const int64_t padded = (rows + kEfficientLseAlignment - 1) / kEfficientLseAlignment * kEfficientLseAlignment;
      at::Tensor padded_lse = at::zeros({lse.size(0), lse.size(1), padded}, lse.options());
      padded_lse.narrow(2, 0, rows).copy_(lse);
      const at::Tensor unused = at::empty({}, at::kLong);
      const int64_t heads = q.size(1);
      auto [dq, dk, dv, dbias] = at::_scaled_dot_product_efficient_attention_backward(
          dout, q, RepeatHeads(k, heads), RepeatHeads(v, heads), at::Tensor(), out, padded_lse, unused, unused, 0.0,
          {true, true, true, false}, causal, scale);
      return {dq, SumHeadGroups(dk, k.size(1)), SumHeadGroups(dv, k.size(1))};
    }
  }
  TORCH_INTERNAL_ASSERT(false, "RingAttention: unknown kernel");
}

// The k / v halves of a [k; v] buffer (k and v have the same shape).
std::pair<at::Tensor, at::Tensor> SplitKv(const at::Tensor& buffer) {
  const int64_t batch = buffer.size(0) / 2;
  return {Narrow(buffer, 0, 0, batch), Narrow(buffer, 0, batch, batch)};
}

at::Tensor JoinKv(const at::Tensor& k, const at::Tensor& v) { return at::cat({k, v}); }

struct RingState : torch::CustomClassHolder {
  comm::ProcessGroupPtr group;
  RingAttentionOptions options;
  bool is_causal = false;
};

std::pair<at::Tensor, at::Tensor> RingForward(const at::Tensor& query, at::Tensor key, at::Tensor value,
                                              const RingState& s) {
  const int rank = s.group->rank(), world = s.group->size();
  const bool balanced = s.options.load_balanced;
  key = key.contiguous();
  value = value.contiguous();
  Rotater rotater(s.group, s.options.rotate_method);
  Merger merger(s.options.convert_to_f32);
  const Kernel kernel = KernelFor(query);
  for (int i = 0; i < world; ++i) {
    at::Tensor kv;  // a received [k; v] buffer passes on as it is
    if (i > 0) std::tie(key, value) = SplitKv(kv = rotater.Next());
    if (i < world - 1) rotater.Exchange(i == 0 ? JoinKv(key, value) : kv);
    const Block block = BlockBehavior(rank, world, i, s.is_causal, balanced);
    if (block == Block::kSkip) continue;
    const Part part = BlockPart(rank, i, s.is_causal, balanced);
    const at::Tensor q = part == Part::kLaterQueries ? Half(query, 1) : query;
    const at::Tensor k = part == Part::kEarlierKeys ? Half(key, 0) : key;
    const at::Tensor v = part == Part::kEarlierKeys ? Half(value, 0) : value;
    const bool partial = part == Part::kLaterQueries;
    auto [out, lse] = BlockForward(kernel, q, k, v, block == Block::kCausal, s.options.scale);
    merger.Step(out, lse, partial);
  }
  return merger.Results();
}

// The gradients accumulate in place: grad_query in the first block's kernel output, the key /
// value gradients in the [grad_key; grad_value] buffer each step receives (this rank's from the
// previous one), which passes on as it is.
std::vector<at::Tensor> RingBackward(const at::Tensor& grad_out, const at::Tensor& query, at::Tensor key,
                                     at::Tensor value, const at::Tensor& out, const at::Tensor& lse,
                                     const RingState& s) {
  const int rank = s.group->rank(), world = s.group->size();
  const bool balanced = s.options.load_balanced;
  const c10::ScalarType accum = s.options.convert_to_f32 ? at::kFloat : query.scalar_type();
  key = key.contiguous();
  value = value.contiguous();
  at::Tensor grad_query, grad_kv;  // grad_kv: [grad_key; grad_value]
  Rotater kv_rotater(s.group, s.options.rotate_method);
  Rotater dkv_rotater(s.group, RotateMethod::kAllToAll);  // PyTorch passes gradients this way always
  const Kernel kernel = KernelFor(query);
  for (int i = 0; i < world; ++i) {
    at::Tensor kv;
    if (i > 0) std::tie(key, value) = SplitKv(kv = kv_rotater.Next());
    if (i != world - 1) kv_rotater.Exchange(i == 0 ? JoinKv(key, value) : kv);
    const Block block = BlockBehavior(rank, world, i, s.is_causal, balanced);
    at::Tensor block_grad_query, block_grad_key, block_grad_value;
    if (block != Block::kSkip) {
      const Part part = BlockPart(rank, i, s.is_causal, balanced);
      const bool later = part == Part::kLaterQueries, earlier = part == Part::kEarlierKeys;
      const at::Tensor q = later ? Half(query, 1) : query, o = later ? Half(out, 1) : out;
      const at::Tensor dout = later ? Half(grad_out, 1) : grad_out, l = later ? Half(lse, 1).contiguous() : lse;
      const at::Tensor k = earlier ? Half(key, 0) : key, v = earlier ? Half(value, 0) : value;
      std::tie(block_grad_query, block_grad_key, block_grad_value) =
          BlockBackward(kernel, dout, q, k, v, o, l, block == Block::kCausal, s.options.scale);
    }
    if (i == 0) {  // block 0 is this rank's own, always attended
      grad_query = Cast(block_grad_query, accum);
      grad_kv = Cast(JoinKv(block_grad_key, block_grad_value), accum);
    } else {
      grad_kv = dkv_rotater.Next();
      const auto [grad_key, grad_value] = SplitKv(grad_kv);
      if (block != Block::kSkip) {
        const bool earlier_keys = i <= rank && balanced;
        (earlier_keys ? Half(grad_key, 0) : grad_key).add_(block_grad_key);
        (earlier_keys ? Half(grad_value, 0) : grad_value).add_(block_grad_value);
        (i <= rank || !balanced ? grad_query : Half(grad_query, 1)).add_(block_grad_query);
      }
    }
    dkv_rotater.Exchange(grad_kv);
  }
  const auto [gk, gv] = SplitKv(Cast(dkv_rotater.Next(), key.scalar_type()));
  return {Cast(grad_query, query.scalar_type()), gk, gv};
}

// The backward node, written as ATen's generated ones (a `torch::autograd::Function` costs
// more per call: docs/design/measured-choices.md, "Ring attention below autograd").
struct RingAttentionBackward : torch::autograd::Node {
  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(!released, "RingAttention: backward through the graph a second time needs retain_graph=True");
    const at::Tensor q = query.unpack(), k = key.unpack(), v = value.unpack();
    const at::Tensor o = out.unpack(getptr()), l = lse.unpack();
    const at::Tensor grad_out = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(o);
    variable_list result = [&] {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      return RingBackward(grad_out, q, k, v, o, l, *state);
    }();
    if (at::GradMode::is_enabled()) {
      // create_graph: the gradients are right, but a backward through them is an error (as
      // through ATen's flash backward kernel), not a silent zero.
      auto error = c10::make_intrusive<torch::autograd::NotImplemented>(
          "RingAttentionBackward", torch::autograd::collect_next_edges(grads[0], q, k, v));
      torch::autograd::set_history(result, error);
    }
    return result;
  }
  std::string name() const override { return "RingAttentionBackward"; }
  void release_variables() override {
    query.reset_data();
    key.reset_data();
    value.reset_data();
    out.reset_data();
    lse.reset_data();
    released = true;
  }

  torch::autograd::SavedVariable query, key, value, out, lse;
  c10::intrusive_ptr<RingState> state;
  bool released = false;
};

}  // namespace

at::Tensor RingAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                         const comm::ProcessGroupPtr& group, const RingAttentionOptions& options) {
  TORCH_CHECK(group != nullptr, "RingAttention: group is null");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "RingAttention: q, k, v must be 4-D [batch, heads, seq, "
              "head_dim], got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "RingAttention: k ", k.sizes(), " and v ", v.sizes(), " differ");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "RingAttention: q ", q.sizes(), " and k ", k.sizes(),
              " need the same batch and head_dim and q's heads a multiple of k's");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() && q.device() == k.device() &&
                  q.device() == v.device(),
              "RingAttention: q, k, v must share dtype and device");
  TORCH_CHECK(q.device().is_cpu() || q.device().is_cuda(),
              "RingAttention: q, k, v must be on the CPU or a CUDA device (the ring runs ATen's SDPA kernels there), "
              "got ",
              q.device());
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), "RingAttention: q, k, v must be floating point, got ",
              q.scalar_type());
  TORCH_CHECK(q.device().is_cpu() || q.scalar_type() == at::kFloat || q.scalar_type() == at::kHalf ||
                  q.scalar_type() == at::kBFloat16,
              "RingAttention: on CUDA q, k, v must be float16 or bfloat16 (the flash kernel) or float32 (the "
              "memory-efficient kernel), got ",
              q.scalar_type());
  TORCH_CHECK(!is_causal || q.size(kSeqDim) == k.size(kSeqDim),
              "RingAttention: is_causal requires the same query and context sequence lengths, got ", q.size(kSeqDim),
              " and ", k.size(kSeqDim));
  TORCH_CHECK(is_causal || !options.load_balanced,
              "RingAttention: load balancing requires is_causal = true (set load_balanced = false)");
  TORCH_CHECK(!options.load_balanced || (q.size(kSeqDim) % 2 == 0 && k.size(kSeqDim) % 2 == 0),
              "RingAttention: a load-balanced local sequence holds two chunks, so its length must be even, got ",
              q.size(kSeqDim));
  auto state = c10::make_intrusive<RingState>();
  state->group = group;
  state->options = options;
  state->is_causal = is_causal;
  // Below autograd: the ring's views, merges and copies record no graph of their own.
  auto [out, lse] = [&] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return RingForward(q, k, v, *state);
  }();
  if (torch::autograd::compute_requires_grad(q, k, v)) {
    auto node = c10::make_intrusive<RingAttentionBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(q, k, v));
    node->query = torch::autograd::SavedVariable(q, false);
    node->key = torch::autograd::SavedVariable(k, false);
    node->value = torch::autograd::SavedVariable(v, false);
    node->lse = torch::autograd::SavedVariable(lse, false);
    node->state = std::move(state);
    torch::autograd::set_history(out, node);
    node->out = torch::autograd::SavedVariable(out, true);
  }
  return out;
}

}  // namespace fsdp::context_parallel
