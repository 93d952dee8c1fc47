// Tensor parallelism for torch::nn::Linear: PyTorch's ColwiseParallel / RowwiseParallel
// (torch/distributed/tensor/parallel/style.py) as a module that holds this rank's shard.
#ifndef FSDP_TENSOR_PARALLEL_TENSOR_PARALLEL_H_
#define FSDP_TENSOR_PARALLEL_TENSOR_PARALLEL_H_

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <iosfwd>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/distributed_parameters.h"
#include "dtensor/dtensor_spec.h"
#include "mesh/device_mesh.h"

namespace fsdp::dtensor {

enum class TensorParallelStyle {
  // Weight and bias Shard(0): input replicated [*, in], output this rank's Shard(-1) of
  // [*, out]. Backward all-reduces the input's gradient (Megatron's "f").
  kColwise,
  // Weight Shard(1), bias Replicate: input this rank's Shard(-1) of [*, in], output
  // replicated [*, out] (all-reduce of the partial products; Megatron's "g").
  kRowwise,
};
// "colwise", "rowwise".
const char* TensorParallelStyleName(TensorParallelStyle style);

// A Linear whose "weight" and "bias" parameters are this rank's shards over a 1-D tensor
// parallel mesh. The FQNs are the Linear's, so state-dict keys and optimizers see the same
// names; forward takes and returns plain local tensors (use_local_output semantics).
// Shards follow torch.chunk: uneven sizes and empty shards are allowed.
class TensorParallelLinearImpl : public torch::nn::Module, public DistributedParameterModule {
 public:
  // Collective over tp_mesh (distribute_tensor broadcasts rank 0's weights, so ranks that
  // start from different initializations still agree). The parameters are fresh leaves
  // with the requires_grad of the originals; `linear` is not modified.
  TensorParallelLinearImpl(const torch::nn::Linear& linear, mesh::DeviceMeshPtr tp_mesh, TensorParallelStyle style);

  // Colwise: x [*, in_features] (the same on every rank) -> [*, local out columns].
  // Rowwise: x [*, local in columns] -> [*, out_features] (the same on every rank);
  // collective over the mesh. A wrong last dimension is a c10::Error naming both sizes.
  at::Tensor forward(const at::Tensor& x);

  TensorParallelStyle style() const { return style_; }
  const mesh::DeviceMeshPtr& tp_mesh() const { return mesh_; }
  int64_t in_features() const { return in_features_; }    // global
  int64_t out_features() const { return out_features_; }  // global
  // The last dimension forward() accepts on this rank.
  int64_t local_in_features() const;

  // The DTensor layout of parameter `name` ("weight" or "bias"); throws naming the known
  // parameters otherwise.
  const DTensorSpec& parameter_spec(const std::string& name) const;
  std::vector<std::pair<std::string, DTensorSpec>> named_parameter_specs() const override;

  // "fsdp::dtensor::TensorParallelLinear(in_features=6, out_features=7, style=colwise,
  // tp=2, bias=true)".
  void pretty_print(std::ostream& stream) const override;

  at::Tensor weight;  // local shard
  at::Tensor bias;    // local shard (colwise) or full (rowwise); undefined without bias

 private:
  TensorParallelStyle style_;
  mesh::DeviceMeshPtr mesh_;
  int64_t in_features_;
  int64_t out_features_;
  std::vector<std::pair<std::string, DTensorSpec>> specs_;
};
TORCH_MODULE(TensorParallelLinear);

// Builds the tensor-parallel version of `linear` over `tp_mesh` (must be 1-D).
// Collective over tp_mesh.
TensorParallelLinear ParallelizeLinear(const torch::nn::Linear& linear, mesh::DeviceMeshPtr tp_mesh,
                                       TensorParallelStyle style);

}  // namespace fsdp::dtensor

#endif  // FSDP_TENSOR_PARALLEL_TENSOR_PARALLEL_H_
