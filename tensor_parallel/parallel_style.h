// Tensor-parallel styles: PyTorch 2.15's torch/distributed/tensor/parallel/style.py for
// fsdp::Hooked modules.
//
//   using Linear = fsdp::Hooked<torch::nn::LinearImpl>;   // a Linear that runs hooks
//   tensor_parallel::parallelize_module(*block, tp_mesh, {{"w1", tensor_parallel::ColwiseParallel()},
//                                                 {"w2", tensor_parallel::RowwiseParallel()}});
//
// A style distributes the module's parameters in place (the same tensors, now holding this
// rank's shard: FQNs, optimizers and module members keep working) and attaches a forward
// hook (fsdp/hooked_module/hooked_module.h) that redistributes the inputs and outputs as
// PyTorch's style's input_fn / output_fn do. LibTorch has no tensor subclass, so a module's
// forward sees and returns local tensors; what PyTorch carries in a DTensor travels beside
// them:
//   * with use_local_output = false a style's output is a local tensor annotated with its
//     DTensor layout (tensor_parallel/local_annotation.h); a later style treats an annotated input
//     as PyTorch treats a DTensor input (its own layout wins over input_layouts), and
//     AsDTensor(tensor) returns it (e.g. for LossParallelCrossEntropy);
//   * the gradient layout is fixed per style, as DTensor's sharding rules make it: the
//     input gradient of a column-sharded Linear is Partial where the input was Replicate,
//     and PrepareModuleInput with use_local_output = false expects the module to consume
//     its Replicate inputs through parallel-style submodules, whose gradients arrive
//     Partial (one reduce-scatter for q, k and v together, as in PyTorch). A plain op on
//     such an input inside the module would have its gradient counted once per rank: give
//     that module use_local_output = true instead.
//   * a Replicate parameter whose gradient is Partial (SequenceParallel's norm weights:
//     each rank sees a slice of the sequence) is all-reduced as its gradient is
//     accumulated; PyTorch keeps the Partial DTensor and reduces it at the optimizer step,
//     clip or FSDP's post-backward. The same collective, earlier; the gradient in .grad is
//     the full one.
//
// Contract: Apply is collective over the mesh (parameters are broadcast from
// src_data_rank, as distribute_tensor); one parameter-distributing style per module
// (Colwise / Rowwise / Sequence), any number of PrepareModule* styles. Errors (c10::Error)
// name the module's FQN: a module that runs no hooks, a module type a style cannot take,
// a mesh that is not 1-D, an input or output count that differs from the layouts given.
// The hooks are not thread-safe (one module, one forward at a time), as FSDP's.
#ifndef FSDP_TENSOR_PARALLEL_PARALLEL_STYLE_H_
#define FSDP_TENSOR_PARALLEL_PARALLEL_STYLE_H_

#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/dtensor.h"
#include "dtensor/dtensor_spec.h"
#include "dtensor/placement.h"
#include "mesh/device_mesh.h"

namespace fsdp::tensor_parallel {

// How a style moves its module's input and output between layouts: the redistribute calls
// of PyTorch's styles' _prepare_input_fn / _prepare_output_fn. The default is DTensor's
// redistribute (dtensor::RedistributeLocal); torchao's float8 styles
// (float8/float8_parallel_style.h) cast to float8 around it, as their Python subclasses
// override those two static methods. Called from the styles' hooks, on the forward's thread.
class StyleRedistribution {
 public:
  virtual ~StyleRedistribution() = default;
  // The module's input `local`, laid out as `src`, to `dst`; its gradient arrives as
  // grads.output_grad and leaves as grads.input_grad.
  virtual at::Tensor Input(const at::Tensor& local, const dtensor::DTensorSpec& src, const dtensor::Placements& dst,
                           const dtensor::RedistributeGradLayouts& grads) const;
  // The module's output `local`, laid out as `src`, to `dst` (its gradient: Replicate where
  // a placement is Partial).
  virtual at::Tensor Output(const at::Tensor& local, const dtensor::DTensorSpec& src,
                            const dtensor::Placements& dst) const;
};
using StyleRedistributionPtr = std::shared_ptr<const StyleRedistribution>;

// PyTorch's ParallelStyle.
class ParallelStyle {
 public:
  virtual ~ParallelStyle() = default;
  // Parallelizes `module` (named `fqn` in errors) over the 1-D `mesh`.
  virtual void Apply(torch::nn::Module& module, const std::string& fqn, const mesh::DeviceMeshPtr& mesh) const = 0;
  // PyTorch's repr, e.g. "ColwiseParallel(input_layouts=(Replicate(),), ...)".
  virtual std::string ToString() const = 0;

