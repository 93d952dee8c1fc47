// The styles of torch/distributed/tensor/parallel/style.py as forward hooks over local
// tensors (the layout rules: tensor_parallel/parallel_style.h).
#include "tensor_parallel/parallel_style.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "distributed_parameters/distributed_parameters.h"
#include "dtensor/dtensor.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "tensor_parallel/local_annotation.h"

namespace fsdp::tensor_parallel {

using ::fsdp::dtensor::distribute_tensor;
using ::fsdp::dtensor::DTensor;
using ::fsdp::dtensor::DTensorSpec;
using ::fsdp::dtensor::LocalShapeAndOffset;
using ::fsdp::dtensor::Placement;
using ::fsdp::dtensor::PlacementKind;
using ::fsdp::dtensor::Placements;
using ::fsdp::dtensor::RedistributeGradLayouts;
using ::fsdp::dtensor::RedistributeLocal;
using ::fsdp::dtensor::ReplicatePartials;
using ::fsdp::dtensor::ToString;
using ::fsdp::dtensor::ValidatePlacements;
at::Tensor StyleRedistribution::Input(const at::Tensor& local, const DTensorSpec& src, const Placements& dst,
                                      const RedistributeGradLayouts& grads) const {
  return RedistributeLocal(local, src, dst, grads);
}

at::Tensor StyleRedistribution::Output(const at::Tensor& local, const DTensorSpec& src, const Placements& dst) const {
  return RedistributeLocal(local, src, dst);
}

namespace {

// DTensor's redistribute, for styles given none.
StyleRedistributionPtr OrDefault(StyleRedistributionPtr redistribution) {
  static const auto kDefault = std::make_shared<const StyleRedistribution>();
  return redistribution ? std::move(redistribution) : kDefault;
}

std::string LayoutTuple(const std::vector<std::optional<Placement>>& layouts) {
  std::vector<std::string> parts;
  for (const auto& p : layouts) parts.push_back(p ? p->ToString() : "None");
  return absl::StrCat("(", absl::StrJoin(parts, ", "), parts.size() == 1 ? ",)" : ")");
}
std::string LayoutTuple(const Placement& p) { return absl::StrCat("(", p.ToString(), ",)"); }
const char* PyBool(bool b) { return b ? "True" : "False"; }

// What consumers of a DTensor input that a PrepareModuleInput made (use_local_output =
// false) deliver: parallel-style submodules, whose input gradients are Partial where the
// input was Replicate.
Placements PartialsForReplicates(Placements placements) {
  for (Placement& p : placements) {
    if (p.is_replicate()) p = Placement::Partial();
  }
  return placements;
}

HookedModule& RequireHooked(torch::nn::Module& module, const std::string& fqn, const char* style) {
  HookedModule* hooked = AsHooked(module);
  TORCH_CHECK(hooked != nullptr, style, ": module '", fqn, "' (", module.name(),
              ") runs no forward hooks; declare it as fsdp::Hooked<Impl> (fsdp/hooked_module/hooked_module.h)");
  return *hooked;
}

void RequireOneDimMesh(const mesh::DeviceMeshPtr& mesh, const std::string& fqn, const char* style) {
  TORCH_CHECK(mesh != nullptr, style, ": the mesh for module '", fqn, "' is null");
  TORCH_CHECK(mesh->ndim() == 1, style, ": module '", fqn, "': tensor parallelism takes a 1-D mesh, got ",
              mesh->ToString(), " (slice the tensor-parallel dimension, e.g. mesh[\"tp\"])");
}

// A tensor argument as the DTensor PyTorch's input_fn sees: its annotation, else
// from_local(local, mesh, {layout}) (global shape from even shards, run_check=False).
LocalAnnotation InputLayout(const at::Tensor& local, const mesh::DeviceMeshPtr& mesh, const Placement& layout,
                            const std::string& fqn, const char* style) {
  TORCH_CHECK(local.defined(), style, ": module '", fqn, "' got an undefined input tensor");
  if (auto annotation = FindLocalAnnotation(local)) return *std::move(annotation);
  const DTensor d = DTensor::from_local(local, mesh, {layout});
  return LocalAnnotation{d.spec(), ReplicatePartials(d.spec().placements)};
}

// The module's own parameter `name` (the same tensor, so set_data reaches the module), or
// an undefined tensor.
at::Tensor OwnParameter(torch::nn::Module& module, const std::string& name) {
  const auto params = module.named_parameters(/*recurse=*/false);
  const at::Tensor* p = params.find(name);
  return p != nullptr ? *p : at::Tensor();
}

// The parameter-distributing styles' hook: it also tells FSDP, DCP and clipping the
// layouts of the parameters it distributed.
class ParameterStyleHook : public ForwardHook, public distributed_parameters::DistributedParameterModule {
 public:
  std::vector<std::pair<std::string, DTensorSpec>> named_parameter_specs() const override { return specs_; }

