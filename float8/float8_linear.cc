#include "float8/float8_linear.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <sstream>
#include <utility>

#include "comm/process_group.h"
#include "distributed_parameters/distributed_parameters.h"
#include "float8/float8_tensor.h"
#include "float8/fsdp_float8.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "mesh/device_mesh.h"

namespace fsdp::float8 {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// An operand of one matmul: float8, or high precision when its scaling is disabled.
struct Operand {
  std::optional<Float8Tensor> fp8;
  at::Tensor hp;
  Operand t() const { return fp8 ? Operand{fp8->t(), {}} : Operand{std::nullopt, hp.t()}; }
};

// A 2-D operand's tensor-parallel split: the dim sharded over `group` (-1: replicated).
struct Split {
  int64_t dim = -1;
  comm::ProcessGroupPtr group;
};

// Casts a 2-D operand. Its scale is what torchao computes on the DTensor: an amax over a
// sharded dim (tensorwise: every dim; axiswise: the reduced `axis`) is all-reduced (MAX)
// over the tensor-parallel group, so every rank casts with the global scale.
Operand Cast(const at::Tensor& hp, const CastConfig& cast, int64_t axis, bool round_pow2, const Split& split = {}) {
  if (cast.scaling_type == ScalingType::kDisabled) return Operand{std::nullopt, hp};
  const bool reduce = split.dim >= 0 && (cast.scaling_granularity == ScalingGranularity::kTensorwise ||
                                         (axis < 0 ? axis + hp.dim() : axis) == split.dim);
  if (!reduce) return Operand{ToFloat8Dynamic(hp, cast, axis, round_pow2), {}};
  return Operand{ToFloat8Dynamic(hp, cast, axis, round_pow2,
                                 [&](const at::Tensor& amax) { return AllReduceAmax(amax, split.group); }),
                 {}};
}

at::Tensor Mm(const Operand& a, const Operand& b, const GemmConfig& gemm, const ResolvedFloat8Config& c) {
  // Resolve() makes both operands of a matmul float8 or both high precision.
  TORCH_INTERNAL_ASSERT(a.fp8.has_value() == b.fp8.has_value());
  if (!a.fp8) return at::mm(a.hp, b.hp);
  return Float8Mm(*a.fp8, *b.fp8, gemm, c.emulate, c.pad_inner_dim);
}

// What the matmul's backward needs beside its saved tensors: the config, the weight already
// in float8 when FSDP all-gathered it so (transposed: [in, out]), the input already in float8
// when a float8 tensor-parallel style cast it before its all-gather ([M, K]).
struct MatmulState : torch::CustomClassHolder {
  ResolvedFloat8Config config;
  std::optional<Float8Tensor> weight_t_fp8;
  std::optional<Float8Tensor> input_fp8;
  // Under tensor parallelism: how input [M, K], weight_t [K, N] and grad_output [M, N] are split.
  Split input, weight_t, grad_output;
};

// A tensor a float8 style already cast (FindFloat8), as a 2-D operand for a cast `cast`:
// torchao uses such a tensor as it is ("we assume the cast honored the config"); a disabled
// cast takes the high-precision values.
std::optional<Float8Tensor> AlreadyCast(const at::Tensor& hp, const CastConfig& cast) {
  if (cast.scaling_type == ScalingType::kDisabled) return std::nullopt;
  std::optional<Float8Tensor> fp8 = FindFloat8(hp);
  if (!fp8 || fp8->axiswise_dim) return std::nullopt;  // the styles cast tensorwise
  fp8->data = fp8->data.reshape({-1, fp8->data.size(-1)});
  return fp8;
}

// torchao's matmul_with_hp_or_float8_args: input [..., K] @ weight_t [K, N].
struct Float8Matmul : torch::autograd::Function<Float8Matmul> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight_t,
                            c10::intrusive_ptr<MatmulState> state) {
    ctx->save_for_backward({input, weight_t});
    const ResolvedFloat8Config& c = state->config;
    const int64_t k = input.size(-1);
    const at::Tensor input_2d = input.reshape({-1, k});
    const Operand a = state->input_fp8 ? Operand{state->input_fp8, {}}
                                       : Cast(input_2d, c.input, -1, c.round_scales_to_power_of_2, state->input);
    const Operand b = state->weight_t_fp8 ? Operand{state->weight_t_fp8, {}}
                                          : Cast(weight_t, c.weight, 0, c.round_scales_to_power_of_2, state->weight_t);
    at::Tensor out = Mm(a, b, c.gemm_output, c);
    std::vector<int64_t> shape = input.sizes().vec();
    shape.back() = out.size(-1);
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return out.reshape(shape);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight_t = saved[1];
    const auto state = c10::static_intrusive_pointer_cast<MatmulState>(ctx->saved_data["state"].toCapsule());
    const ResolvedFloat8Config& c = state->config;
    const bool pow2 = c.round_scales_to_power_of_2;
    const at::Tensor& grad_output = grads[0];
    const at::Tensor go_2d = grad_output.reshape({-1, grad_output.size(-1)});
    // A float8 style casts the gradient before its backward all-gather; torchao then uses
    // those bits for both matmuls.
    const auto cast_grad_output = [&](const CastConfig& cast, int64_t axis) {
      if (auto fp8 = AlreadyCast(grad_output, cast)) return Operand{std::move(fp8), {}};
      return Cast(go_2d, cast, axis, pow2, state->grad_output);
    };

    at::Tensor grad_input;
    if (ctx->needs_input_grad(0)) {
      const Operand go = cast_grad_output(c.grad_output, -1);
      const Operand w = state->weight_t_fp8 ? Operand{state->weight_t_fp8, {}}
                                            : Cast(weight_t, c.weight_for_grad_input, -1, pow2, state->weight_t);
      grad_input = Mm(go, w.t(), c.gemm_grad_input, c);
      std::vector<int64_t> shape = grad_output.sizes().vec();
      shape.back() = grad_input.size(-1);
      grad_input = grad_input.reshape(shape);
    }
    at::Tensor grad_weight_t;
    if (ctx->needs_input_grad(1)) {
      const at::Tensor input_2d = input.reshape({-1, input.size(-1)});
      const Operand go = cast_grad_output(c.grad_output_for_grad_weight, 0);
      const Operand in = state->input_fp8 && c.input_for_grad_weight.scaling_type != ScalingType::kDisabled
                             ? Operand{state->input_fp8, {}}
                             : Cast(input_2d, c.input_for_grad_weight, 0, pow2, state->input);
      grad_weight_t = Mm(go.t(), in, c.gemm_grad_weight, c).t();
    }
    return {grad_input, grad_weight_t, at::Tensor()};
  }
};

