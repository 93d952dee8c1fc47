// FSDP1's FlatParameter and FlatParamHandle (PyTorch's fsdp/_flat_param.py): the original
// parameters of one module subtree flattened into one 1-D parameter, sharded across the
// shard group, all-gathered for computation, and the original parameters as views into it.
//
// C++ mapping of PyTorch's mechanics:
//  - The FlatParameter is a plain leaf tensor (FlatParameter::param) whose data is swapped
//    with set_data, as PyTorch swaps `flat_param.data` (shard() uses set_data where the
//    PyTorch uses set_): sharded flat param (this rank's padded chunk, `local_shard`), low
//    precision shard (`mp_shard`), or the unpadded prefix of the padded all-gather output
//    (`full_param_padded`), whose storage is freed / re-allocated in place
//    (fsdp/common/storage.h).
//  - LibTorch modules hold their parameters in members and cannot re-register them, so the
//    original parameter tensors keep their identity and their data is swapped: to unflattened
//    views of the unsharded flat param after unshard(), to PyTorch's flattened sharded views
//    after reshard() with use_orig_params. Tied parameters are one tensor registered under
//    several names, so one swap serves every name (PyTorch's SharedParamInfo bookkeeping is
//    kept as metadata). An original tensor never keeps pointing into freed storage: before the
//    unsharded flat param is freed, originals still viewing it get 0-element data (PyTorch
//    leaves them as stale views; without use_orig_params they are not exposed anyway).
//  - Set_data views are not tracked by autograd (PyTorch's forward uses autograd views of the
//    flat param, so gradients land in flat_param.grad); here autograd accumulates into the
//    original tensors' .grad and FlattenOrigGrads() gathers them into the flat gradient.
#ifndef FSDP_FSDP_FSDP1_FLAT_PARAM_H_
#define FSDP_FSDP_FSDP1_FLAT_PARAM_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/process_group.h"
#include "device/stream.h"
#include "fsdp/common/flat_layout.h"
#include "fsdp/fsdp1/flat_param_streams.h"
#include "fsdp/fsdp1/fsdp_options.h"

namespace torch::nn {
class Module;
}

namespace fsdp::fsdp1 {

// ShardingStrategy (the user's choice) is in fsdp_options.h; the handle's own copy:
enum class HandleShardingStrategy { FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2 };
HandleShardingStrategy ToHandleShardingStrategy(ShardingStrategy s);
const char* ToString(HandleShardingStrategy s);
// RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES: FULL_SHARD, HYBRID_SHARD.
bool ReshardsAfterForward(HandleShardingStrategy s);
// HYBRID_SHARD, HYBRID_SHARD_ZERO2 (gradients also all-reduced across the inter-node group).
bool IsHybrid(HandleShardingStrategy s);

// PyTorch's HandleTrainingState.
enum class HandleTrainingState { IDLE, FORWARD, BACKWARD_PRE, BACKWARD_POST, SUMMON_FULL_PARAMS };
const char* ToString(HandleTrainingState s);

// Where an original parameter lives (non-owning: the modules outlive the handle).
struct ParamInfo {
  std::string param_name;  // unprefixed
  torch::nn::Module* module = nullptr;
  std::string module_name;  // prefixed from the fully sharded module ("" for itself)
};

// Another (module, name) registration of an already flattened parameter; "prim" is the first
// registration met in the walk.
struct SharedParamInfo {
  std::string param_name;
  torch::nn::Module* module = nullptr;
  std::string module_name;
  std::string prim_param_name;
  torch::nn::Module* prim_module = nullptr;
  std::string prim_module_name;
};

using ShardParamInfo = ::fsdp::FlatShardParamInfo;  // PyTorch's _ShardParamInfo

// This rank's part of every original parameter it holds (padding excluded).
struct FlatParamShardMetadata {
  std::vector<std::string> param_names;
  std::vector<std::vector<int64_t>> param_shapes;
  std::vector<int64_t> param_numels;
  std::vector<std::pair<int64_t, int64_t>> param_offsets;  // [start, end] inclusive
};

// PyTorch's FlatParameter: the tensor plus its metadata (PyTorch's underscore attributes,
// same names without the underscore).
struct FlatParameter {
  at::Tensor param;  // the 1-D flat parameter; its data changes storage

