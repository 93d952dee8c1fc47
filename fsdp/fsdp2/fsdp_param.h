// FSDPParam: one parameter's sharded storage, its unsharded view, and the transitions
// between them (PyTorch's _fsdp_param.py).
#ifndef FSDP_FSDP_FSDP2_FSDP_PARAM_H_
#define FSDP_FSDP_FSDP2_FSDP_PARAM_H_

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtensor/dtensor.h"
#include "fsdp/common/sharding.h"
#include "fsdp/fsdp2/all_gather_extension.h"
#include "fsdp/fsdp2/fsdp_api.h"
#include "fsdp/fsdp2/mesh_info.h"
#include "fsdp/fsdp2/training_state.h"

namespace torch::nn {
class Module;
}

namespace fsdp::fsdp2 {

// Where a parameter lives in the module tree; `shared` lists the other (module, name)
// pairs holding the same tensor (tied weights). Non-owning: the modules outlive FSDP.
struct ParamModuleInfo {
  torch::nn::Module* module = nullptr;
  std::string param_name;
  std::vector<std::pair<torch::nn::Module*, std::string>> shared;
};

// The casts one parameter actually needs (PyTorch 2.15's FSDPParam.init_dtype_attrs):
// param_dtype is dropped when it equals the parameter's dtype or the parameter is not
// floating point; reduce_dtype stays as given (unset: gradients are reduced in the original
// dtype, FSDPParam.unsharded_grad_dtype; older PyTorch reduced them in param_dtype).
struct ResolvedDtypes {
  std::optional<c10::ScalarType> param_dtype;
  std::optional<c10::ScalarType> reduce_dtype;
};

inline ResolvedDtypes ResolveDtypes(const MixedPrecisionPolicy& policy, c10::ScalarType orig_dtype) {
  ResolvedDtypes r{policy.param_dtype, policy.reduce_dtype};
  if (r.param_dtype == orig_dtype || !c10::isFloatingType(orig_dtype)) r.param_dtype.reset();
  return r;
}

// One parameter under FSDP. The user's parameter tensor keeps its identity (modules and
// optimizers hold it); FSDP swaps its data between the sharded view (into the padded
// sharded storage FSDP owns) and the unsharded view (into the all-gather output), and
// keeps the gradient that belongs to each representation aside while the other is active.
// Not thread-safe: belongs to one rank.
class FSDPParam {
 public:
  // `shard_dim`: the dim FSDP shards (dim 0 by default; shard_placement_fn). `tp_spec`: the
  // parameter is this rank's local part of a DTensor (tensor parallel) with this spec.
  // `device`: the compute device (fully_shard's); a parameter on the meta device gets its
  // shard allocated there, uninitialized (needs_init(): deferred init, meta_init.h), and no
  // full tensor is ever materialized for it.
  FSDPParam(at::Tensor param, ParamModuleInfo module_info, FSDPMeshInfo mesh_info,
            std::optional<FSDPMeshInfo> post_forward_mesh_info, int64_t shard_dim,
            const MixedPrecisionPolicy& mp_policy, OffloadPolicy offload_policy,
            std::optional<dtensor::DTensorSpec> tp_spec, c10::Device device = c10::Device(c10::kCPU));
  FSDPParam(const FSDPParam&) = delete;
  FSDPParam& operator=(const FSDPParam&) = delete;

  // Applies the mixed-precision rules to this parameter's dtype (lazy init).
  void InitDtypeAttrs(const MixedPrecisionPolicy& policy);

  // The 1-D all-gather input: the padded sharded data (or the post-forward shard), cast
  // to the parameter dtype; with an all-gather extension, the bytes of its inputs.
  // Requires kSharded or kShardedPostForward.
  at::Tensor AllGatherInput();
  // Numel of AllGatherInput() (with an extension: after the AllGatherInput() call).
  int64_t AllGatherInputNumel() const;
  // The flat all-gather output for this parameter ([world * input numel]), allocated on
  // first use, storage re-allocated by AllocAllGatherOutput after a free.
  const at::Tensor& InitAllGatherOutput(int64_t world_size);
  void AllocAllGatherOutput();
  // The unsharded parameter data: a strided view of the all-gather output.
  void InitUnshardedParam();
  void FreeUnshardedParam();

