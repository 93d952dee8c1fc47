// FlatParamHandle: construction (flattening + metadata), sharding, shard metadata and the
// lazy-init attributes. Unshard / reshard / views / gradients: flat_param_runtime.cc.
#include "fsdp/fsdp1/flat_param.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "env/environment.h"
#include "fsdp/common/storage.h"

namespace fsdp::fsdp1 {
namespace {

// The segments' tensors concatenated: originals flattened (detached), padding as 42s
// (_construct_padding_tensor).
at::Tensor FlattenBySegments(const std::vector<at::Tensor>& tensors, const std::vector<FlatSegment>& segments,
                             const at::TensorOptions& options) {
  std::vector<at::Tensor> parts;
  parts.reserve(segments.size());
  for (const FlatSegment& seg : segments) {
    if (seg.is_padding()) {
      parts.push_back(at::full({seg.numel}, kFlatParamPaddingValue, options));
    } else {
      parts.push_back(tensors[seg.param_index].detach().flatten());
    }
  }
  return at::cat(parts, 0);
}

void WalkModules(torch::nn::Module& module, const std::string& prefix,
                 const std::function<void(torch::nn::Module&, const std::string&)>& visit) {
  // named_modules(remove_duplicate=False): the module itself, then its children depth-first.
  visit(module, prefix);
  for (const auto& child : module.named_children()) {
    WalkModules(*child.value(), prefix.empty() ? child.key() : prefix + "." + child.key(), visit);
  }
}

}  // namespace

HandleShardingStrategy ToHandleShardingStrategy(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::FULL_SHARD: return HandleShardingStrategy::FULL_SHARD;
    case ShardingStrategy::SHARD_GRAD_OP: return HandleShardingStrategy::SHARD_GRAD_OP;
    case ShardingStrategy::NO_SHARD: return HandleShardingStrategy::NO_SHARD;
    case ShardingStrategy::HYBRID_SHARD: return HandleShardingStrategy::HYBRID_SHARD;
    case ShardingStrategy::HYBRID_SHARD_ZERO2: return HandleShardingStrategy::HYBRID_SHARD_ZERO2;
  }
  TORCH_CHECK(false, "ToHandleShardingStrategy: unknown strategy ", static_cast<int>(s));
}

const char* ToString(HandleShardingStrategy s) {
  switch (s) {
    case HandleShardingStrategy::FULL_SHARD: return "FULL_SHARD";
    case HandleShardingStrategy::SHARD_GRAD_OP: return "SHARD_GRAD_OP";
    case HandleShardingStrategy::NO_SHARD: return "NO_SHARD";
    case HandleShardingStrategy::HYBRID_SHARD: return "HYBRID_SHARD";
    case HandleShardingStrategy::HYBRID_SHARD_ZERO2: return "_HYBRID_SHARD_ZERO2";
  }
  return "?";
}

const char* ToString(ShardingStrategy s) { return ToString(ToHandleShardingStrategy(s)); }

bool ReshardsAfterForward(HandleShardingStrategy s) {
  return s == HandleShardingStrategy::FULL_SHARD || s == HandleShardingStrategy::HYBRID_SHARD;
}

bool IsHybrid(HandleShardingStrategy s) {
  return s == HandleShardingStrategy::HYBRID_SHARD || s == HandleShardingStrategy::HYBRID_SHARD_ZERO2;
}

const char* ToString(HandleTrainingState s) {
  switch (s) {
    case HandleTrainingState::IDLE: return "IDLE";
    case HandleTrainingState::FORWARD: return "FORWARD";
    case HandleTrainingState::BACKWARD_PRE: return "BACKWARD_PRE";
    case HandleTrainingState::BACKWARD_POST: return "BACKWARD_POST";
    case HandleTrainingState::SUMMON_FULL_PARAMS: return "SUMMON_FULL_PARAMS";
  }
  return "?";
}