 protected:
  // Replaces parameter `name`'s values with this rank's part under `placements`, in place
  // (the tensor object, its FQN and the module's member stay).
  DTensorSpec Distribute(torch::nn::Module& module, const std::string& name, const Placements& placements,
                         const mesh::DeviceMeshPtr& mesh, std::optional<int> src_data_rank) {
    at::Tensor param = OwnParameter(module, name);
    TORCH_INTERNAL_ASSERT(param.defined());
    // Meta parameters have no values to broadcast: each rank takes its part of the shape.
    const DTensor d = distribute_tensor(param, mesh, placements, param.is_meta() ? std::nullopt : src_data_rank);
    {
      at::NoGradGuard no_grad;
      param.set_data(d.to_local());
    }
    specs_.emplace_back(name, d.spec());
    return d.spec();
  }

  std::vector<std::pair<std::string, DTensorSpec>> specs_;
};

bool RequireOneOutput(const std::vector<at::Tensor*>& outputs, const std::string& fqn, const char* style) {
  TORCH_CHECK(outputs.size() == 1 && outputs[0]->defined(), style, ": module '", fqn, "' must return one tensor, got ",
              outputs.size());
  return true;
}

// The output's layout -> output_layouts; annotated (a DTensor) unless use_local_output.
at::Tensor PrepareOutput(const at::Tensor& out, const DTensorSpec& spec, const Placement& output_layout,
                         bool use_local_output, const StyleRedistribution& redistribution) {
  const Placements dst = ValidatePlacements({output_layout}, 1, out.dim(), "output_layouts");
  at::Tensor result = redistribution.Output(out, spec, dst);
  if (!use_local_output) AnnotateLocal(result, {spec.WithPlacements(dst), ReplicatePartials(dst)});
  return result;
}

enum class ModuleKind { kLinear, kEmbedding };

ModuleKind KindOf(torch::nn::Module& module, const std::string& fqn, const char* style) {
  if (dynamic_cast<torch::nn::LinearImpl*>(&module) != nullptr) return ModuleKind::kLinear;
  if (auto* e = dynamic_cast<torch::nn::EmbeddingImpl*>(&module)) {
    TORCH_CHECK(!e->options.max_norm().has_value(), style, ": module '", fqn,
                "': an Embedding with max_norm renormalizes whole rows, which a sharded weight does not hold");
    return ModuleKind::kEmbedding;
  }
  TORCH_CHECK(false, style, " currently only supports torch::nn::Linear and torch::nn::Embedding; module '", fqn,
              "' is ", module.name());
  return ModuleKind::kLinear;
}

// ---------------------------------------------------------------------------- Colwise

class ColwiseHook : public ParameterStyleHook {
 public:
  ColwiseHook(ModuleKind kind, Placement input_layout, Placement output_layout, bool use_local_output,
              StyleRedistributionPtr redistribution, mesh::DeviceMeshPtr mesh, std::string fqn)
      : kind_(kind),
        input_layout_(input_layout),
        output_layout_(output_layout),
        use_local_output_(use_local_output),
        redistribution_(OrDefault(std::move(redistribution))),
        mesh_(std::move(mesh)),
        fqn_(std::move(fqn)) {}

  void Partition(torch::nn::Module& module, std::optional<int> src_data_rank) {
    const int64_t weight_dim = kind_ == ModuleKind::kLinear ? 0 : 1;
    for (const auto& item : module.named_parameters(/*recurse=*/false)) {
      if (!item.value().defined()) continue;
      if (item.key() == "weight") global_columns_ = item.value().size(weight_dim);
      Distribute(module, item.key(), {Placement::Shard(item.key() == "weight" ? weight_dim : 0)}, mesh_, src_data_rank);
    }
  }