  std::vector<int64_t> unpadded_unsharded_size;  // [N], incl. alignment padding
  std::vector<int64_t> padded_unsharded_size;    // [W * chunk]; set for sharded strategies
  std::vector<int64_t> sharded_size;             // [chunk] (NO_SHARD: [N]); set by shard()

  int64_t num_params = 0;
  std::vector<ParamInfo> param_infos;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::vector<int64_t>> strides;  // the originals' strides at flattening
  std::vector<std::string> fqns;
  std::vector<int64_t> numels_with_padding;  // one per segment (padding included)
  std::vector<int64_t> numels;               // one per original parameter
  std::vector<bool> is_padding_mask;         // one per segment
  std::vector<FlatSegment> segments;         // numels_with_padding with offsets
  std::vector<ShardParamInfo> shard_param_infos;
  std::vector<SharedParamInfo> shared_param_infos;
  std::vector<torch::nn::Module*> modules;  // distinct modules holding an original parameter

  int64_t shard_numel_padded = 0;
  at::Tensor local_shard;                  // full precision sharded flat param (NO_SHARD: all)
  at::Tensor full_param_padded;            // all-gather destination (low precision with mp)
  at::Tensor full_prec_full_param_padded;  // full precision destination (mp only)
  at::Tensor mp_shard;                     // low precision shard (mp only)
  at::Tensor cpu_grad;                     // offload only
  at::Tensor saved_grad_shard;             // reduced sharded gradient (undefined: none)

  // use_orig_params only (empty otherwise): the original tensors, one per parameter, and the
  // tensors of the shared registrations (the same tensor as their primary in C++).
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> shared_params;
  std::vector<bool> is_grad_none_mask;
  bool post_backward_called = false;
};

struct FlatParamHandleOptions {
  c10::Device device = c10::Device(c10::kCPU);  // compute and communication device
  HandleShardingStrategy sharding_strategy = HandleShardingStrategy::FULL_SHARD;
  bool offload_params = false;
  std::optional<c10::ScalarType> mp_param_dtype;
  std::optional<c10::ScalarType> mp_reduce_dtype;
  bool keep_low_precision_grads = false;
  comm::ProcessGroupPtr process_group;  // the shard group (HSDP: intra-node)
  bool use_orig_params = false;
  bool use_full_prec_in_eval = false;  // or FSDP_USE_FULL_PREC_IN_EVAL=1
  bool skip_writeback_check = false;   // or FSDP_SKIP_WRITEBACK_CHECK=1
};

// PyTorch's per-handle runtime bookkeeping (attributes the FSDP runtime sets on the handle).
struct HandleRuntimeState {
  std::optional<int64_t> handle_index;             // in the root's all_handles
  std::optional<int64_t> pre_forward_order_index;  // in ExecOrderData's pre-forward order
  std::optional<int64_t> post_forward_index;       // in ExecOrderData's post-forward order
  bool needs_pre_forward_unshard = false;          // guards mistargeted forward prefetches
  bool needs_pre_backward_unshard = false;         // guards mistargeted backward prefetches
  bool prefetched = false;
  bool ran_pre_backward_hook = false;
};

// PyTorch's _FLAT_PARAM_PADDING_VALUE: alignment padding elements hold 42.
inline constexpr int kFlatParamPaddingValue = 42;

// Not thread-safe: belongs to one rank.
class FlatParamHandle {
 public:
  // Flattens the tensors of `params` that are registered in `fully_sharded_module`'s tree, in
  // the tree's order (module pre-order, then each module's own parameters), each distinct
  // tensor once. Afterwards the originals are views into the (unsharded) flat parameter.
  FlatParamHandle(const std::vector<at::Tensor>& params, torch::nn::Module& fully_sharded_module,
                  FlatParamHandleOptions options);
  FlatParamHandle(const FlatParamHandle&) = delete;
  FlatParamHandle& operator=(const FlatParamHandle&) = delete;