FlatParamHandle::FlatParamHandle(const std::vector<at::Tensor>& params, torch::nn::Module& fully_sharded_module,
                                 FlatParamHandleOptions options)
    : options_(std::move(options)), fully_sharded_module_(&fully_sharded_module) {
  TORCH_CHECK(!params.empty(), "Cannot construct a FlatParamHandle with an empty parameter list");
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].defined(), "FlatParamHandle: params[", i, "] is an undefined tensor");
  }
  TORCH_CHECK(options_.process_group != nullptr, "FlatParamHandle: process_group must not be null");
  skip_writeback_check_ = options_.skip_writeback_check || env::IsOne(env::kSkipWritebackCheck);
  use_full_prec_in_eval_ = options_.use_full_prec_in_eval || env::IsOne(env::kUseFullPrecInEval);
  rank_ = options_.process_group->rank();
  world_size_ = options_.process_group->size();
  // Optimistically assume valid params; InitFlatParamAndMetadata validates them.
  orig_param_dtype_ = params[0].scalar_type();
  InitParamReduceDtypes(options_.mp_param_dtype, options_.mp_reduce_dtype);
  // Only align addresses for use_orig_params (as PyTorch).
  aligned_numel_ =
      options_.use_orig_params ? FlatAlignedNumel(static_cast<int64_t>(c10::elementSize(fwd_bwd_param_dtype_))) : 0;
  InitFlatParamAndMetadata(params, fully_sharded_module);
  UseUnshardedViews();
}

void FlatParamHandle::InitParamReduceDtypes(std::optional<c10::ScalarType> mp_param_dtype,
                                            std::optional<c10::ScalarType> mp_reduce_dtype) {
  low_prec_param_dtype_specified_ = mp_param_dtype.has_value();
  low_prec_reduce_dtype_specified_ = mp_reduce_dtype.has_value();
  if (low_prec_param_dtype_specified_ && !low_prec_reduce_dtype_specified_) {
    // Special case: infer gradient reduction mixed precision from the parameter dtype.
    fwd_bwd_param_dtype_ = *mp_param_dtype;
    reduce_dtype_ = fwd_bwd_param_dtype_;
  } else {
    fwd_bwd_param_dtype_ = mp_param_dtype.value_or(orig_param_dtype_);
    reduce_dtype_ = mp_reduce_dtype.value_or(orig_param_dtype_);
  }
}

FlatParamHandle::ValidatedTensors FlatParamHandle::ValidateTensorsToFlatten(
    const std::vector<at::Tensor>& tensors) const {
  std::optional<c10::ScalarType> dtype;
  std::optional<bool> requires_grad;
  std::optional<c10::Device> device;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (!dtype) {
      TORCH_CHECK(t.is_floating_point(), "Cannot flatten integer dtype tensors (tensor ", i, " has dtype ",
                  t.scalar_type(), ")");
    }
    TORCH_CHECK(!dtype || t.scalar_type() == *dtype, "Must flatten tensors with uniform dtype but got ", *dtype,
                " and ", t.scalar_type(), " (tensor ", i, ")");
    // For use_orig_params, permit non-uniform requires_grad.
    TORCH_CHECK(options_.use_orig_params || !requires_grad || t.requires_grad() == *requires_grad,
                "Must flatten tensors with uniform `requires_grad` when `use_orig_params=False` "
                "(tensor ",
                i, " has requires_grad=", t.requires_grad() ? "True" : "False", ")");
    TORCH_CHECK(!device || t.device() == *device, "Must flatten tensors on the same device but got both ", *device,
                " and ", t.device(), " (tensor ", i, ")");
    dtype = t.scalar_type();
    requires_grad = requires_grad.value_or(false) || t.requires_grad();
    device = t.device();
  }
  TORCH_CHECK(requires_grad.has_value(), "Requires non-empty `tensors` list");
  return {*dtype, *requires_grad, *device};
}

