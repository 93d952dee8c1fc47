// See float8_parallel_style.h.
#include "float8/float8_parallel_style.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <memory>
#include <utility>

#include "dtensor/dtensor.h"
#include "float8/float8_linear.h"
#include "float8/float8_tensor.h"
#include "fsdp/hooked_module/hooked_module.h"

namespace fsdp::float8 {
namespace {

using dtensor::DTensorSpec;
using dtensor::Placements;
using dtensor::RedistributeLocal;
using dtensor::ReplicatePartials;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Tensorwise dynamic cast of the tensor whose shard `hp` is (laid out as `spec`): the amax is
// all-reduced (MAX) over every mesh dim that shards it, so the scale is the whole tensor's,
// as torchao's hp_tensor_to_float8_dynamic on a DTensor. Unrounded, as torchao's styles.
Float8Tensor CastWhole(const at::Tensor& hp, const DTensorSpec& spec, c10::ScalarType float8_dtype) {
  TORCH_INTERNAL_ASSERT(!spec.has_partial());  // Input refuses Partial inputs; gradients are never Partial
  at::Tensor amax = TensorToAmax(hp, ScalingGranularity::kTensorwise, std::nullopt);
  for (int d = 0; d < spec.mesh->ndim(); ++d) {
    if (spec.placements[d].is_shard() && spec.mesh->size(d) > 1) amax = AllReduceAmax(amax, spec.mesh->group(d));
  }
  return ToFloat8(hp, AmaxToScale(amax, float8_dtype, /*round_scales_to_power_of_2=*/false), float8_dtype,
                  std::nullopt);
}

// `fp8` (laid out as `src`) moved to `dst` as bytes (Gloo has no float8 type), dequantized, the
// result annotated with the moved float8 tensor.
at::Tensor MoveFloat8(const Float8Tensor& fp8, const DTensorSpec& src, const Placements& dst) {
  at::NoGradGuard no_grad;
  const c10::ScalarType float8_dtype = fp8.data.scalar_type();
  const DTensorSpec bytes = DTensorSpec::Make(src.mesh, src.placements, src.shape, at::kByte);
  at::Tensor data = RedistributeLocal(fp8.data.view(at::kByte), bytes, dst).view(float8_dtype);
  Float8Tensor moved{std::move(data), fp8.scale, fp8.orig_dtype, std::nullopt};
  at::Tensor hp = moved.ToOriginalPrecision();
  AnnotateFloat8(hp, std::move(moved));
  return hp;
}

struct MoveState : torch::CustomClassHolder {
  DTensorSpec src;
  Placements dst;
  dtensor::RedistributeGradLayouts grads;
  c10::ScalarType float8_dtype = at::kFloat8_e4m3fn;
  std::optional<Float8Tensor> already_cast;
};

// The input cast (unless a style already did) and moved as float8.
at::Tensor CastAndMove(const at::Tensor& hp, const MoveState& state) {
  const Float8Tensor fp8 = state.already_cast ? *state.already_cast : CastWhole(hp, state.src, state.float8_dtype);
  return MoveFloat8(fp8, state.src, state.dst);
}

// Forward: cast the input (unless a style already did) and move it as float8. Backward: the
// high-precision gradient redistributed as DTensor's redistribute would (a reduce-scatter of
// the float8 linears' Partial input gradients).
struct CastThenRedistribute : torch::autograd::Function<CastThenRedistribute> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hp, c10::intrusive_ptr<MoveState> state) {
    at::Tensor out = CastAndMove(hp, *state);
    state->already_cast.reset();
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto state = c10::static_intrusive_pointer_cast<MoveState>(ctx->saved_data["state"].toCapsule());
    const Placements grad_src = state->grads.output_grad.value_or(ReplicatePartials(state->dst));
    const Placements grad_dst = state->grads.input_grad.value_or(ReplicatePartials(state->src.placements));
    DTensorSpec spec = state->src.WithPlacements(grad_src);
    spec.dtype = grads[0].scalar_type();
    return {RedistributeLocal(grads[0], spec, grad_dst), at::Tensor()};
  }
};

// torchao's NoopFwToFloat8BwDynamic after the output's redistribute. Forward: DTensor's
// redistribute. Backward: the gradient cast to float8 (the whole tensor's scale) before the
// backward redistribute, so that moves float8; the float8 linear then uses those bits.
struct RedistributeThenCastGrad : torch::autograd::Function<RedistributeThenCastGrad> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hp, c10::intrusive_ptr<MoveState> state) {
    at::Tensor out = RedistributeLocal(hp, state->src, state->dst);
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto state = c10::static_intrusive_pointer_cast<MoveState>(ctx->saved_data["state"].toCapsule());
    const at::Tensor& grad = grads[0];
    DTensorSpec spec = state->src.WithPlacements(ReplicatePartials(state->dst));
    spec.dtype = grad.scalar_type();
    std::optional<Float8Tensor> fp8 = FindFloat8(grad);
    if (!fp8) fp8 = CastWhole(grad, spec, state->float8_dtype);
    return {MoveFloat8(*fp8, spec, ReplicatePartials(state->src.placements)), at::Tensor()};
  }
};