  std::vector<at::Tensor> PreForward(std::vector<at::Tensor> args) override {
    TORCH_CHECK(!args.empty(), "ColwiseParallel: module '", fqn_, "' got no tensor input");
    const LocalAnnotation in = InputLayout(args[0], mesh_, input_layout_, fqn_, "ColwiseParallel");
    // The Linear's input gradient is Partial (each rank holds some output columns), so one
    // collective in backward takes it to the input's layout.
    RedistributeGradLayouts grads{.output_grad = std::nullopt, .input_grad = in.grad_placements};
    if (kind_ == ModuleKind::kLinear) grads.output_grad = Placements{Placement::Partial()};
    args[0] = redistribution_->Input(args[0], in.spec, {Placement::Replicate()}, grads);
    return args;
  }

  void PostForward(const std::vector<at::Tensor*>& outputs) override {
    RequireOneOutput(outputs, fqn_, "ColwiseParallel");
    at::Tensor& out = *outputs[0];
    std::vector<int64_t> shape = out.sizes().vec();
    TORCH_CHECK(!shape.empty(), "ColwiseParallel: module '", fqn_, "' returned a 0-D tensor");
    shape.back() = global_columns_;
    const DTensorSpec spec =
        DTensorSpec::Make(mesh_, {Placement::Shard(out.dim() - 1)}, std::move(shape), out.scalar_type(), {});
    out = PrepareOutput(out, spec, output_layout_, use_local_output_, *redistribution_);
  }

 private:
  ModuleKind kind_;
  Placement input_layout_;
  Placement output_layout_;
  bool use_local_output_;
  StyleRedistributionPtr redistribution_;
  mesh::DeviceMeshPtr mesh_;
  std::string fqn_;
  int64_t global_columns_ = 0;
};

// ---------------------------------------------------------------------------- Rowwise

class RowwiseHook : public ParameterStyleHook {
 public:
  RowwiseHook(ModuleKind kind, torch::nn::Module& module, Placement input_layout, Placement output_layout,
              bool use_local_output, StyleRedistributionPtr redistribution, mesh::DeviceMeshPtr mesh, std::string fqn)
      : kind_(kind),
        module_(&module),
        input_layout_(input_layout),
        output_layout_(output_layout),
        use_local_output_(use_local_output),
        redistribution_(OrDefault(std::move(redistribution))),
        mesh_(std::move(mesh)),
        fqn_(std::move(fqn)) {}

  void Partition(std::optional<int> src_data_rank) {
    if (kind_ == ModuleKind::kLinear) {
      Distribute(*module_, "weight", {Placement::Shard(1)}, mesh_, src_data_rank);
      bias_ = OwnParameter(*module_, "bias");
      if (bias_.defined()) Distribute(*module_, "bias", {Placement::Replicate()}, mesh_, src_data_rank);
      return;
    }
    auto* embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(module_);
    TORCH_CHECK(!embedding->options.padding_idx().has_value(), "RowwiseParallel: module '", fqn_,
                "': an Embedding with padding_idx is not supported (the index is global, the shard's rows local)");
    const DTensorSpec spec = Distribute(*module_, "weight", {Placement::Shard(0)}, mesh_, src_data_rank);
    const LocalShapeAndOffset local = spec.local_shape_and_offset();
    row_begin_ = local.offset[0];
    row_end_ = row_begin_ + local.shape[0];
  }

  std::vector<at::Tensor> PreForward(std::vector<at::Tensor> args) override {
    TORCH_CHECK(!args.empty(), "RowwiseParallel: module '", fqn_, "' got no tensor input");
    const LocalAnnotation in = InputLayout(args[0], mesh_, input_layout_, fqn_, "RowwiseParallel");
    if (kind_ == ModuleKind::kLinear) {
      const Placements desired{Placement::Shard(args[0].dim() - 1)};
      args[0] = redistribution_->Input(args[0], in.spec, desired, {.input_grad = in.grad_placements});
      // The bias joins the partial sums in PostForward, once over the ranks.
      if (bias_.defined()) dynamic_cast<torch::nn::LinearImpl*>(module_)->bias = at::Tensor();
      return args;
    }
    at::Tensor ids = RedistributeLocal(args[0], in.spec, {Placement::Replicate()});
    // PyTorch's MaskPartial (torch/distributed/tensor/_ops/_embedding_ops.py): indices
    // outside this rank's rows look up row 0 and their output rows become zeros.
    mask_ = at::logical_or(ids < row_begin_, ids >= row_end_);
    args[0] = (ids - row_begin_).masked_fill(mask_, 0);
    return args;
  }