  // flatten_tensors: `tensors` flattened and concatenated, with alignment padding (42s) before
  // each tensor and to a multiple of the world size when aligned_numel > 0.
  at::Tensor FlattenTensors(const std::vector<at::Tensor>& tensors, int64_t aligned_numel) const;

  // shard(): keeps this rank's padded chunk as the flat parameter's data (the unsharded
  // storage is freed) and sets the shard metadata; with use_orig_params, sharded views.
  void Shard();
  FlatParamShardMetadata ShardMetadata() const;
  // init_flat_param_attributes (lazy init): local_shard, the freed all-gather destinations,
  // the freed low precision shard, the CPU gradient for offloading.
  void InitFlatParamAttributes();

  // The streams the handle's work runs on (flat_param_streams.h): the FSDP runtime sets its
  // root's at lazy init. A handle without them uses the calling thread's inline streams, and
  // Unshard / ReduceScatterGrad then wait for their work before returning (results in place).
  void SetStreams(const FlatParamStreams* streams) { streams_ = streams; }
  const FlatParamStreams& streams() const { return streams_ ? *streams_ : ThreadInlineFlatParamStreams(); }

  // pre_unshard (writeback, low precision shard); returns whether it did anything. The low
  // precision cast runs on the unshard stream.
  bool PreUnshard();
  // unshard: all-gather into the re-allocated padded unsharded flat param on the unshard
  // stream and switch to its unpadded prefix; the originals become views into it (their data
  // is there once WaitForUnshard ordered the compute stream after it). NO_SHARD: views only.
  void Unshard();
  // PyTorch's current_stream.wait_stream(unshard_stream): the compute stream waits for the
  // last Unshard's all-gather (and low precision cast). No-op when nothing is pending.
  void WaitForUnshard();
  bool NeedsUnshard() const;
  void PostUnshard();
  // reshard: back to the sharded flat param (sharded views with use_orig_params); frees the
  // unsharded flat param's storage if asked (sharded strategies only).
  void Reshard(bool free_unsharded_flat_param);
  void PostReshard();

  // _get_unflat_views (aligned variant with use_orig_params, unaligned otherwise): views of
  // `tensor` (default: the flat parameter's data), one per original parameter, in its shape.
  std::vector<at::Tensor> GetUnflatViews(const at::Tensor& tensor = {}) const;
  std::vector<at::Tensor> GetUnflatViewsAligned(const at::Tensor& tensor = {}) const;
  std::vector<at::Tensor> GetUnflatViewsUnaligned(const at::Tensor& tensor = {}) const;

  // _use_unsharded_views / _use_sharded_views: swap the originals' data.
  void UseUnshardedViews();
  void UseShardedViews();
  // _writeback_orig_params: copies originals whose storage (or registered tensor) changed,
  // and their gradients, into the sharded flat parameter / gradient. Returns whether a
  // parameter was written back. Requires use_orig_params.
  bool WritebackOrigParams();