// The float8 styles' redistribution: inputs cast to `input_dtype` before they move; outputs'
// gradients (when `grad_output_dtype` is set) cast before theirs.
class Float8Redistribution : public tensor_parallel::StyleRedistribution {
 public:
  Float8Redistribution(c10::ScalarType input_dtype, std::optional<c10::ScalarType> grad_output_dtype)
      : input_dtype_(input_dtype), grad_output_dtype_(grad_output_dtype) {}

  at::Tensor Input(const at::Tensor& local, const DTensorSpec& src, const Placements& dst,
                   const dtensor::RedistributeGradLayouts& grads) const override {
    TORCH_CHECK(!src.has_partial(), "float8 tensor-parallel style: cannot cast a Partial tensor ", src.ToString(),
                " to float8 (its ranks hold terms of a sum, not its value)");
    std::optional<Float8Tensor> already_cast = FindFloat8(local);
    if (already_cast && src.placements == dst) {
      // Already float8 where it is needed (PrepareFloat8ModuleInput): torchao's
      // tensor_already_casted_to_fp8; the annotation follows an alias made for the backward.
      at::Tensor out = RedistributeLocal(local, src, dst, grads);
      if (!out.is_same(local)) AnnotateFloat8(out, *std::move(already_cast));
      return out;
    }
    auto state = c10::make_intrusive<MoveState>();
    state->src = src;
    state->dst = dst;
    state->grads = grads;
    state->float8_dtype = input_dtype_;
    state->already_cast = std::move(already_cast);
    if (!local.requires_grad() || !at::GradMode::is_enabled()) return CastAndMove(local, *state);
    at::Tensor out = CastThenRedistribute::apply(local, std::move(state));
    // Autograd records the Function on the tensor forward returned, annotation and all.
    TORCH_INTERNAL_ASSERT(FindFloat8(out).has_value());
    return out;
  }

  at::Tensor Output(const at::Tensor& local, const DTensorSpec& src, const Placements& dst) const override {
    if (!grad_output_dtype_ || !local.requires_grad() || !at::GradMode::is_enabled()) {
      return RedistributeLocal(local, src, dst);
    }
    auto state = c10::make_intrusive<MoveState>();
    state->src = src;
    state->dst = dst;
    state->float8_dtype = *grad_output_dtype_;
    return RedistributeThenCastGrad::apply(local, std::move(state));
  }

 private:
  c10::ScalarType input_dtype_;
  std::optional<c10::ScalarType> grad_output_dtype_;
};

// The float8 linear `module` is, checked for what torchao's styles assume.
const Float8Linear& RequireTensorwiseFloat8Linear(torch::nn::Module& module, const std::string& fqn,
                                                  const char* style) {
  const std::shared_ptr<Float8Linear> f8 = AsFloat8Linear(module);
  TORCH_CHECK(f8 != nullptr, style, ": expecting module '", fqn, "' to be a float8 linear but found ", module.name(),
              " (convert_to_float8_training before parallelizing)");
  const ResolvedFloat8Config& c = f8->config();
  for (const auto& [name, cast] : {std::pair<const char*, const CastConfig&>{"input", c.input},
                                   std::pair<const char*, const CastConfig&>{"grad_output", c.grad_output}}) {
    TORCH_CHECK(
        cast.scaling_type == ScalingType::kDynamic && cast.scaling_granularity == ScalingGranularity::kTensorwise,
        style, ": module '", fqn, "' casts its ", name, " ", ShortString(cast),
        "; the float8 tensor-parallel styles take dynamic tensorwise scaling (torchao's tensorwise recipe)");
  }
  return *f8;
}

// A Colwise / Rowwise style over a float8 linear: the generic style with the float8
// redistribution, named as torchao's subclass.
class Float8LinearStyle : public tensor_parallel::ParallelStyle {
 public:
  using Make = tensor_parallel::ParallelStylePtr (*)(tensor_parallel::LinearStyleOptions);
  Float8LinearStyle(const char* name, Make make, tensor_parallel::LinearStyleOptions options)
      : name_(name), make_(make), options_(std::move(options)) {
    TORCH_CHECK(options_.redistribution == nullptr, name_,
                ": options.redistribution must be null (the float8 style moves its own tensors)");
  }
  void Apply(torch::nn::Module& module, const std::string& fqn, const mesh::DeviceMeshPtr& mesh) const override {
    const Float8Linear& f8 = RequireTensorwiseFloat8Linear(module, fqn, name_);
    tensor_parallel::LinearStyleOptions options = options_;
    options.redistribution = std::make_shared<const Float8Redistribution>(*f8.config().input.target_dtype,
                                                                          *f8.config().grad_output.target_dtype);
    tensor_parallel::ParallelStylePtr style = make_(std::move(options));
    style->src_data_rank = src_data_rank;
    style->Apply(module, fqn, mesh);
  }
  std::string ToString() const override { return std::string("Float8") + make_(options_)->ToString(); }