  void PostForward(const std::vector<at::Tensor*>& outputs) override {
    RequireOneOutput(outputs, fqn_, "RowwiseParallel");
    at::Tensor partial = *outputs[0];
    if (kind_ == ModuleKind::kLinear) {
      // The parameter itself (set_data and FSDP's unshard change its data, not the tensor).
      const at::Tensor& bias = bias_;
      if (bias.defined()) {
        dynamic_cast<torch::nn::LinearImpl*>(module_)->bias = bias;
        // Replicate -> Partial divides by the group size (Partial._partition_value); its
        // gradient is the output's, unscaled (Partial -> Replicate), as PyTorch's.
        const DTensorSpec replicated =
            DTensorSpec::Make(mesh_, {Placement::Replicate()}, bias.sizes().vec(), bias.scalar_type(), {});
        partial = partial + RedistributeLocal(bias, replicated, {Placement::Partial()});
      }
    } else {
      partial = partial.masked_fill(mask_.unsqueeze(-1), 0);
      mask_ = at::Tensor();
    }
    const DTensorSpec spec =
        DTensorSpec::Make(mesh_, {Placement::Partial()}, partial.sizes().vec(), partial.scalar_type(), {});
    *outputs[0] = PrepareOutput(partial, spec, output_layout_, use_local_output_, *redistribution_);
  }

 private:
  ModuleKind kind_;
  torch::nn::Module* module_;  // owns this hook
  Placement input_layout_;
  Placement output_layout_;
  bool use_local_output_;
  StyleRedistributionPtr redistribution_;
  mesh::DeviceMeshPtr mesh_;
  std::string fqn_;
  int64_t row_begin_ = 0;
  int64_t row_end_ = 0;
  at::Tensor mask_;
  at::Tensor bias_;  // Linear: the bias parameter, or undefined
};

// ---------------------------------------------------------------------------- Sequence

class SequenceHook : public ParameterStyleHook {
 public:
  SequenceHook(int64_t sequence_dim, bool use_local_output, mesh::DeviceMeshPtr mesh, std::string fqn)
      : sequence_dim_(sequence_dim),
        use_local_output_(use_local_output),
        mesh_(std::move(mesh)),
        fqn_(std::move(fqn)) {}

  void Partition(torch::nn::Module& module) {
    for (const auto& item : module.named_parameters(/*recurse=*/false)) {
      at::Tensor param = item.value();
      if (!param.defined()) continue;
      specs_.emplace_back(
          item.key(), DTensorSpec::Make(mesh_, {Placement::Replicate()}, param.sizes().vec(), param.scalar_type(), {}));
      if (!param.requires_grad() || mesh_->size() == 1) continue;
      // Each rank's gradient covers its slice of the sequence: Partial, summed here.
      comm::ProcessGroupPtr group = mesh_->group(0);
      param.register_hook([group](const at::Tensor& grad) {
        at::Tensor sum = grad.clone(at::MemoryFormat::Contiguous);
        group->all_reduce(sum)->wait();
        return sum;
      });
    }
  }

  std::vector<at::Tensor> PreForward(std::vector<at::Tensor> args) override {
    TORCH_CHECK(!args.empty(), "SequenceParallel: module '", fqn_, "' got no tensor input");
    const Placements sharding =
        ValidatePlacements({Placement::Shard(sequence_dim_)}, 1, args[0].dim(), "SequenceParallel sequence_dim");
    const LocalAnnotation in = InputLayout(args[0], mesh_, sharding[0], fqn_, "SequenceParallel");
    global_sequence_ = in.spec.shape[sharding[0].dim()];
    args[0] = RedistributeLocal(args[0], in.spec, sharding, {.input_grad = in.grad_placements});
    return args;
  }