  void ToSharded();
  void ToShardedPostForward();
  void ToUnsharded();

  // Gradient bookkeeping (PyTorch's unsharded_param.grad / unsharded_accumulated_grad /
  // sharded_param.grad, mapped onto the single user tensor).
  // Removes and returns the unsharded gradient to reduce (accumulated one first); undefined
  // if this parameter got none. Requires that the unsharded state is current or stashed.
  at::Tensor TakeUnshardedGrad();
  void ToAccumulatedGradIfNeeded();
  void AccumulateUnshardedGradIfNeeded();
  // The host's part of accumulating a reduced sharded gradient of sharded_size() whose
  // data may still be in flight on a stream: with no gradient yet, `sharded_grad` becomes
  // it and the result is undefined; otherwise returns the existing gradient, into which
  // the caller adds `sharded_grad` once its data is ready.
  at::Tensor AdoptShardedGrad(const at::Tensor& sharded_grad);
  // The current sharded gradient (undefined if none).
  at::Tensor sharded_grad() const;

  // Gathers this parameter through `extension` from now on (fully_shard, before the first
  // unshard). Requires dim-0 sharding and no post-forward mesh (as PyTorch).
  void SetAllGatherExtension(std::shared_ptr<AllGatherExtension> extension, MixedPrecisionPolicy mp_policy);
  bool has_all_gather_extension() const { return extension_ != nullptr; }

  // After the user replaced or changed the sharded parameter's data in place: re-pad and
  // re-point the sharded storage (reset_sharded_param).
  void ResetShardedParam();

  // Deferred init: true while the shard of a parameter that was on the meta device at
  // fully_shard holds no values yet (the root's lazy init refuses to run then).
  bool needs_init() const { return needs_init_; }
  // Copies `shard` (this rank's rows: sharded_size(), any dtype and device) into the sharded
  // parameter, points the parameter back at it and clears needs_init(). Requires kSharded.
  void InitShard(const at::Tensor& shard);
  // The shard was filled some other way (a state dict load copied into it).
  void MarkInitialized() { needs_init_ = false; }

  // The sharded parameter as a DTensor (Shard(dim) on the FSDP mesh; (Replicate, Shard) for
  // HSDP; (StridedShard, tp placements...) for FSDP + TP; on an SPMD mesh its placements
  // with several dp shard dims flattened into one).
  dtensor::DTensor ShardedDTensor() const;
  dtensor::DTensor ShardedGradDTensor() const;
  const dtensor::DTensorSpec& sharding_spec() const { return sharding_spec_; }
  // The dim of sharding_spec()'s mesh that FSDP shards over; -1 when it only replicates (DDP).
  int sharding_spec_fsdp_dim() const { return sharding_spec_fsdp_dim_; }

