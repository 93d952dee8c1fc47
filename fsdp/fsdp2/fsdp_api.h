// FSDP2's user policies and options in one header (PyTorch's
// torch/distributed/fsdp/_fully_shard/_fsdp_api.py and fully_shard's arguments):
// MixedPrecisionPolicy, OffloadPolicy, DataParallelMeshDims, FullyShardOptions.
#ifndef FSDP_FSDP_FSDP2_FSDP_API_H_
#define FSDP_FSDP_FSDP2_FSDP_API_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "device/stream.h"
#include "mesh/device_mesh.h"

namespace fsdp {

// As PyTorch's MixedPrecisionPolicy (FSDP2): unset dtypes mean "no cast".
struct MixedPrecisionPolicy {
  std::optional<c10::ScalarType> param_dtype;   // unsharded parameters / forward compute
  std::optional<c10::ScalarType> reduce_dtype;  // gradient reduction
  std::optional<c10::ScalarType> output_dtype;  // cast of forward outputs
  bool cast_forward_inputs = true;              // cast floating inputs to param_dtype
};

}  // namespace fsdp

namespace fsdp::fsdp2 {

// As PyTorch's CPUOffloadPolicy: sharded parameters and gradients live on the CPU and are
// copied to the compute device for the all-gather (on a CPU-only build both are the CPU,
// so offloading changes no data movement). `pin_memory`: the CPU copies are page-locked so
// those copies are asynchronous (only when the compute device is not the CPU).
struct OffloadPolicy {
  bool offload_to_cpu = false;
  bool pin_memory = false;
};

// Names of the data-parallel dims of an SPMD mesh (PyTorch's DataParallelMeshDims): each
// of `shard` and `replicate` is one dim name or several (`{"dp_shard", "cp"}`), several being
// flattened into one dim as PyTorch does (their names in mesh order, joined by '_'). `shard`
// only: FSDP; both: HSDP (the replicate dims before the shard dims); `replicate` only: DDP.
// At least one is set.
struct DataParallelMeshDims {
  // Implicit from one name or a braced list of names, as Python's `str | tuple[str, ...]`.
  struct Names {
    Names() = default;
    Names(const char* name) : names{name} {}             // NOLINT(google-explicit-constructor)
    Names(std::string name) : names{std::move(name)} {}  // NOLINT(google-explicit-constructor)
    Names(std::initializer_list<std::string> list) : names(list) {}
    std::vector<std::string> names;
  };
  Names shard;
  Names replicate;
};

struct FullyShardOptions {
  // 1-D: FSDP over it. 2-D with dim names: HSDP (replicate over dim 0, shard over dim 1).
  mesh::DeviceMeshPtr mesh;
  // true: reshard after forward; false: keep unsharded until after backward; an int k:
  // reshard to groups of k ranks (a factor of the shard size). Unset: true, except for the
  // root, which keeps its parameters (as PyTorch).
  std::optional<std::variant<bool, int64_t>> reshard_after_forward;
  // Returns the dim to shard a parameter on (default 0); only dim 0 may be uneven.
  std::function<std::optional<int64_t>(const at::Tensor& param, const std::string& name)> shard_placement_fn;
  MixedPrecisionPolicy mp_policy;
  OffloadPolicy offload_policy;
  std::vector<at::Tensor> ignored_params;
  // Replicate instead of shard (FSDP2's replicate(): DDP mesh info). Requires a 1-D mesh.
  bool replicate = false;
  // SPMD: `mesh` is the whole SPMD mesh (any number of named dims), every parameter is a
  // DTensor on it (a DistributedParameterModule spec) with Replicate on these dims, and
  // FSDP shards over `shard` and replicates over `replicate` (DataParallelMeshDims).
  std::optional<DataParallelMeshDims> dp_mesh_dims;
  // Parameters must already live here, or on the meta device: then only this rank's shard
  // is allocated, here, and filled by fsdp::fsdp2::InitMetaParameters or a state dict
  // load (fsdp/fsdp2/meta_init.h).
  c10::Device device = c10::Device(c10::kCPU);
  // The streams FSDP issues its collectives on (the root's options serve the whole tree).
  // On the CPU: inline (default) or asynchronous worker threads; the environment variable
  // FSDP_CPU_STREAMS ("inline", "async", "async:<microseconds>") overrides it, for debugging
  // (device::ApplyStreamEnvOverride).
  device::StreamOptions stream_options;
  // The non-finite gradient sentinel (no PyTorch counterpart; off by default). On: before
  // reducing, each parameter's unreduced gradient gets a NaN/Inf flag (on its device, no host
  // sync), and the end-of-backward callback, where the host already waits for the
  // reductions, all-gathers the flags over the world once; any flag fails every rank's
  // backward with one c10::Error naming the first such parameter (module order), the ranks
  // whose unreduced gradient held it, and the backward step. Set it on every fully_shard
  // call alike (it is per parameter group).
  bool detect_nonfinite_grads = false;
};

}  // namespace fsdp::fsdp2

#endif  // FSDP_FSDP_FSDP2_FSDP_API_H_