  void PostForward(const std::vector<at::Tensor*>& outputs) override {
    if (use_local_output_) return;
    RequireOneOutput(outputs, fqn_, "SequenceParallel");
    const at::Tensor& out = *outputs[0];
    const Placements sharding =
        ValidatePlacements({Placement::Shard(sequence_dim_)}, 1, out.dim(), "SequenceParallel sequence_dim");
    std::vector<int64_t> shape = out.sizes().vec();
    shape[sharding[0].dim()] = global_sequence_;
    AnnotateLocal(out, {DTensorSpec::Make(mesh_, sharding, std::move(shape), out.scalar_type(), {}), sharding});
  }

 private:
  int64_t sequence_dim_;
  bool use_local_output_;
  mesh::DeviceMeshPtr mesh_;
  std::string fqn_;
  int64_t global_sequence_ = 0;
};

// ---------------------------------------------------------------------------- Prepare*

using Layouts = std::vector<std::optional<Placement>>;

void CheckLayoutCounts(const Layouts& given, const Layouts& desired, const char* style, const char* a, const char* b) {
  TORCH_CHECK(given.size() == desired.size(), style, ": ", a, " and ", b, " should have same length, got ",
              LayoutTuple(given), " and ", LayoutTuple(desired));
}

class PrepareInputHook : public ForwardHook {
 public:
  PrepareInputHook(Layouts input_layouts, Layouts desired, bool use_local_output, StyleRedistributionPtr redistribution,
                   mesh::DeviceMeshPtr mesh, std::string fqn)
      : input_layouts_(std::move(input_layouts)),
        desired_(std::move(desired)),
        use_local_output_(use_local_output),
        redistribution_(OrDefault(std::move(redistribution))),
        mesh_(std::move(mesh)),
        fqn_(std::move(fqn)) {}

  std::vector<at::Tensor> PreForward(std::vector<at::Tensor> args) override {
    TORCH_CHECK(args.size() == input_layouts_.size(), "PrepareModuleInput: module '", fqn_, "' got ", args.size(),
                " tensor inputs but input_layouts ", LayoutTuple(input_layouts_), " has ", input_layouts_.size(),
                " (module inputs and input_layouts should have same length)");
    for (size_t i = 0; i < args.size(); ++i) {
      if (!input_layouts_[i]) continue;
      const LocalAnnotation in = InputLayout(args[i], mesh_, *input_layouts_[i], fqn_, "PrepareModuleInput");
      const Placements dst = desired_[i] ? ValidatePlacements({*desired_[i]}, 1, args[i].dim(), "desired_input_layouts")
                                         : in.spec.placements;
      const Placements grad = use_local_output_ ? ReplicatePartials(dst) : PartialsForReplicates(dst);
      args[i] = redistribution_->Input(args[i], in.spec, dst, {.output_grad = grad, .input_grad = in.grad_placements});
      if (!use_local_output_) AnnotateLocal(args[i], {in.spec.WithPlacements(dst), grad});
    }
    return args;
  }

 private:
  Layouts input_layouts_;
  Layouts desired_;
  bool use_local_output_;
  StyleRedistributionPtr redistribution_;
  mesh::DeviceMeshPtr mesh_;
  std::string fqn_;
};

class PrepareOutputHook : public ForwardHook {
 public:
  PrepareOutputHook(Layouts output_layouts, Layouts desired, bool use_local_output, mesh::DeviceMeshPtr mesh,
                    std::string fqn)
      : output_layouts_(std::move(output_layouts)),
        desired_(std::move(desired)),
        use_local_output_(use_local_output),
        mesh_(std::move(mesh)),
        fqn_(std::move(fqn)) {}

  void PostForward(const std::vector<at::Tensor*>& outputs) override {
    TORCH_CHECK(outputs.size() == output_layouts_.size(), "PrepareModuleOutput: module '", fqn_, "' returned ",
                outputs.size(), " tensors but output_layouts ", LayoutTuple(output_layouts_), " has ",
                output_layouts_.size(), " (module outputs and output_layouts should have same length)");
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!output_layouts_[i]) continue;
      at::Tensor& out = *outputs[i];
      const LocalAnnotation in = InputLayout(out, mesh_, *output_layouts_[i], fqn_, "PrepareModuleOutput");
      const Placements dst =
          desired_[i] ? ValidatePlacements({*desired_[i]}, 1, out.dim(), "desired_output_layouts") : in.spec.placements;
      out = RedistributeLocal(out, in.spec, dst, {.input_grad = in.grad_placements});
      if (!use_local_output_) AnnotateLocal(out, {in.spec.WithPlacements(dst), ReplicatePartials(dst)});
    }
  }

