#include "distributed_parameters/distributed_parameters.h"

#include "fsdp/hooked_module/hooked_module.h"

namespace fsdp::distributed_parameters {

const DistributedParameterModule* FindDistributedParameters(torch::nn::Module& module) {
  if (const auto* own = dynamic_cast<const DistributedParameterModule*>(&module)) return own;
  return FindForwardHook<DistributedParameterModule>(module).get();
}

absl::flat_hash_map<const c10::TensorImpl*, dtensor::DTensorSpec> DistributedParameterSpecs(torch::nn::Module& root) {
  absl::flat_hash_map<const c10::TensorImpl*, dtensor::DTensorSpec> out;
  for (const auto& m : root.modules(/*include_self=*/true)) {
    const auto* distributed = FindDistributedParameters(*m);
    if (distributed == nullptr) continue;
    const auto own = m->named_parameters(/*recurse=*/false);
    for (const auto& [name, spec] : distributed->named_parameter_specs()) {
      if (const at::Tensor* p = own.find(name); p != nullptr && p->defined())
        out.emplace(p->unsafeGetTensorImpl(), spec);
    }
  }
  return out;
}

}  // namespace fsdp::distributed_parameters