  // --- gradients ---
  // C++ replacement for autograd accumulating into flat_param.grad: adds every original's
  // .grad (unsharded shape; none = zeros) into flat_param.grad (allocated with the unsharded
  // size in the gradients' dtype if undefined) and clears the originals' .grad. Requires the
  // unsharded state. Returns false (and changes nothing) if no original has a gradient.
  bool FlattenOrigGrads();
  // The post-backward reduction of flat_param.grad (the unsharded gradient): cast to the
  // reduce dtype, pre-divide, reduce-scatter (NO_SHARD: all-reduce) over the shard group,
  // all-reduce over `inter_node_group` for hybrid strategies, post-divide, cast to the
  // parameter dtype, accumulate into saved_grad_shard (NO_SHARD: flat_param.grad), copy into
  // cpu_grad when offloading. Divide factors: GradientPredivideFactor of the data-parallel
  // size (shard size x inter-node size) and the rest after. Returns the sharded gradient.
  // A comm_hook replaces the communication and both divides (not with hybrid strategies); it
  // runs on the post-backward stream in its collective's turn (the sequencer's).
  // The work runs on the post-backward stream after the compute stream's (hybrid: the
  // inter-node all-reduce and what follows on the all-reduce stream); tensors are assigned at
  // once, their data is there once the compute stream waited for those streams.
  at::Tensor ReduceScatterGrad(const comm::ProcessGroupPtr& inter_node_group = nullptr, const CommHook& comm_hook = {});
  // prepare_gradient_for_backward: a sharded flat_param.grad (a previous synced backward) is
  // saved in saved_grad_shard so the coming reduction accumulates into it, an unsharded one
  // (no_sync) is kept; then, as autograd accumulates into the originals here, their .grad
  // become unsharded views of flat_param.grad (or are cleared when it is undefined).
  void PrepareGradientForBackward();
  // _reset_flat_param_grad_info_if_needed (use_orig_params): flat_param.grad = undefined (and
  // every is_grad_none_mask entry true) if every original's .grad is undefined;
  // flat_param.requires_grad = any original requires grad.
  void ResetFlatParamGradInfoIfNeeded();
  // _reset_is_grad_none (use_orig_params, BACKWARD_POST): originals requiring grad got one.
  void ResetIsGradNone();
  // prepare_gradient_for_optim: moves the sharded gradient into flat_param.grad.
  void PrepareGradientForOptim();
  // _use_sharded_grad_views / _use_unsharded_grad_views (use_orig_params).
  void UseShardedGradViews();
  void UseUnshardedGradViews();
  // sharded_grad: cpu_grad > saved_grad_shard > grad.
  at::Tensor sharded_grad() const;

  // --- state ---
  FlatParameter& flat_param() { return flat_param_; }
  const FlatParameter& flat_param() const { return flat_param_; }
  bool uses_sharded_strategy() const { return options_.sharding_strategy != HandleShardingStrategy::NO_SHARD; }
  bool uses_param_mixed_precision() const { return fwd_bwd_param_dtype_ != orig_param_dtype_; }
  bool uses_reduce_mixed_precision() const { return reduce_dtype_ != orig_param_dtype_; }
  bool force_full_precision() const;
  bool is_sharded(const at::Tensor& tensor) const;
  HandleTrainingState training_state() const { return training_state_; }
  void set_training_state(HandleTrainingState s) { training_state_ = s; }
  HandleRuntimeState& runtime() { return runtime_; }
  const HandleRuntimeState& runtime() const { return runtime_; }
  bool offload_params() const { return options_.offload_params; }
  bool keep_low_precision_grads() const { return options_.keep_low_precision_grads; }
  // The original parameter tensors (one per flattened parameter, tied ones once).
  const std::vector<at::Tensor>& orig_params() const { return orig_tensors_; }
  HandleShardingStrategy sharding_strategy() const { return options_.sharding_strategy; }
  bool use_orig_params() const { return options_.use_orig_params; }
  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }
  int64_t aligned_numel() const { return aligned_numel_; }
  c10::ScalarType orig_param_dtype() const { return orig_param_dtype_; }
  c10::ScalarType fwd_bwd_param_dtype() const { return fwd_bwd_param_dtype_; }
  c10::ScalarType reduce_dtype() const { return reduce_dtype_; }
  const c10::Device& device() const { return options_.device; }
  const comm::ProcessGroupPtr& process_group() const { return options_.process_group; }
  torch::nn::Module& fully_sharded_module() const { return *fully_sharded_module_; }
  std::vector<std::string> FqnsInShard() const;
  bool skipped_use_sharded_views() const { return unsharded_flat_param_for_skipped_views_.defined(); }