 private:
  Layouts output_layouts_;
  Layouts desired_;
  bool use_local_output_;
  mesh::DeviceMeshPtr mesh_;
  std::string fqn_;
};

// ---------------------------------------------------------------------------- styles

void RequireNoParameterStyle(HookedModule& hooked, const std::string& fqn, const char* style) {
  TORCH_CHECK(hooked.FindForwardHook<ParameterStyleHook>() == nullptr, style, ": module '", fqn,
              "' already has its parameters distributed by a parallel style; one Colwise / Rowwise / "
              "SequenceParallel per module");
}

class ColwiseStyle : public ParallelStyle {
 public:
  explicit ColwiseStyle(LinearStyleOptions o) : o_(std::move(o)) {}
  void Apply(torch::nn::Module& module, const std::string& fqn, const mesh::DeviceMeshPtr& mesh) const override {
    RequireOneDimMesh(mesh, fqn, "ColwiseParallel");
    const ModuleKind kind = KindOf(module, fqn, "ColwiseParallel");
    HookedModule& hooked = RequireHooked(module, fqn, "ColwiseParallel");
    RequireNoParameterStyle(hooked, fqn, "ColwiseParallel");
    auto hook =
        std::make_shared<ColwiseHook>(kind, input(), output(), o_.use_local_output, o_.redistribution, mesh, fqn);
    hook->Partition(module, src_data_rank);
    hooked.AddForwardHook(std::move(hook));
  }
  std::string ToString() const override {
    return absl::StrCat("ColwiseParallel(input_layouts=", LayoutTuple(input()),
                        ", output_layouts=", LayoutTuple(output()), ", use_local_output=", PyBool(o_.use_local_output),
                        ")");
  }

 private:
  Placement input() const { return o_.input_layouts.value_or(Placement::Replicate()); }
  Placement output() const { return o_.output_layouts.value_or(Placement::Shard(-1)); }
  LinearStyleOptions o_;
};

class RowwiseStyle : public ParallelStyle {
 public:
  explicit RowwiseStyle(LinearStyleOptions o) : o_(std::move(o)) {}
  void Apply(torch::nn::Module& module, const std::string& fqn, const mesh::DeviceMeshPtr& mesh) const override {
    RequireOneDimMesh(mesh, fqn, "RowwiseParallel");
    const ModuleKind kind = KindOf(module, fqn, "RowwiseParallel");
    HookedModule& hooked = RequireHooked(module, fqn, "RowwiseParallel");
    RequireNoParameterStyle(hooked, fqn, "RowwiseParallel");
    const Placement in = o_.input_layouts.value_or(Placement::Shard(-1));
    auto hook =
        std::make_shared<RowwiseHook>(kind, module, in, output(), o_.use_local_output, o_.redistribution, mesh, fqn);
    hook->Partition(src_data_rank);
    hooked.AddForwardHook(std::move(hook));
  }
  std::string ToString() const override {
    return absl::StrCat("RowwiseParallel(input_layouts=", LayoutTuple(o_.input_layouts.value_or(Placement::Shard(-1))),
                        ", output_layouts=", LayoutTuple(output()), ", use_local_output=", PyBool(o_.use_local_output),
                        ")");
  }

 private:
  Placement output() const { return o_.output_layouts.value_or(Placement::Replicate()); }
  LinearStyleOptions o_;
};

class SequenceStyle : public ParallelStyle {
 public:
  explicit SequenceStyle(SequenceParallelOptions o) : o_(o) {}
  void Apply(torch::nn::Module& module, const std::string& fqn, const mesh::DeviceMeshPtr& mesh) const override {
    RequireOneDimMesh(mesh, fqn, "SequenceParallel");
    HookedModule& hooked = RequireHooked(module, fqn, "SequenceParallel");
    RequireNoParameterStyle(hooked, fqn, "SequenceParallel");
    auto hook = std::make_shared<SequenceHook>(o_.sequence_dim, o_.use_local_output, mesh, fqn);
    hook->Partition(module);
    hooked.AddForwardHook(std::move(hook));
  }
  std::string ToString() const override {
    return absl::StrCat("SequenceParallel(sequence_dim=", o_.sequence_dim,
                        ", use_local_output=", PyBool(o_.use_local_output), ")");
  }

