#include "context_parallel/ring_attention.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <utility>
#include <vector>

namespace fsdp::context_parallel {
namespace {

using torch::autograd::AutogradContext;
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

// Passes flat buffers round the ring: step i's buffer is rank (rank - i)'s. PyTorch's
// _AllGatherRotater (one all-gather, then chunks) and _AllToAllRotater (permute_tensor to
// the next rank: an all_to_all_single whose only non-empty piece goes to rank + 1).
class Rotater {
 public:
  Rotater(comm::ProcessGroupPtr group, RotateMethod method) : group_(std::move(group)), method_(method) {}

  void Exchange(const at::Tensor& buffer) {
    ++steps_;
    const int world = group_->size(), rank = group_->rank();
    if (method_ == RotateMethod::kAllGather) {
      if (gathered_.defined()) return;  // one all-gather serves every step
      gathered_ = at::empty({world * buffer.numel()}, buffer.options());
      work_ = group_->all_gather_into_tensor(gathered_, buffer.contiguous());
      return;
    }
    std::vector<int64_t> in_splits(world, 0), out_splits(world, 0);
    in_splits[(rank + 1) % world] = buffer.numel();
    out_splits[(rank - 1 + world) % world] = buffer.numel();
    received_ = at::empty_like(buffer);
    work_ = group_->all_to_all_single(received_, buffer.contiguous(), out_splits, in_splits);
  }

  at::Tensor Next() {
    if (work_) {
      work_->wait();
      work_.reset();
    }
    if (method_ == RotateMethod::kAllToAll) return received_;
    const int world = group_->size();
    const int source = ((group_->rank() - steps_) % world + world) % world;
    const int64_t numel = gathered_.numel() / world;
    return gathered_.narrow(0, source * numel, numel);
  }

 private:
  comm::ProcessGroupPtr group_;
  RotateMethod method_;
  int steps_ = 0;
  at::Tensor gathered_, received_;
  comm::WorkPtr work_;
};

// chunk `half` (0 or 1) of two along the sequence.
at::Tensor Half(const at::Tensor& t, int half) {
  const int64_t length = t.size(kSeqDim) / 2;
  return t.narrow(kSeqDim, half * length, length);
}

// out / lse of one block merged into the running result (PyTorch's _SDPAMerger), on the
// later half of the queries when `partial`. The running tensors are the first block's kernel
// outputs, updated in place: a merge is three kernels and no copy of the other half.
class Merger {
 public:
  explicit Merger(bool convert_to_f32) : convert_to_f32_(convert_to_f32) {}

  void Step(at::Tensor out, at::Tensor lse, bool partial) {
    out_dtype_ = out.scalar_type();
    lse_dtype_ = lse.scalar_type();
    if (convert_to_f32_) {
      out = out.to(at::kFloat);
      lse = lse.to(at::kFloat);
    }
    lse = lse.unsqueeze(-1);
    if (!lse_.defined()) {
      out_ = out;
      lse_ = lse;
      return;
    }
    at::Tensor running_out = partial ? Half(out_, 1) : out_;
    at::Tensor running_lse = partial ? Half(lse_, 1) : lse_;
    // PyTorch's stable form (github.com/zhuzilin/ring-flash-attention/pull/34):
    //   out = running_out - sigmoid(lse - running_lse) * (running_out - out), a lerp towards
    //   out by that sigmoid; lse = running_lse - log_sigmoid(running_lse - lse), which is
    //   logaddexp(running_lse, lse).
    running_out.lerp_(out, at::sigmoid(lse - running_lse));
    running_lse.copy_(at::logaddexp(running_lse, lse));
  }

  std::pair<at::Tensor, at::Tensor> Results() const {
    TORCH_INTERNAL_ASSERT(out_.defined(), "RingAttention: no block attended");
    return {out_.to(out_dtype_), lse_.squeeze(-1).to(lse_dtype_)};
  }