bool Contains(const std::string& fqn, const std::vector<std::string>& parts) {
  for (const auto& p : parts) {
    if (fqn.find(p) != std::string::npos) return true;
  }
  return false;
}

using HookedLinearImpl = HookedImpl<torch::nn::LinearImpl>;

// The Linears `filter` selects, children before parents as torchao's swap_linear_layers
// visits them; errors for one that cannot take a float8 forward. `sharded_by`: the FQN of the
// nearest fully_shard'ed module at or above `module` (nullptr: none in root's tree).
void CollectPostOrder(torch::nn::Module& module, const std::string& fqn, const ModuleFilterFn& filter,
                      const std::string* sharded_by,
                      std::vector<std::pair<std::string, torch::nn::LinearImpl*>>& selected) {
  if (fsdp2::AsFSDPModule(module)) sharded_by = &fqn;
  for (const auto& child : module.named_children()) {
    CollectPostOrder(*child.value(), fqn.empty() ? child.key() : fqn + "." + child.key(), filter, sharded_by, selected);
  }
  auto* linear = dynamic_cast<torch::nn::LinearImpl*>(&module);
  if (!linear || (filter && !filter(*linear, fqn))) return;
  // FSDP2 looks for a float8 all-gather when it shards: converting later would leave the
  // weights all-gathered in high precision and the precomputed scales unused.
  TORCH_CHECK(sharded_by == nullptr, "convert_to_float8_training: Linear '", fqn,
              "' is already under fully_shard (of '", *sharded_by,
              "'); convert before fully_shard, as torchao's and torchtitan's order is");
  auto* hooked = dynamic_cast<HookedLinearImpl*>(linear);
  TORCH_CHECK(hooked != nullptr, "convert_to_float8_training: Linear '", fqn,
              "' is a torch::nn::Linear; only fsdp::Hooked<torch::nn::LinearImpl> modules can take a float8 forward "
              "(build the model with the hooked Linear, fsdp/hooked_module/hooked_module.h)");
  TORCH_CHECK(!hooked->forward_replacement(), "convert_to_float8_training: Linear '", fqn,
              "' already has a replaced forward (converted twice?)");
  selected.emplace_back(fqn, linear);
}

}  // namespace

Float8Linear::Float8Linear(torch::nn::LinearImpl& linear, const Float8LinearConfig& config)
    : linear_(linear), config_(Resolve(config)) {
  if (config_.enable_fsdp_float8_all_gather) {
    weight_all_gather_ = std::make_shared<Float8WeightAllGather>(*config_.weight.target_dtype);
  }
}

