// See selective_ac.h.
#include "train/selective_ac.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <memory>
#include <set>
#include <utility>

namespace fsdp::train {
namespace {

using activation_checkpointing::CheckpointPolicy;
using activation_checkpointing::OpCall;

std::string FullName(const c10::OperatorName& name) {
  return name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
}

}  // namespace

const std::vector<std::string>& TorchtitanSaveOps() {
  // torch._functorch.partitioners.get_default_op_list().compute_intensive_ops, then the
  // compute and communication operators torchtitan adds.
  static const std::vector<std::string> ops = {
      "aten::mm",
      "aten::convolution",
      "aten::convolution_backward",
      "aten::bmm",
      "aten::addmm",
      "aten::_scaled_dot_product_flash_attention",
      "aten::_scaled_dot_product_efficient_attention",
      "aten::_flash_attention_forward",
      "aten::_efficient_attention_forward",
      "aten::upsample_bilinear2d",
      "aten::_scaled_mm",
      "aten::_scaled_dot_product_cudnn_attention",
      "aten::_scaled_dot_product_attention_math",
      "aten::_scaled_dot_product_fused_attention_overrideable",
      "aten::max",
      "aten::linear",
      "aten::topk",
      "_c10d_functional::reduce_scatter_tensor",
      "_c10d_functional::all_to_all_single",
      "torch_attn::_varlen_attn",  // registered by PyTorch's varlen attention backend where present
  };
  return ops;
}

activation_checkpointing::SelectivePolicyFactory TorchtitanSelectivePolicy(
    torch::nn::Module& block, const std::string& block_fqn,
    const std::vector<std::string>& force_recompute_mm_shapes_by_fqns) {
  // The (in, out) shapes of the right-hand side of the matmuls to recompute.
  std::set<std::pair<int64_t, int64_t>> recompute_shapes;
  for (const auto& item : block.named_modules("", /*include_self=*/true)) {
    const std::string fqn = item.key().empty() ? block_fqn : block_fqn + "." + item.key();
    const bool named = std::any_of(force_recompute_mm_shapes_by_fqns.begin(), force_recompute_mm_shapes_by_fqns.end(),
                                   [&](const std::string& f) { return fqn.find(f) != std::string::npos; });
    if (!named) continue;
    const auto* linear = dynamic_cast<const torch::nn::LinearImpl*>(item.value().get());
    TORCH_CHECK(linear != nullptr, "activation_checkpoint.force_recompute_mm_shapes_by_fqns matches ", fqn,
                ", which is no Linear (", item.value()->name(), "); only Linear modules are supported");
    recompute_shapes.emplace(linear->weight.size(1), linear->weight.size(0));
  }
  const std::set<std::string> save_ops(TorchtitanSaveOps().begin(), TorchtitanSaveOps().end());
  return [recompute_shapes, save_ops]() -> activation_checkpointing::SelectivePolicy {
    auto mm_count = std::make_shared<int64_t>(0);
    return [recompute_shapes, save_ops, mm_count](const OpCall& call) {
      const std::string name = FullName(call.op.operator_name());
      // Device-to-host copies are kept (torchtitan: MoE's all-to-all metadata).
      if (name == "aten::_to_copy" && call.arguments[0].toTensor().is_cuda() && call.arguments[3].isDevice() &&
          call.arguments[3].toDevice().is_cpu()) {
        return CheckpointPolicy::kMustSave;
      }
      const bool is_mm = name == "aten::mm" || name == "aten::linear";
      if (is_mm) {
        const at::Tensor& rhs = call.arguments[1].toTensor();
        if (rhs.dim() == 2) {
          // aten::linear's weight is (out, in); aten::mm's right-hand side (in, out).
          const std::pair<int64_t, int64_t> shape =
              name == "aten::linear" ? std::pair{rhs.size(1), rhs.size(0)} : std::pair{rhs.size(0), rhs.size(1)};
          if (recompute_shapes.count(shape) > 0) return CheckpointPolicy::kPreferRecompute;
        }
        ++*mm_count;
      }
      if (save_ops.count(name) == 0) return CheckpointPolicy::kPreferRecompute;
      if (is_mm && *mm_count % 2 == 0) return CheckpointPolicy::kPreferRecompute;
      return CheckpointPolicy::kMustSave;
    };
  };
}

}  // namespace fsdp::train