 private:
  SequenceParallelOptions o_;
};

class PrepareInputStyle : public ParallelStyle {
 public:
  explicit PrepareInputStyle(PrepareModuleInputOptions o) : o_(std::move(o)) {
    CheckLayoutCounts(o_.input_layouts, o_.desired_input_layouts, "PrepareModuleInput", "input_layouts",
                      "desired_input_layouts");
  }
  void Apply(torch::nn::Module& module, const std::string& fqn, const mesh::DeviceMeshPtr& mesh) const override {
    RequireOneDimMesh(mesh, fqn, "PrepareModuleInput");
    RequireHooked(module, fqn, "PrepareModuleInput")
        .AddForwardHook(std::make_shared<PrepareInputHook>(o_.input_layouts, o_.desired_input_layouts,
                                                           o_.use_local_output, o_.redistribution, mesh, fqn));
  }
  std::string ToString() const override {
    return absl::StrCat("PrepareModuleInput(input_layouts=", LayoutTuple(o_.input_layouts),
                        ", desired_input_layouts=", LayoutTuple(o_.desired_input_layouts),
                        ", input_kwarg_layouts={}, desired_input_kwarg_layouts={}, use_local_output=",
                        PyBool(o_.use_local_output), ")");
  }

 private:
  PrepareModuleInputOptions o_;
};

class PrepareOutputStyle : public ParallelStyle {
 public:
  explicit PrepareOutputStyle(PrepareModuleOutputOptions o) : o_(std::move(o)) {
    CheckLayoutCounts(o_.output_layouts, o_.desired_output_layouts, "PrepareModuleOutput", "output_layouts",
                      "desired_output_layouts");
  }
  void Apply(torch::nn::Module& module, const std::string& fqn, const mesh::DeviceMeshPtr& mesh) const override {
    RequireOneDimMesh(mesh, fqn, "PrepareModuleOutput");
    RequireHooked(module, fqn, "PrepareModuleOutput")
        .AddForwardHook(std::make_shared<PrepareOutputHook>(o_.output_layouts, o_.desired_output_layouts,
                                                            o_.use_local_output, mesh, fqn));
  }
  std::string ToString() const override {
    return absl::StrCat("PrepareModuleOutput(output_layouts=", LayoutTuple(o_.output_layouts),
                        ", desired_output_layouts=", LayoutTuple(o_.desired_output_layouts),
                        ", use_local_output=", PyBool(o_.use_local_output), ")");
  }

 private:
  PrepareModuleOutputOptions o_;
};

class PrepareInputOutputStyle : public ParallelStyle {
 public:
  explicit PrepareInputOutputStyle(PrepareModuleInputOutputOptions o)
      : input_({o.input_layouts, o.desired_input_layouts, o.use_local_input, nullptr}),
        output_({o.output_layouts, o.desired_output_layouts, o.use_local_output}) {}
  void Apply(torch::nn::Module& module, const std::string& fqn, const mesh::DeviceMeshPtr& mesh) const override {
    input_.Apply(module, fqn, mesh);
    output_.Apply(module, fqn, mesh);
  }
  std::string ToString() const override {
    return absl::StrCat("PrepareModuleInputOutput(", input_.ToString(), ", ", output_.ToString(), ")");
  }

 private:
  PrepareInputStyle input_;
  PrepareOutputStyle output_;
};

}  // namespace

ParallelStylePtr ColwiseParallel(LinearStyleOptions options) {
  return std::make_shared<ColwiseStyle>(std::move(options));
}
ParallelStylePtr RowwiseParallel(LinearStyleOptions options) {
  return std::make_shared<RowwiseStyle>(std::move(options));
}
ParallelStylePtr SequenceParallel(SequenceParallelOptions options) { return std::make_shared<SequenceStyle>(options); }
ParallelStylePtr PrepareModuleInput(PrepareModuleInputOptions options) {
  return std::make_shared<PrepareInputStyle>(std::move(options));
}
ParallelStylePtr PrepareModuleOutput(PrepareModuleOutputOptions options) {
  return std::make_shared<PrepareOutputStyle>(std::move(options));
}
ParallelStylePtr PrepareModuleInputOutput(PrepareModuleInputOutputOptions options) {
  return std::make_shared<PrepareInputOutputStyle>(std::move(options));
}

}  // namespace fsdp::tensor_parallel