void FlatParamHandle::InitFlatParamAndMetadata(const std::vector<at::Tensor>& params, torch::nn::Module& module) {
  at::NoGradGuard no_grad;
  const ValidatedTensors v = ValidateTensorsToFlatten(params);
  std::unordered_set<const c10::TensorImpl*> params_set;
  for (const at::Tensor& p : params) params_set.insert(p.unsafeGetTensorImpl());

  FlatParameter& fp = flat_param_;
  struct Prim {
    torch::nn::Module* module;
    std::string module_name;
    std::string param_name;
  };
  std::unordered_map<const c10::TensorImpl*, Prim> shared_param_memo;
  std::vector<at::Tensor> to_flatten, shared_params;
  WalkModules(module, "", [&](torch::nn::Module& submodule, const std::string& submodule_name) {
    for (const auto& item : submodule.named_parameters(/*recurse=*/false)) {
      const at::Tensor& param = item.value();
      if (!param.defined() || params_set.count(param.unsafeGetTensorImpl()) == 0) continue;
      auto it = shared_param_memo.find(param.unsafeGetTensorImpl());
      if (it != shared_param_memo.end()) {  // shared reference
        shared_params.push_back(param);
        fp.shared_param_infos.push_back(
            {item.key(), &submodule, submodule_name, it->second.param_name, it->second.module, it->second.module_name});
        continue;
      }
      shared_param_memo.emplace(param.unsafeGetTensorImpl(), Prim{&submodule, submodule_name, item.key()});
      to_flatten.push_back(param);
      fp.param_infos.push_back({item.key(), &submodule, submodule_name});
      fp.numels.push_back(param.numel());
      fp.shapes.push_back(param.sizes().vec());
      fp.strides.push_back(param.strides().vec());
      fp.fqns.push_back(submodule_name.empty() ? item.key() : submodule_name + "." + item.key());
    }
  });
  TORCH_CHECK(!to_flatten.empty(), "`params` were not found in `module`'s tree (", params.size(), " params given)");

  // Alignment padding before each parameter and world-size divisibility padding (both only
  // with aligned_numel > 0): the shared layout math.
  fp.segments = MakeFlatSegments(fp.numels, aligned_numel_, world_size_);
  for (const FlatSegment& seg : fp.segments) {
    fp.numels_with_padding.push_back(seg.numel);
    fp.is_padding_mask.push_back(seg.is_padding());
  }
  at::Tensor flat = FlattenBySegments(to_flatten, fp.segments, at::TensorOptions().dtype(v.dtype).device(v.device));
  flat.set_requires_grad(v.requires_grad);
  fp.param = flat;
  fp.num_params = static_cast<int64_t>(to_flatten.size());
  for (const ParamInfo& pi : fp.param_infos) {
    if (std::find(fp.modules.begin(), fp.modules.end(), pi.module) == fp.modules.end()) fp.modules.push_back(pi.module);
  }
  for (const SharedParamInfo& spi : fp.shared_param_infos) {
    if (std::find(fp.modules.begin(), fp.modules.end(), spi.module) == fp.modules.end())
      fp.modules.push_back(spi.module);
  }
  if (options_.use_orig_params) {
    fp.params = to_flatten;
    fp.shared_params = shared_params;
    fp.is_grad_none_mask.assign(fp.num_params, false);
  }
  orig_tensors_ = to_flatten;
  fp.unpadded_unsharded_size = {flat.numel()};
}

at::Tensor FlatParamHandle::FlattenTensors(const std::vector<at::Tensor>& tensors, int64_t aligned_numel) const {
  TORCH_CHECK(!tensors.empty(), "Expects non-empty `tensors`");
  TORCH_CHECK(aligned_numel >= 0, "Expects non-negative `aligned_numel` but got ", aligned_numel);
  at::NoGradGuard no_grad;
  const ValidatedTensors v = ValidateTensorsToFlatten(tensors);
  std::vector<int64_t> numels;
  for (const at::Tensor& t : tensors) numels.push_back(t.numel());
  return FlattenBySegments(tensors, MakeFlatSegments(numels, aligned_numel, world_size_),
                           at::TensorOptions().dtype(v.dtype).device(v.device));
}