 private:
  bool convert_to_f32_;
  at::Tensor out_, lse_;
  c10::ScalarType out_dtype_ = at::kFloat, lse_dtype_ = at::kFloat;
};

// The k / v views of a flat [k, v] buffer.
std::pair<at::Tensor, at::Tensor> SplitKv(const at::Tensor& buffer, const at::Tensor& k, const at::Tensor& v) {
  return {buffer.narrow(0, 0, k.numel()).view(k.sizes()), buffer.narrow(0, k.numel(), v.numel()).view(v.sizes())};
}

at::Tensor FlatKv(const at::Tensor& k, const at::Tensor& v) { return at::cat({k.reshape(-1), v.reshape(-1)}); }

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
  const at::Tensor k0 = key, v0 = value;
  Rotater rotater(s.group, s.options.rotate_method);
  Merger merger(s.options.convert_to_f32);
  for (int i = 0; i < world; ++i) {
    if (i > 0) std::tie(key, value) = SplitKv(rotater.Next(), k0, v0);
    if (i < world - 1) rotater.Exchange(FlatKv(key, value));
    const Block block = BlockBehavior(rank, world, i, s.is_causal, balanced);
    if (block == Block::kSkip) continue;
    const Part part = BlockPart(rank, i, s.is_causal, balanced);
    const at::Tensor q = part == Part::kLaterQueries ? Half(query, 1) : query;
    const at::Tensor k = part == Part::kEarlierKeys ? Half(key, 0) : key;
    const at::Tensor v = part == Part::kEarlierKeys ? Half(value, 0) : value;
    const bool partial = part == Part::kLaterQueries;
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, block == Block::kCausal,
                                                                      std::nullopt, s.options.scale);
    merger.Step(out, lse, partial);
  }
  return merger.Results();
}

// The gradients accumulate in place: grad_query in the first block's kernel output, the key /
// value gradients in the buffer each step receives (this rank's from the previous one).
std::vector<at::Tensor> RingBackward(const at::Tensor& grad_out, const at::Tensor& query, at::Tensor key,
                                     at::Tensor value, const at::Tensor& out, const at::Tensor& lse,
                                     const RingState& s) {
  const int rank = s.group->rank(), world = s.group->size();
  const bool balanced = s.options.load_balanced;
  const c10::ScalarType accum = s.options.convert_to_f32 ? at::kFloat : query.scalar_type();
  key = key.contiguous();
  value = value.contiguous();
  const at::Tensor k0 = key, v0 = value;
  at::Tensor grad_query, grad_key, grad_value;
  Rotater kv_rotater(s.group, s.options.rotate_method);
  Rotater dkv_rotater(s.group, RotateMethod::kAllToAll);  // PyTorch passes gradients this way always
  for (int i = 0; i < world; ++i) {
    if (i > 0) std::tie(key, value) = SplitKv(kv_rotater.Next(), k0, v0);
    if (i != world - 1) kv_rotater.Exchange(FlatKv(key, value));
    const Block block = BlockBehavior(rank, world, i, s.is_causal, balanced);
    at::Tensor block_grad_query, block_grad_key, block_grad_value;
    if (block != Block::kSkip) {
      const Part part = BlockPart(rank, i, s.is_causal, balanced);
      const bool later = part == Part::kLaterQueries, earlier = part == Part::kEarlierKeys;
      const at::Tensor q = later ? Half(query, 1) : query, o = later ? Half(out, 1) : out;
      const at::Tensor dout = later ? Half(grad_out, 1) : grad_out, l = later ? Half(lse, 1).contiguous() : lse;
      const at::Tensor k = earlier ? Half(key, 0) : key, v = earlier ? Half(value, 0) : value;
      std::tie(block_grad_query, block_grad_key, block_grad_value) =
          at::_scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, o, l, 0.0, block == Block::kCausal,
                                                                   std::nullopt, s.options.scale);
    }
    if (i == 0) {  // block 0 is this rank's own, always attended
      grad_query = block_grad_query.to(accum);
      grad_key = block_grad_key.to(accum);
      grad_value = block_grad_value.to(accum);
    } else {
      std::tie(grad_key, grad_value) = SplitKv(dkv_rotater.Next(), k0, v0);
      if (block != Block::kSkip) {
        const bool earlier_keys = i <= rank && balanced;
        (earlier_keys ? Half(grad_key, 0) : grad_key).add_(block_grad_key);
        (earlier_keys ? Half(grad_value, 0) : grad_value).add_(block_grad_value);
        (i <= rank || !balanced ? grad_query : Half(grad_query, 1)).add_(block_grad_query);
      }
    }
    dkv_rotater.Exchange(FlatKv(grad_key, grad_value));
  }
  const auto [gk, gv] = SplitKv(dkv_rotater.Next().to(key.scalar_type()), k0, v0);
  return {grad_query.to(query.scalar_type()), gk, gv};
}

struct RingAttentionFunction : torch::autograd::Function<RingAttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            c10::intrusive_ptr<RingState> state) {
    auto [out, lse] = RingForward(q, k, v, *state);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const auto state = c10::static_intrusive_pointer_cast<RingState>(ctx->saved_data["state"].toCapsule());
    std::vector<at::Tensor> g =
        RingBackward(grads[0].contiguous(), saved[0], saved[1], saved[2], saved[3], saved[4], *state);
    return {g[0], g[1], g[2], at::Tensor()};
  }
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
  return RingAttentionFunction::apply(q, k, v, std::move(state));
}

}  // namespace fsdp::context_parallel
