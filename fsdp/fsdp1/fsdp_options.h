// Options of FSDP1's wrapper (PyTorch's FullyShardedDataParallel constructor arguments).
#ifndef FSDP_FSDP_FSDP1_FSDP_OPTIONS_H_
#define FSDP_FSDP_FSDP1_FSDP_OPTIONS_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <variant>
#include <vector>

#include "comm/process_group.h"
#include "device/stream.h"
#include "mesh/device_mesh.h"

namespace torch::nn {
class Module;
}

namespace fsdp::fsdp1 {

// PyTorch's sharding strategies. PyTorch's `_HYBRID_SHARD_ZERO2` is spelled
// HYBRID_SHARD_ZERO2 (a leading underscore + capital is reserved in C++); ToString gives
// PyTorch's spelling.
enum class ShardingStrategy { FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2 };
const char* ToString(ShardingStrategy s);

// A communication hook replaces the default gradient reduction (pre-divide, reduce-scatter
// or all-reduce, post-divide; PyTorch's register_comm_hook): sharded strategies call
// hook(group, padded_unsharded_grad, sharded_grad_out) and the hook must fill
// sharded_grad_out (this rank's chunk); NO_SHARD calls hook(group, grad, undefined) and the
// hook reduces `grad` in place. Gradients arrive in the reduce dtype; FSDP casts the result
// to the parameter dtype afterwards. `group` is the handle's process group.
using CommHook =
    std::function<void(const comm::ProcessGroupPtr& group, const at::Tensor& grad, const at::Tensor& output)>;

// Which unsharded flat parameter to all-gather ahead in backward (PyTorch's BackwardPrefetch):
// BACKWARD_PRE: the next module's (in reverse post-forward order) in this module's
// pre-backward, before its gradient computation (more overlap, more memory);
// BACKWARD_POST: in this module's post-backward, after its gradient computation.
enum class BackwardPrefetch { BACKWARD_PRE, BACKWARD_POST };
const char* ToString(BackwardPrefetch p);

struct CPUOffload {
  // Sharded parameters and gradients live on the CPU; unsharded ones on `device`.
  bool offload_params = false;
};

// PyTorch's FSDP1 MixedPrecision (torch/distributed/fsdp/api.py).
struct MixedPrecision {
  std::optional<c10::ScalarType> param_dtype;   // unsharded parameters / forward compute
  std::optional<c10::ScalarType> reduce_dtype;  // gradient reduction (unset: param_dtype)
  // Floating buffers of the module's tree (not ignored, not owned by a wrapped descendant
  // with its own setting) are cast to it in place at the root's lazy init, and back to their
  // original dtype for eval forwards that force full precision (use_full_prec_in_eval)
  // (torch/distributed/fsdp/_runtime_utils.py: _lazy_init, _root_pre_forward,
  // _get_buffers_and_dtypes_for_computation). Full state dicts hold them in their dtype at
  // wrap time (_get_orig_buffer_dtypes in the state-dict hooks); the module keeps the cast ones.
  std::optional<c10::ScalarType> buffer_dtype;
  bool keep_low_precision_grads = false;
  bool cast_forward_inputs = false;      // every FSDP module casts its floating inputs
  bool cast_root_forward_inputs = true;  // the root casts its floating inputs
};

// PyTorch's auto-wrap policy callable: called with recurse = true to ask whether to look
// into `module`'s children, and with recurse = false whether to wrap `module` itself, given
// the number of its parameters' elements not yet wrapped by a descendant.
using AutoWrapPolicy = std::function<bool(torch::nn::Module& module, bool recurse, int64_t nonwrapped_numel)>;

// One entry of FSDPOptions::ignored_states: a parameter or a module.
using IgnoredState = std::variant<at::Tensor, std::shared_ptr<torch::nn::Module>>;

struct FSDPOptions {
  // FULL_SHARD / SHARD_GRAD_OP / NO_SHARD: the data-parallel group. Hybrid strategies: the
  // intra-node (shard) group, with inter_node_group the replica group; or give device_mesh.
  comm::ProcessGroupPtr process_group;
  comm::ProcessGroupPtr inter_node_group;
  // Instead of process groups: a 1-D mesh, or for hybrid strategies a 2-D mesh whose dim 0
  // replicates (inter-node) and dim 1 shards (intra-node).
  mesh::DeviceMeshPtr device_mesh;
  // World size 1 (non-hybrid) always uses NO_SHARD, as PyTorch.
  ShardingStrategy sharding_strategy = ShardingStrategy::FULL_SHARD;
  CPUOffload cpu_offload;
  std::optional<MixedPrecision> mixed_precision;
  std::optional<BackwardPrefetch> backward_prefetch = BackwardPrefetch::BACKWARD_PRE;  // nullopt: none
  bool forward_prefetch = false;
  bool limit_all_gathers = true;
  // true: the optimizer takes the original parameters (flattened views of this rank's part of
  // the flat parameter between steps); false: the flat parameters.
  bool use_orig_params = false;
  // The compute and communication device; parameters must already be on it.
  c10::Device device = c10::Device(c10::kCPU);
  // Wraps the submodules the policy selects first, with these options (see wrap_fsdp).
  AutoWrapPolicy auto_wrap_policy;
  // PyTorch's ignored_modules / ignored_states (torch/distributed/fsdp/_init_utils.py,
  // _init_ignored_module_states): the parameters of these modules' subtrees (or the given
  // parameters) are not flattened or sharded: they stay full, plain tensors on every rank,
  // their gradients are not reduced, buffer_dtype does not cast the modules' buffers,
  // auto-wrap neither wraps nor counts them (auto-wrapped children ignore the same
  // parameters), and state dicts hold them as they are. A wrapped descendant's ignored
  // states are ignored here too. Set at most one of the two; ignored_states holds either
  // only parameters or only modules; a module already wrapped with FSDP cannot be ignored.
  std::optional<std::vector<std::shared_ptr<torch::nn::Module>>> ignored_modules;
  std::optional<std::vector<IgnoredState>> ignored_states;
  // Deferred init (PyTorch's param_init_fn): when the modules this FSDP module manages hold
  // parameters or buffers on the meta device (fsdp/meta/meta.h), each of those modules, in
  // breadth-first order from the wrapped module (not descending into wrapped descendants, as
  // PyTorch's _get_modules_to_materialize), gets its own meta tensors allocated on the device
  // (uninitialized) and is passed to param_init_fn, which must fill them; then they are
  // flattened and sharded. With auto_wrap_policy, each unit is materialized when it is
  // wrapped (children first), so one unit is whole at a time. Required when meta tensors are
  // present (LibTorch modules share no reset_parameters(), which PyTorch falls back to).
  std::function<void(torch::nn::Module&)> param_init_fn;
  // The non-finite gradient sentinel (no PyTorch counterpart; off by default). On: before
  // reducing, each original parameter's part of the unreduced flat gradient gets a NaN/Inf
  // flag, and the root's end-of-backward callback all-gathers the flags over its process
  // group once; any flag fails every rank's backward with one c10::Error naming the first
  // such parameter (module order), the group ranks whose unreduced gradient held it, and the
  // backward step. Give every wrap_fsdp of a tree the same value.
  bool detect_nonfinite_grads = false;
  // PyTorch's sync_module_states (torch/distributed/fsdp/_init_utils.py,
  // _sync_module_params_and_buffers): at wrap time, after deferred init and before
  // flattening, rank 0 of the process group broadcasts the parameters this FSDP module manages
  // and the buffers of its tree not yet synced by a wrapped descendant, so ranks that
  // initialized differently start identical. Hybrid strategies broadcast over the inter-node
  // group first, then the intra-node group (PyTorch's order). Collective: every rank wraps the
  // same modules in the same order. Unlike PyTorch, CPU tensors are allowed (the CPU backends
  // here broadcast them; PyTorch's NCCL needs GPU tensors and raises for CPU ones).
  bool sync_module_states = false;
  // The root's streams (unshard / post-backward / all-reduce; the root's options serve the
  // tree). The environment variable FSDP_CPU_STREAMS overrides them, for debugging
  // (device::ApplyStreamEnvOverride).
  device::StreamOptions stream_options;
  // Eval-mode forwards (torch::NoGradGuard / module not training) use full precision despite
  // mixed_precision. PyTorch reads this from the environment variable
  // FSDP_USE_FULL_PREC_IN_EVAL=1, which also turns it on here.
  bool use_full_prec_in_eval = false;
  // use_orig_params: skip the check that original parameters were not replaced by other
  // tensors between steps (PyTorch's FSDP_SKIP_WRITEBACK_CHECK=1, which also turns it on).
  bool skip_writeback_check = false;
};

}  // namespace fsdp::fsdp1

#endif  // FSDP_FSDP_FSDP1_FSDP_OPTIONS_H_