void FlatParamHandle::Shard() {
  at::NoGradGuard no_grad;
  TORCH_CHECK(!sharded_, "FlatParamHandle::Shard: the flat parameter (", absl::StrJoin(flat_param_.fqns, ", "),
              ") is already sharded");
  at::Tensor& flat = flat_param_.param;
  const int64_t numel = flat.numel();
  if (!uses_sharded_strategy()) {
    InitShardMetadata(0, 0, numel - 1);
  } else {
    TORCH_CHECK(flat.storage_offset() == 0,
                "The `FlatParameter` is not the sole occupant of its storage (storage_offset=", flat.storage_offset(),
                ")");
    TORCH_CHECK(numel > 0, "FlatParamHandle::Shard: cannot shard a flat parameter with 0 elements (",
                absl::StrJoin(flat_param_.fqns, ", "), "): unsharded_start_idx 0 > unsharded_end_idx -1");
    // _get_shard: this rank's torch.chunk (cloned), zero-padded to the first chunk's size.
    const FlatChunk c = MakeFlatChunk(numel, world_size_, rank_);
    at::Tensor sharded = at::zeros({c.chunk}, flat.options());
    if (c.end > c.start) sharded.narrow(0, 0, c.end - c.start).copy_(flat.narrow(0, c.start, c.end - c.start));
    at::Tensor unsharded = flat.data();
    ReleaseOrigParamsViewing(unsharded);
    FreeStorage(unsharded);
    flat.set_data(sharded);
    InitShardMetadata(c.numel_padded, c.chunk * rank_, c.chunk * (rank_ + 1) - 1);
  }
  if (options_.use_orig_params) UseShardedViews();
}

void FlatParamHandle::InitShardMetadata(int64_t numel_padded, int64_t unsharded_start_idx, int64_t unsharded_end_idx) {
  FlatParameter& fp = flat_param_;
  const int64_t sharded_numel = fp.param.numel();  // includes numel_padded
  TORCH_CHECK(unsharded_start_idx >= 0 && unsharded_start_idx <= unsharded_end_idx,
              "unsharded_start_idx: ", unsharded_start_idx, " unsharded_end_idx: ", unsharded_end_idx);
  TORCH_CHECK(numel_padded <= sharded_numel, "numel_padded: ", numel_padded,
              " sharded_flat_param_numel: ", sharded_numel);
  std::vector<ShardParamInfo> infos = FlatShardParamInfos(fp.segments, unsharded_start_idx, unsharded_end_idx);
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(infos.size()) == fp.num_params, "Expects length ", fp.num_params,
                        " but got ", infos.size());
  fp.sharded_size = fp.param.sizes().vec();
  fp.shard_param_infos = std::move(infos);
  fp.shard_numel_padded = numel_padded;
  sharded_ = true;
}

FlatParamShardMetadata FlatParamHandle::ShardMetadata() const {
  TORCH_CHECK(sharded_, "FlatParamHandle::ShardMetadata: call Shard() first");
  FlatParamShardMetadata m;
  const FlatParameter& fp = flat_param_;
  for (int64_t i = 0; i < fp.num_params; ++i) {
    const ShardParamInfo& s = fp.shard_param_infos[i];
    if (!s.in_shard) continue;
    m.param_names.push_back(fp.fqns[i]);
    m.param_shapes.push_back(fp.shapes[i]);
    m.param_numels.push_back(fp.numels[i]);
    m.param_offsets.emplace_back(s.intra_param_start_idx, s.intra_param_end_idx);
  }
  return m;
}

std::vector<std::string> FlatParamHandle::FqnsInShard() const {
  std::vector<std::string> fqns;
  for (int64_t i = 0; i < flat_param_.num_params; ++i) {
    if (flat_param_.shard_param_infos.at(i).in_shard) fqns.push_back(flat_param_.fqns[i]);
  }
  return fqns;
}