 private:
  const char* name_;
  Make make_;
  tensor_parallel::LinearStyleOptions options_;
};

class PrepareFloat8InputStyle : public tensor_parallel::ParallelStyle {
 public:
  explicit PrepareFloat8InputStyle(PrepareFloat8ModuleInputOptions o)
      : o_(std::move(o)),
        generic_(tensor_parallel::PrepareModuleInput(
            {o_.input_layouts, o_.desired_input_layouts, o_.use_local_output, nullptr})) {
    TORCH_CHECK(o_.float8_dtype == at::kFloat8_e4m3fn, "PrepareFloat8ModuleInput: float8_dtype ",
                c10::toString(o_.float8_dtype), " is not supported; only Float8_e4m3fn (as torchao)");
  }
  void Apply(torch::nn::Module& module, const std::string& fqn, const mesh::DeviceMeshPtr& mesh) const override {
    CheckFloat8Below(module, fqn);
    tensor_parallel::ParallelStylePtr style = tensor_parallel::PrepareModuleInput(
        {o_.input_layouts, o_.desired_input_layouts, o_.use_local_output,
         std::make_shared<const Float8Redistribution>(o_.float8_dtype, std::nullopt)});
    style->src_data_rank = src_data_rank;
    style->Apply(module, fqn, mesh);
  }
  std::string ToString() const override {
    return "PrepareFloat8ModuleInput" + generic_->ToString().substr(std::string("PrepareModuleInput").size());
  }

 private:
  // torchao's _apply: the forward config comes from the named float8 linear, or from every
  // float8 linear below the module, which must agree; at least one must exist.
  void CheckFloat8Below(torch::nn::Module& module, const std::string& fqn) const {
    const auto name = [&](const std::string& sub) { return fqn.empty() ? sub : sub.empty() ? fqn : fqn + "." + sub; };
    if (o_.fwd_config_submodule_fqn) {
      std::shared_ptr<torch::nn::Module> sub;
      for (const auto& item : module.named_modules("", /*include_self=*/false)) {
        if (item.key() == *o_.fwd_config_submodule_fqn) sub = item.value();
      }
      TORCH_CHECK(sub != nullptr && AsFloat8Linear(*sub) != nullptr, "PrepareFloat8ModuleInput: module '", fqn,
                  "': fwd_config_submodule_fqn '", *o_.fwd_config_submodule_fqn, "' is not a float8 linear below it");
      return;
    }
    std::optional<std::string> first;
    GemmConfig first_gemm;
    for (const auto& item : module.named_modules("", /*include_self=*/true)) {
      const std::shared_ptr<Float8Linear> f8 = AsFloat8Linear(*item.value());
      if (!f8) continue;
      const GemmConfig& gemm = f8->config().gemm_output;
      if (!first) {
        first = name(item.key());
        first_gemm = gemm;
        continue;
      }
      TORCH_CHECK(gemm.use_fast_accum == first_gemm.use_fast_accum, "PrepareFloat8ModuleInput: module '", fqn,
                  "': float8 linears '", *first, "' and '", name(item.key()),
                  "' have different matmul configs; all the float8 linears below it should have the same (or name "
                  "one with fwd_config_submodule_fqn)");
    }
    TORCH_CHECK(first.has_value(), "PrepareFloat8ModuleInput: module '", fqn,
                "' has no float8 linear below it (convert_to_float8_training before parallelizing)");
  }

  PrepareFloat8ModuleInputOptions o_;
  tensor_parallel::ParallelStylePtr generic_;
};

}  // namespace

tensor_parallel::ParallelStylePtr Float8ColwiseParallel(tensor_parallel::LinearStyleOptions options) {
  return std::make_shared<Float8LinearStyle>("Float8ColwiseParallel", &tensor_parallel::ColwiseParallel,
                                             std::move(options));
}

tensor_parallel::ParallelStylePtr Float8RowwiseParallel(tensor_parallel::LinearStyleOptions options) {
  return std::make_shared<Float8LinearStyle>("Float8RowwiseParallel", &tensor_parallel::RowwiseParallel,
                                             std::move(options));
}

tensor_parallel::ParallelStylePtr PrepareFloat8ModuleInput(PrepareFloat8ModuleInputOptions options) {
  return std::make_shared<PrepareFloat8InputStyle>(std::move(options));
}

}  // namespace fsdp::float8