at::Tensor Float8Linear::Forward(const at::Tensor& input) {
  const at::Tensor& weight = linear_.weight;
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == weight.size(1), "Float8Linear: input's last dim (",
              input.dim() ? input.size(-1) : 0, ") must equal in_features (", weight.size(1), ")");
  auto state = c10::make_intrusive<MatmulState>();
  state->config = config_;
  // A tensor-parallel style shards the weight on dim 0 (colwise: weight_t and grad_output
  // split on N) or dim 1 (rowwise: input and weight_t split on K).
  if (const auto* distributed = distributed_parameters::FindDistributedParameters(linear_)) {
    for (const auto& [name, spec] : distributed->named_parameter_specs()) {
      if (name != "weight") continue;
      for (int d = 0; d < spec.mesh->ndim(); ++d) {
        const auto& placement = spec.placements[d];
        if (!placement.is_shard() || spec.mesh->size(d) == 1) continue;
        const comm::ProcessGroupPtr& group = spec.mesh->group(d);
        TORCH_CHECK(!state->input.group && !state->weight_t.group, "Float8Linear: weight ", spec.ToString(),
                    " is sharded on more than one mesh dim; float8 takes one tensor-parallel dim");
        if (placement.is_shard(0)) {
          state->weight_t = state->grad_output = Split{1, group};
        } else {
          state->input = Split{1, group};
          state->weight_t = Split{0, group};
        }
      }
    }
  }
  if (weight_all_gather_) {
    if (auto gathered = weight_all_gather_->Gathered(weight)) state->weight_t_fp8 = gathered->t();
  }
  state->input_fp8 = AlreadyCast(input, config_.input);
  at::Tensor out = Float8Matmul::apply(input, weight.t(), std::move(state));
  if (linear_.bias.defined()) out = out + linear_.bias.to(out.scalar_type());
  return out;
}

std::shared_ptr<fsdp2::AllGatherExtension> Float8Linear::all_gather_extension(const std::string& param_name) const {
  return param_name == "weight" ? weight_all_gather_ : nullptr;
}

std::string Float8Linear::ToString() const {
  std::ostringstream s;
  s << "in_features=" << linear_.options.in_features() << ", out_features=" << linear_.options.out_features()
    << ", bias=" << (linear_.options.bias() ? "True" : "False") << ", cast_configs=i:" << ShortString(config_.input)
    << ",w:" << ShortString(config_.weight) << ",go:" << ShortString(config_.grad_output);
  auto differs = [](const CastConfig& a, const CastConfig& b) {
    return a.scaling_type != b.scaling_type || a.scaling_granularity != b.scaling_granularity ||
           a.target_dtype != b.target_dtype;
  };
  if (differs(config_.input_for_grad_weight, config_.input))
    s << ",i_gw:" << ShortString(config_.input_for_grad_weight);
  if (differs(config_.weight_for_grad_input, config_.weight))
    s << ",w_gi:" << ShortString(config_.weight_for_grad_input);
  if (differs(config_.grad_output_for_grad_weight, config_.grad_output)) {
    s << ",go_gw:" << ShortString(config_.grad_output_for_grad_weight);
  }
  return s.str();
}

ModuleFilterFn FilterFqns(std::vector<std::string> filter_fqns) {
  return [filter_fqns = std::move(filter_fqns)](const torch::nn::LinearImpl& linear, const std::string& fqn) {
    const int64_t in = linear.options.in_features(), out = linear.options.out_features();
    return in % 16 == 0 && out % 16 == 0 && !Contains(fqn, filter_fqns);
  };
}

ModuleFilterFn AutoFilterForRecipe(const std::string& recipe_name, std::vector<std::string> filter_fqns) {
  TORCH_CHECK(recipe_name == "tensorwise" || recipe_name == "rowwise", "AutoFilterForRecipe: unsupported recipe ",
              recipe_name, " (tensorwise and rowwise have one)");
  const bool tensorwise = recipe_name == "tensorwise";
  return
      [tensorwise, filter_fqns = std::move(filter_fqns)](const torch::nn::LinearImpl& linear, const std::string& fqn) {
        if (Contains(fqn, filter_fqns)) return false;
        const int64_t n = linear.weight.size(0), k = linear.weight.size(1);
        if (k % 16 != 0 || n % 16 != 0) return false;
        if (tensorwise) return !(k <= 4096 && n <= 1024);
        return !(n <= 2048 || k <= 1024 || (n <= 4096 && k <= 2048));
      };
}

int convert_to_float8_training(torch::nn::Module& root, const Float8LinearConfig& config,
                               const ModuleFilterFn& module_filter_fn) {
  Resolve(config);  // a bad config fails before anything changes
  std::vector<std::pair<std::string, torch::nn::LinearImpl*>> selected;
  CollectPostOrder(root, "", module_filter_fn, /*sharded_by=*/nullptr, selected);
  for (auto& [fqn, linear] : selected) {
    dynamic_cast<HookedLinearImpl&>(*linear).SetForwardReplacement(std::make_shared<Float8Linear>(*linear, config));
  }
  return static_cast<int>(selected.size());
}

std::shared_ptr<Float8Linear> AsFloat8Linear(torch::nn::Module& module) {
  return FindForwardReplacement<Float8Linear>(module);
}

}  // namespace fsdp::float8