  const at::Tensor& param() const { return param_; }
  const ParamModuleInfo& module_info() const { return module_info_; }
  ShardedState sharded_state() const { return sharded_state_; }
  const DimShardLayout& layout() const { return layout_; }
  const std::vector<int64_t>& sharded_size() const { return layout_.sharded_size; }
  const std::vector<int64_t>& orig_size() const { return layout_.orig_size; }
  int64_t shard_dim() const { return layout_.shard_dim; }
  const at::Tensor& sharded_param_data() const { return sharded_param_data_; }  // padded, flat
  const at::Tensor& all_gather_output() const { return all_gather_output_; }
  c10::ScalarType orig_dtype() const { return orig_dtype_; }
  std::optional<c10::ScalarType> param_dtype() const { return param_dtype_; }
  std::optional<c10::ScalarType> reduce_dtype() const { return reduce_dtype_; }
  // The dtype gradients accumulate and are reduced in: reduce_dtype, else the original
  // dtype (PyTorch 2.15's FSDPParam.unsharded_grad_dtype).
  c10::ScalarType unsharded_grad_dtype() const { return reduce_dtype_.value_or(orig_dtype_); }
  bool offload_to_cpu() const { return offload_.offload_to_cpu; }
  bool pin_memory() const { return offload_.pin_memory && offload_.offload_to_cpu && !device_.is_cpu(); }
  // The compute device (the parameter's device at fully_shard): all-gather buffers, unsharded
  // parameters and reduced gradients live there even when the shard is offloaded.
  const c10::Device& device() const { return device_; }
  bool is_dtensor() const { return tp_spec_.has_value(); }
  // The tensor-parallel layout of the parameter FSDP shards (is_dtensor()).
  const std::optional<dtensor::DTensorSpec>& tp_spec() const { return tp_spec_; }
  const std::string& fqn() const { return fqn_; }
  void set_fqn(std::string fqn) { fqn_ = std::move(fqn); }
  std::string ToString() const;

 private:
  void AssertInStates(std::initializer_list<ShardedState> states, const char* what) const;
  void SetParamData(const at::Tensor& data);
  // The parameter's gradient becomes `incoming` (left undefined); its old one goes to `outgoing`.
  void SwapGrad(at::Tensor& incoming, at::Tensor& outgoing);
  void InitShardingSpec(const std::vector<int64_t>& local_size, c10::ScalarType dtype);
  void InitShardingSpecSpmd(c10::ScalarType dtype);
  at::Tensor ExtensionAllGatherInput();
  void InitExtensionUnshardedParam();

  at::Tensor param_;
  ParamModuleInfo module_info_;
  FSDPMeshInfo mesh_info_;
  std::optional<FSDPMeshInfo> post_forward_mesh_info_;
  OffloadPolicy offload_;
  c10::Device device_{c10::kCPU};
  std::optional<dtensor::DTensorSpec> tp_spec_;
  dtensor::DTensorSpec sharding_spec_;
  int sharding_spec_fsdp_dim_ = -1;
  DimShardLayout layout_;
  std::string fqn_;

  c10::ScalarType orig_dtype_;
  std::optional<c10::ScalarType> param_dtype_;
  std::optional<c10::ScalarType> reduce_dtype_;

  at::Tensor sharded_param_data_;  // flat, padded; owned by FSDP
  at::Tensor sharded_local_;       // the sharded parameter: a view of sharded_param_data_
  std::vector<int64_t> post_forward_size_;
  at::Tensor post_forward_data_;  // flat shard on the post-forward mesh
  at::Tensor all_gather_output_;  // flat [world * padded numel], storage freed when sharded
  at::Tensor unsharded_view_;     // orig_size view of all_gather_output_

  ShardedState sharded_state_ = ShardedState::kSharded;
  bool needs_init_ = false;
  at::Tensor stashed_sharded_grad_;        // param.grad while unsharded data is registered
  at::Tensor stashed_unsharded_grad_;      // param.grad while sharded data is registered
  at::Tensor unsharded_accumulated_grad_;  // reduce-dtype accumulation without reduction

  // All-gather extension: the inputs of the current unshard (shapes, dtypes, metadata) and
  // the unsharded data PostAllGather returned (storage freed when sharded).
  std::shared_ptr<AllGatherExtension> extension_;
  MixedPrecisionPolicy extension_mp_policy_;
  std::vector<at::Tensor> extension_inputs_;
  c10::IValue extension_metadata_;
  at::Tensor extension_unsharded_;
};

}  // namespace fsdp::fsdp2

#endif  // FSDP_FSDP_FSDP2_FSDP_PARAM_H_
