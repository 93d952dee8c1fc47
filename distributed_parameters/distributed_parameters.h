// The DTensor layouts of parameters that are local shards: how FSDP2, DCP, the optimizer-state
// conversions and gradient clipping find the layout of a parameter another mechanism (a
// tensor-parallel style, an SPMD model) distributed, knowing only DTensor specs.
//
// LibTorch parameters cannot carry a DTensorSpec, so whoever shards a module's parameters in
// place publishes their layouts through DistributedParameterModule: the module itself
// implements it, or a forward hook attached to it does (the tensor-parallel styles,
// tensor_parallel/parallel_style.h). The module's own implementation wins over its hooks', so a
// model can restate the layouts a style's hook reports, e.g. on a larger mesh (the SPMD-mesh
// path of fully_shard's dp_mesh_dims, fsdp/fsdp2/fsdp_api.h).
//
// Thread-safety: the lookups read the module tree; they race with a thread that adds modules
// or hooks. Errors: none (a module with neither is simply not distributed).
#ifndef FSDP_DISTRIBUTED_PARAMETERS_DISTRIBUTED_PARAMETERS_H_
#define FSDP_DISTRIBUTED_PARAMETERS_DISTRIBUTED_PARAMETERS_H_

#include <torch/nn/module.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "dtensor/dtensor_spec.h"

namespace fsdp::distributed_parameters {

// A module, or a forward hook of one, whose module's registered parameters are local shards
// of DTensors.
class DistributedParameterModule {
 public:
  virtual ~DistributedParameterModule() = default;
  // (name, spec) for each of the module's own parameters that is a DTensor shard, named as in
  // named_parameters(/*recurse=*/false).
  virtual std::vector<std::pair<std::string, dtensor::DTensorSpec>> named_parameter_specs() const = 0;
};

// The DistributedParameterModule of `module`: the module itself, or else the forward hook
// (fsdp/hooked_module/hooked_module.h) that implements it; null if neither.
const DistributedParameterModule* FindDistributedParameters(torch::nn::Module& module);

// The spec of every distributed parameter in root's module tree (root included), by tensor:
// how a state dict, a checkpoint or a gradient clip that sees only root finds the layout of a
// distributed parameter no fully_shard manages.
absl::flat_hash_map<const c10::TensorImpl*, dtensor::DTensorSpec> DistributedParameterSpecs(torch::nn::Module& root);

}  // namespace fsdp::distributed_parameters

#endif  // FSDP_DISTRIBUTED_PARAMETERS_DISTRIBUTED_PARAMETERS_H_