void FlatParamHandle::InitFlatParamAttributes() {
  at::NoGradGuard no_grad;
  TORCH_CHECK(sharded_, "FlatParamHandle::InitFlatParamAttributes: call Shard() first");
  FlatParameter& fp = flat_param_;
  const at::Tensor& flat = fp.param;
  if (flat.scalar_type() != orig_param_dtype_) {
    // The user changed the parameter dtype after construction: refresh the dtypes that were
    // not given explicitly (mixed precision settings take precedence).
    if (!low_prec_param_dtype_specified_) fwd_bwd_param_dtype_ = flat.scalar_type();
    if (!low_prec_reduce_dtype_specified_ && !low_prec_param_dtype_specified_) reduce_dtype_ = flat.scalar_type();
    orig_param_dtype_ = flat.scalar_type();
  }
  if (options_.offload_params) {
    TORCH_CHECK(flat.device().is_cpu(),
                "Expects the `FlatParameter` to be on CPU when parameter CPU offloading is "
                "enabled, not ",
                flat.device());
  } else {
    CheckOnComputeDevice(flat);
  }
  fp.local_shard = flat.data();
  if (options_.offload_params) {
    // Pinned memory needs an accelerator; on a CPU-only build the shard stays pageable.
    if (!options_.device.is_cpu()) fp.local_shard = fp.local_shard.pin_memory();
    fp.cpu_grad = at::zeros_like(fp.local_shard, fp.local_shard.options().device(at::kCPU));
    if (!options_.device.is_cpu()) fp.cpu_grad = fp.cpu_grad.pin_memory();
  }
  if (uses_param_mixed_precision()) {
    fp.mp_shard =
        at::empty_like(fp.local_shard, fp.local_shard.options().device(options_.device).dtype(fwd_bwd_param_dtype_));
    FreeStorage(fp.mp_shard);
  }
  if (uses_sharded_strategy()) {
    const c10::ScalarType unsharded_dtype = uses_param_mixed_precision() ? fwd_bwd_param_dtype_ : flat.scalar_type();
    const int64_t padded_numel = flat.numel() * world_size_;
    fp.full_param_padded = at::empty({padded_numel}, flat.options().device(options_.device).dtype(unsharded_dtype));
    fp.padded_unsharded_size = fp.full_param_padded.sizes().vec();
    FreeStorage(fp.full_param_padded);
    if (uses_param_mixed_precision()) {
      fp.full_prec_full_param_padded = at::empty({padded_numel}, flat.options().device(options_.device));
      FreeStorage(fp.full_prec_full_param_padded);
    }
  }
}

bool FlatParamHandle::force_full_precision() const {
  return (uses_param_mixed_precision() || uses_reduce_mixed_precision()) &&
         (training_state_ == HandleTrainingState::SUMMON_FULL_PARAMS ||
          (!fully_sharded_module_->is_training() && use_full_prec_in_eval_));
}

bool FlatParamHandle::is_sharded(const at::Tensor& tensor) const {
  if (!sharded_ || !uses_sharded_strategy()) return false;
  return tensor.sizes() == c10::IntArrayRef(flat_param_.sharded_size);
}

void FlatParamHandle::CheckShardedStrategy() const {
  TORCH_CHECK(uses_sharded_strategy(), "Expects sharded strategy but the handle uses ",
              ToString(options_.sharding_strategy));
}

void FlatParamHandle::CheckOnComputeDevice(const at::Tensor& t) const {
  TORCH_CHECK(t.device() == options_.device, "Expects tensor to be on the compute device ", options_.device,
              ", was on ", t.device());
}

void FlatParamHandle::CheckUnsharded(const at::Tensor& t) const {
  TORCH_CHECK(t.defined(), "Expects tensor to be unsharded but got `None`");
  TORCH_CHECK(t.sizes() == c10::IntArrayRef(flat_param_.unpadded_unsharded_size),
              "Expects tensor to be unsharded with size ",
              c10::str(c10::IntArrayRef(flat_param_.unpadded_unsharded_size)), " but got ",
              c10::str(c10::IntArrayRef(t.sizes())));
}

void FlatParamHandle::CheckSharded(const at::Tensor& t) const {
  TORCH_CHECK(t.defined(), "Expects tensor to be sharded but got `None`");
  TORCH_CHECK(t.sizes() == c10::IntArrayRef(flat_param_.sharded_size), "Expects tensor to be sharded with size ",
              c10::str(c10::IntArrayRef(flat_param_.sharded_size)), " but got ", c10::str(c10::IntArrayRef(t.sizes())));
}

}  // namespace fsdp::fsdp1
