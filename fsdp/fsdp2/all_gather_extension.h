// All-gather extensions: a parameter that all-gathers something other than its own data
// (e.g. quantized values and scales) and rebuilds the unsharded parameter from it
// (PyTorch's fsdp_pre_all_gather / fsdp_post_all_gather on a tensor subclass).
//
// LibTorch parameters cannot carry methods, so the module that owns such a parameter
// provides the extension: it (or its forward replacement, fsdp/hooked_module/hooked_module.h)
// implements AllGatherExtensionProvider, and fully_shard asks it once per parameter.
#ifndef FSDP_FSDP_FSDP2_ALL_GATHER_EXTENSION_H_
#define FSDP_FSDP_FSDP2_ALL_GATHER_EXTENSION_H_

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <memory>
#include <string>
#include <vector>

#include "fsdp/fsdp2/fsdp_api.h"
#include "mesh/device_mesh.h"

namespace fsdp::fsdp2 {

class AllGatherExtension {
 public:
  struct PreAllGatherResult {
    // Tensors to all-gather over the shard group (any dtypes and shapes; gathered along
    // dim 0). When the parameter is sharded unevenly, each must have the padded sharded
    // size (PyTorch's rule: ranks with padding would otherwise gather mismatched sizes).
    std::vector<at::Tensor> inputs;
    // Handed to PostAllGather of the same unshard.
    c10::IValue metadata;
  };

  virtual ~AllGatherExtension() = default;

  // Called before each all-gather with this rank's sharded parameter (unpadded rows, the
  // original dtype), the FSDP mesh (2-D for HSDP), the unsharded size and the group's
  // mixed-precision policy.
  virtual PreAllGatherResult PreAllGather(const at::Tensor& sharded_param, const mesh::DeviceMesh& shard_mesh,
                                          const std::vector<int64_t>& orig_size,
                                          const MixedPrecisionPolicy& mp_policy) = 0;

  // Called after each all-gather with the gathered inputs (input i of every rank stacked
  // along dim 0, in rank order) and the metadata. Returns the unsharded parameter data,
  // either
  //  - a contiguous tensor of the unsharded numel in `param_dtype`. `out` is undefined the
  //    first time; afterwards it is the tensor returned the first time (its storage
  //    re-allocated): write into it and return it, since autograd may hold views of it; or
  //  - a placeholder: a tensor of the unsharded size in `param_dtype` whose strides are all 0
  //    (one element, expanded), for an extension whose module reads the gathered values from
  //    the extension itself (float8's weights, float8/fsdp_float8.h). FSDP registers it as
  //    the unsharded parameter, so autograd still accumulates the parameter's gradient, and
  //    allocates no unsharded storage. The gathered outputs are views of FSDP's all-gather
  //    buffer when there is one input: they stay valid while the parameter is unsharded, and
  //    a view saved for backward sees the data of the next unshard (same storage).
  virtual at::Tensor PostAllGather(const std::vector<at::Tensor>& outputs, const c10::IValue& metadata,
                                   c10::ScalarType param_dtype, const at::Tensor& out) = 0;
};

// Implemented by modules whose parameters need an all-gather extension.
class AllGatherExtensionProvider {
 public:
  virtual ~AllGatherExtensionProvider() = default;
  // The extension for this module's own parameter `param_name` (as in
  // named_parameters(/*recurse=*/false)), or null for the default all-gather.
  virtual std::shared_ptr<AllGatherExtension> all_gather_extension(const std::string& param_name) const = 0;
};

}  // namespace fsdp::fsdp2

#endif  // FSDP_FSDP_FSDP2_ALL_GATHER_EXTENSION_H_