  // The rank whose data distribute_tensor broadcasts (per mesh dim); nullopt: each rank
  // keeps its own values. parallelize_module sets it on every style it applies.
  std::optional<int> src_data_rank = 0;
};
using ParallelStylePtr = std::shared_ptr<ParallelStyle>;

// Colwise / Rowwise: for Linear (weight [out, in]) and Embedding (weight [num, dim]).
struct LinearStyleOptions {
  // The layout of the module's input when it is a plain local tensor. Colwise default
  // Replicate; Rowwise default Shard(-1), for an Embedding too (PyTorch's: its indices are
  // then all-gathered along the last dim; pass Replicate for indices every rank holds).
  std::optional<dtensor::Placement> input_layouts;
  // The layout of the output. Colwise default Shard(-1), Rowwise default Replicate.
  std::optional<dtensor::Placement> output_layouts;
  bool use_local_output = true;
  // How the input and output move (null: DTensor's redistribute).
  StyleRedistributionPtr redistribution;
};

// Linear: weight and bias Shard(0), input -> Replicate, output Shard(-1) -> output_layouts.
// Embedding: weight Shard(1), indices -> Replicate, output Shard(-1) -> output_layouts.
ParallelStylePtr ColwiseParallel(LinearStyleOptions options = {});
// Linear: weight Shard(1), bias Replicate, input -> Shard(-1), output Partial ->
// output_layouts. Embedding: weight Shard(0) (rows outside this rank's range give zeros,
// PyTorch's MaskPartial), indices -> Replicate, output Partial -> output_layouts.
ParallelStylePtr RowwiseParallel(LinearStyleOptions options = {});

struct SequenceParallelOptions {
  int64_t sequence_dim = 1;
  bool use_local_output = false;
};
// Any module (LayerNorm, RMSNorm, a user's norm): parameters Replicate (each rank keeps
// its values, as PyTorch's from_local), input and output Shard(sequence_dim).
ParallelStylePtr SequenceParallel(SequenceParallelOptions options = {});

// One entry per positional forward argument; nullopt leaves that argument alone. The C++
// forward has no keyword arguments, so PyTorch's input_kwarg_layouts has no counterpart.
struct PrepareModuleInputOptions {
  std::vector<std::optional<dtensor::Placement>> input_layouts;
  std::vector<std::optional<dtensor::Placement>> desired_input_layouts;
  bool use_local_output = false;
  // How the inputs move (null: DTensor's redistribute).
  StyleRedistributionPtr redistribution;
};
ParallelStylePtr PrepareModuleInput(PrepareModuleInputOptions options);

// One entry per output tensor (fsdp::ForwardTensors order).
struct PrepareModuleOutputOptions {
  std::vector<std::optional<dtensor::Placement>> output_layouts;
  std::vector<std::optional<dtensor::Placement>> desired_output_layouts;
  bool use_local_output = true;
};
ParallelStylePtr PrepareModuleOutput(PrepareModuleOutputOptions options);

struct PrepareModuleInputOutputOptions {
  std::vector<std::optional<dtensor::Placement>> input_layouts;
  std::vector<std::optional<dtensor::Placement>> desired_input_layouts;
  bool use_local_input = false;
  std::vector<std::optional<dtensor::Placement>> output_layouts;
  std::vector<std::optional<dtensor::Placement>> desired_output_layouts;
  bool use_local_output = true;
};
ParallelStylePtr PrepareModuleInputOutput(PrepareModuleInputOutputOptions options);

}  // namespace fsdp::tensor_parallel

#endif  // FSDP_TENSOR_PARALLEL_PARALLEL_STYLE_H_