 private:
  // GetUnflatViews' tensors; `aliases`: AliasStorage aliases of a stride-1 `tensor` instead
  // of autograd views (no view tracking, far cheaper), for the per-step runtime paths that
  // only swap data or add into them.
  std::vector<at::Tensor> UnflatTensors(const at::Tensor& tensor, bool aligned, bool aliases) const;
  std::vector<at::Tensor> UnflatAliases(const at::Tensor& tensor = {}) const;
  // UnflatAliases() of the unsharded flat parameter, from unsharded_alias_cache_ where it
  // lives in a persistent unsharded buffer.
  const std::vector<at::Tensor>& UnshardedAliases();
  struct ValidatedTensors {
    c10::ScalarType dtype;
    bool requires_grad;
    c10::Device device;
  };
  ValidatedTensors ValidateTensorsToFlatten(const std::vector<at::Tensor>& tensors) const;
  void InitParamReduceDtypes(std::optional<c10::ScalarType> mp_param_dtype,
                             std::optional<c10::ScalarType> mp_reduce_dtype);
  void InitFlatParamAndMetadata(const std::vector<at::Tensor>& params, torch::nn::Module& module);
  void InitShardMetadata(int64_t numel_padded, int64_t unsharded_start_idx, int64_t unsharded_end_idx);
  void UseLowPrecisionShard();
  at::Tensor GetPaddedUnshardedFlatParam();
  at::Tensor AllocPaddedUnshardedFlatParam();
  at::Tensor AllGatherFlatParam(const at::Tensor& padded_unsharded_flat_param);
  void UseUnshardedFlatParam(const at::Tensor& padded_unsharded_flat_param);
  void UseShardedFlatParam();
  void FreeUnshardedFlatParam();
  void FreeLowPrecisionShardedParam();
  // Frees a buffer the host re-allocates in place (mp_shard, the padded unsharded flat params)
  // once the unshard and compute streams are done with it.
  void ReleaseStorage(const at::Tensor& t);
  // `t` for stream work: an alias of the current memory of those buffers, else `t` itself.
  at::Tensor ForStream(const at::Tensor& t) const;
  void ReleaseOrigParamsViewing(const at::Tensor& storage_owner);
  void WritebackTensor(const at::Tensor& src, const at::Tensor& dst, int64_t tensor_index, int64_t expected_numel,
                       int64_t offset, bool is_param);
  // The tensors whose data is swapped: the originals (one per parameter).
  const std::vector<at::Tensor>& orig_tensors() const { return orig_tensors_; }

  void CheckShardedStrategy() const;
  void CheckOnComputeDevice(const at::Tensor& t) const;
  void CheckUnsharded(const at::Tensor& t) const;
  void CheckSharded(const at::Tensor& t) const;

  FlatParamHandleOptions options_;
  torch::nn::Module* fully_sharded_module_;
  int64_t rank_ = 0;
  int64_t world_size_ = 1;
  HandleTrainingState training_state_ = HandleTrainingState::IDLE;
  c10::ScalarType orig_param_dtype_;
  c10::ScalarType fwd_bwd_param_dtype_;
  c10::ScalarType reduce_dtype_;
  bool low_prec_param_dtype_specified_ = false;
  bool low_prec_reduce_dtype_specified_ = false;
  int64_t aligned_numel_ = 0;
  bool skip_writeback_check_ = false;
  bool use_full_prec_in_eval_ = false;
  bool sharded_ = false;  // shard() ran
  FlatParameter flat_param_;
  std::vector<at::Tensor> orig_tensors_;  // every original (also without use_orig_params)
  at::Tensor unsharded_flat_param_for_skipped_views_;
  // Per-step reuse (the originals' data swaps allocate no tensors): the originals' aliases
  // into the persistent unsharded buffer (full_param_padded or full_prec_full_param_padded,
  // whose storage is freed and re-allocated in place, so its aliases stay valid and pin no
  // memory), keyed by that StorageImpl and the flat parameter's offset and dtype; and one
  // size-0 tensor per original (each its own storage, as EmptyLike0) for releasing them.
  struct UnshardedAliasCache {
    const c10::StorageImpl* storage = nullptr;
    int64_t offset = -1;
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    std::vector<at::Tensor> aliases;
  };
  UnshardedAliasCache unsharded_alias_cache_;
  std::vector<at::Tensor> released_orig_data_;
  HandleRuntimeState runtime_;
  const FlatParamStreams* streams_ = nullptr;  // the runtime's (owned by its context)
  device::EventPtr unshard_event_;             // the last Unshard's, until waited for
};

}  // namespace fsdp::fsdp1

#endif  // FSDP_FSDP_FSDP1_FLAT_PARAM_H_
