// fully_shard: per-parameter FSDP (FSDP2) for torch::nn modules.
//
//   using Block = fsdp::per_param::FullySharded<BlockImpl>;   // forward runs FSDP hooks
//   auto model = std::make_shared<fsdp::per_param::FullyShardedImpl<NetImpl>>(...);
//   for (auto& block : model->blocks) fully_shard(block.ptr(), {.mesh = mesh});
//   fsdp::per_param::FSDPModule root = fully_shard(model, {.mesh = mesh});
//   torch::optim::AdamW opt(model->parameters(), ...);   // sees the sharded parameters
//
// Parameters keep their tensor identity: between steps each holds its shard (a view into
// storage FSDP owns); inside forward/backward its data is swapped to the unsharded view.
#ifndef FSDP_FSDP_PER_PARAM_FULLY_SHARD_H_
#define FSDP_FSDP_PER_PARAM_FULLY_SHARD_H_

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "fsdp/common/forward_tensors.h"
#include "fsdp/per_param/fsdp_state.h"

namespace fsdp::per_param {

// Names of the data-parallel dims of an SPMD mesh (PyTorch's DataParallelMeshDims).
struct DataParallelMeshDims {
  std::string shard;
  std::optional<std::string> replicate;
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
  // FSDP shards over `shard` (HSDP: and replicates over `replicate`, which must precede it).
  std::optional<DataParallelMeshDims> dp_mesh_dims;
  // Parameters must already live here.
  c10::Device device = c10::Device(c10::kCPU);
};

// The handle fully_shard returns (PyTorch's FSDPModule methods). Cheap to copy; valid while
// the module lives.
class FSDPModule {
 public:
  FSDPModule() = default;
  explicit FSDPModule(FSDPState* state) : state_(state) {}

  // All-gathers this module's parameters now (async_op: issue only; then wait_for_unshard).
  void unshard(bool async_op = false);
  void wait_for_unshard();
  void reshard();
  // false: accumulate unsharded gradients without communication (no_sync).
  void set_requires_gradient_sync(bool requires_gradient_sync, bool recurse = true);
  // HSDP: false reduce-scatters but skips the replicate all-reduce (partial accumulation).
  void set_requires_all_reduce(bool requires_all_reduce, bool recurse = true);
  void set_reshard_after_forward(bool reshard_after_forward, bool recurse = true);
  void set_reshard_after_backward(bool reshard_after_backward, bool recurse = true);
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules);
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules);
  void set_is_last_backward(bool is_last_backward);
  void set_gradient_divide_factor(double factor);
  void set_unshard_in_backward(bool unshard_in_backward);

  FSDPState* state() const { return state_; }
  FSDPParamGroup* param_group() const;

 private:
  std::vector<FSDPState*> States(bool recurse) const;
  FSDPState* state_ = nullptr;
};

// Shards the parameters of `module` that no fully_shard'ed submodule manages. `module`
// must derive from FSDPHooks (e.g. FullyShardedImpl<Impl>) so its forward runs the hooks.
// Call bottom-up (blocks, then the root), once per module, before building the optimizer.
FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, FullyShardOptions options);

// Forward arguments and outputs are searched for tensors with fsdp::ForwardTensors
// (fsdp/common/forward_tensors.h; specialize it there for other types).
using ::fsdp::ForwardTensors;

// `Impl` with a forward of the same signature that runs FSDP's pre-forward (lazy init,
// unshard, input casts, post-backward registration) and post-forward (reshard,
// pre-backward hooks, output cast). The exact signature comes from &Impl::forward, so the
// module works in Sequential / AnyModule and ModuleHolder::operator(). Parameter names are
// Impl's own: no wrapper appears in FQNs. Outputs must be tensors, vectors / tuples / pairs
// of them (specialize ForwardTensors for other types).
template <class Impl, class Signature = decltype(&Impl::forward)>
class FullyShardedImpl;

template <class Impl, class R, class C, class... A>
class FullyShardedImpl<Impl, R (C::*)(A...)> : public Impl, public FSDPHooks {
 public:
  using Impl::Impl;

  R forward(A... args) {
    auto* state = fsdp_state();
    if (state == nullptr) return Impl::forward(std::forward<A>(args)...);
    return RunForwardWithHooks<R>(state, [this](auto&... a) { return Impl::forward(a...); }, std::forward<A>(args)...);
  }
};

template <class Impl>
class FullySharded : public torch::nn::ModuleHolder<FullyShardedImpl<Impl>> {
 public:
  using torch::nn::ModuleHolder<FullyShardedImpl<Impl>>::ModuleHolder;
};

}  // namespace fsdp::per_param

#endif  // FSDP_FSDP_PER_PARAM_FULLY_SHARD_H_
