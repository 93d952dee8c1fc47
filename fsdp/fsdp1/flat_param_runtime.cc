// FlatParamHandle: unshard / reshard, views of the original parameters, writeback.
// Gradients: flat_param_grad.cc.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/module.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "fsdp/common/storage.h"
#include "fsdp/fsdp1/flat_param.h"
#include "fsdp/meta/meta.h"

namespace fsdp::fsdp1 {
namespace {

// The per-step swaps below use fsdp::ReplaceData (fsdp/meta/meta.h): set_data's effect
// without the dispatcher when dtype and device stay, set_data itself otherwise.

// `numel` elements of the 1-D `t` from `start`, shaped `shape`: with `alias` and a stride-1
// `t`, an AliasStorage alias (no autograd view tracking, far cheaper) for the per-step paths
// that only swap data or write into it; else narrow + view.
at::Tensor Slice(const at::Tensor& t, int64_t start, int64_t numel, c10::IntArrayRef shape, bool alias) {
  if (alias && t.stride(0) == 1) return AliasStorage(t, t.storage_offset() + start, shape);
  return t.narrow(0, start, numel).view(shape);
}

}  // namespace

// ----------------------------------------------------------------------------------------
// Unshard / reshard

bool FlatParamHandle::PreUnshard() {
  if (training_state_ == HandleTrainingState::SUMMON_FULL_PARAMS && skipped_use_sharded_views()) {
    // Reuse the sharded-views path for the special semantics of the unsharded flat param.
    UseShardedViews();
  }
  bool ret = false;
  if (options_.use_orig_params && !skip_writeback_check_) ret = WritebackOrigParams();
  // The writeback ran on the compute stream; the unshard stream reads what it wrote (the
  // PyTorch's unshard_stream.wait_stream(pre_unshard_stream)).
  if (ret) streams().unshard->WaitStream(*streams().current);
  const at::Tensor& flat = flat_param_.param;
  if (uses_sharded_strategy() && !options_.offload_params && !NeedsUnshard()) {
    // no-op
  } else if (uses_param_mixed_precision() && !force_full_precision()) {
    UseLowPrecisionShard();
    ret = true;
  } else if (options_.offload_params && flat.device() != options_.device) {
    at::NoGradGuard no_grad;
    flat_param_.param.set_data(flat.data().to(options_.device));
    streams().unshard->WaitStream(*streams().current);  // the copy ran on the compute stream
    if (options_.use_orig_params) {
      if (is_sharded(flat_param_.param)) {
        UseShardedViews();
      } else {
        UseUnshardedViews();
      }
    }
    ret = true;
  }
  CheckOnComputeDevice(flat_param_.param);
  return ret;
}

void FlatParamHandle::UseLowPrecisionShard() {
  at::NoGradGuard no_grad;
  FlatParameter& fp = flat_param_;
  TORCH_CHECK(uses_param_mixed_precision(), "Not using low precision for parameters");
  TORCH_CHECK(fp.mp_shard.defined(), "Expects `_mp_shard` to exist (call InitFlatParamAttributes first)");
  device::Stream& unshard = *streams().unshard;
  // Still allocated (NO_SHARD between unshards): the compute stream may be reading it.
  if (StorageNbytes(fp.mp_shard) > 0) unshard.WaitStream(*streams().current);
  AllocStorage(fp.mp_shard);
  // PyTorch casts on the pre-unshard stream; here on the unshard stream, before the
  // all-gather that reads it (copy_ casts to the low precision and moves to the device).
  unshard.Launch([dst = ForStream(fp.mp_shard), src = fp.local_shard] { dst.copy_(src); });
  ReplaceData(fp.param, fp.mp_shard);
}

bool FlatParamHandle::NeedsUnshard() const {
  if (!uses_sharded_strategy()) return false;
  const FlatParameter& fp = flat_param_;
  const at::Tensor& unsharded =
      force_full_precision() && uses_param_mixed_precision() ? fp.full_prec_full_param_padded : fp.full_param_padded;
  TORCH_CHECK(unsharded.defined(), "FlatParamHandle::Unshard: call Shard() and InitFlatParamAttributes() first");
  const bool already_unsharded =
      StorageNbytes(unsharded) / static_cast<int64_t>(unsharded.element_size()) == unsharded.numel();
  return !already_unsharded;
}

void FlatParamHandle::Unshard() {
  at::NoGradGuard no_grad;
  TORCH_CHECK(sharded_, "FlatParamHandle::Unshard: call Shard() first");
  if (!NeedsUnshard()) {
    // Even when not needing an unshard, switch to the unsharded flat parameter.
    UseUnshardedFlatParam(uses_sharded_strategy() ? GetPaddedUnshardedFlatParam() : flat_param_.param.data());
  } else {
    at::Tensor unsharded = AllocPaddedUnshardedFlatParam();
    UseUnshardedFlatParam(AllGatherFlatParam(unsharded));
  }
  // Covers the all-gather and a low precision cast (NO_SHARD's is its unsharded parameter).
  unshard_event_ = streams().unshard->RecordEvent();
  if (streams_ == nullptr) WaitForUnshard();  // used alone: results in place on return
}

void FlatParamHandle::WaitForUnshard() {
  if (!unshard_event_) return;
  device::EventPtr event = std::move(unshard_event_);
  unshard_event_ = nullptr;
  streams().current->WaitEvent(event);
}

at::Tensor FlatParamHandle::ForStream(const at::Tensor& t) const {
  const FlatParameter& fp = flat_param_;
  for (const at::Tensor* freed_in_place : {&fp.mp_shard, &fp.full_param_padded, &fp.full_prec_full_param_padded}) {
    if (SameStorage(t, *freed_in_place)) return StreamAlias(t);
  }
  return t;
}

void FlatParamHandle::ReleaseStorage(const at::Tensor& t) {
  // The unshard stream writes these buffers (cast, all-gather), the compute stream reads them.
  FreeStorageAfterStreams(t, {streams().unshard, streams().current});
}

at::Tensor FlatParamHandle::GetPaddedUnshardedFlatParam() {
  CheckShardedStrategy();
  FlatParameter& fp = flat_param_;
  if (force_full_precision() && uses_param_mixed_precision()) {
    // A separate destination keeps full_param_padded in low precision; a low precision copy
    // still allocated (no reshard after forward) is freed so the next unshard re-gathers.
    TORCH_CHECK(fp.full_prec_full_param_padded.scalar_type() != fwd_bwd_param_dtype_, "Expects full precision but got ",
                fwd_bwd_param_dtype_);
    if (StorageNbytes(fp.full_param_padded) > 0) ReleaseStorage(fp.full_param_padded);
    return fp.full_prec_full_param_padded;
  }
  return fp.full_param_padded;
}

at::Tensor FlatParamHandle::AllocPaddedUnshardedFlatParam() {
  CheckShardedStrategy();
  at::Tensor unsharded = GetPaddedUnshardedFlatParam();
  TORCH_CHECK(StorageNbytes(unsharded) == 0, "Expects storage to be freed but got storage with size > 0 (",
              StorageNbytes(unsharded), " bytes)");
  AllocStorage(unsharded);
  return unsharded;
}

at::Tensor FlatParamHandle::AllGatherFlatParam(const at::Tensor& padded_unsharded_flat_param) {
  const at::Tensor sharded = flat_param_.param.data();
  const int64_t expected_numel = sharded.numel() * world_size_;
  TORCH_CHECK(padded_unsharded_flat_param.numel() == expected_numel, "Expects ", expected_numel, " numel but got ",
              padded_unsharded_flat_param.numel());
  // Issued in program order among the root's collectives; the host frees the output (and a
  // low precision input) in place while it may be in flight, so it gets their aliases.
  const FlatParamStreams& s = streams();
  LaunchCollective(s, *s.unshard,
                   [group = options_.process_group, out = ForStream(padded_unsharded_flat_param),
                    in = ForStream(sharded)] { return group->all_gather_into_tensor(out, in); });
  return padded_unsharded_flat_param;
}

void FlatParamHandle::UseUnshardedFlatParam(const at::Tensor& padded_unsharded_flat_param) {
  const int64_t numel = flat_param_.unpadded_unsharded_size[0];
  ReplaceData(flat_param_.param, Slice(padded_unsharded_flat_param, 0, numel, {numel}, /*alias=*/true));
  if (options_.use_orig_params && skipped_use_sharded_views() && training_state_ == HandleTrainingState::BACKWARD_PRE) {
    // Complement of the skipped post-forward sharded views: the views are still unsharded.
    return;
  }
  // PyTorch sets views only in forward without use_orig_params (callers use
  // unflatten_as_params otherwise); here the originals always follow the unsharded data.
  UseUnshardedViews();
}

void FlatParamHandle::PostUnshard() {
  if (uses_param_mixed_precision() && uses_sharded_strategy()) FreeLowPrecisionShardedParam();
  CheckOnComputeDevice(flat_param_.param);
}

void FlatParamHandle::FreeLowPrecisionShardedParam() {
  TORCH_CHECK(uses_param_mixed_precision(), "Not using low precision for parameters");
  TORCH_CHECK(flat_param_.mp_shard.defined(), "Expects `_mp_shard` to exist");
  // The all-gather on the unshard stream may still read it (PyTorch's record_stream).
  ReleaseStorage(flat_param_.mp_shard);
}

void FlatParamHandle::Reshard(bool free_unsharded_flat_param) {
  at::NoGradGuard no_grad;
  // Switch to the sharded flat parameter before freeing.
  UseShardedFlatParam();
  if (free_unsharded_flat_param) FreeUnshardedFlatParam();
}

void FlatParamHandle::PostReshard() {
  // NO_SHARD's low precision shard is also its unsharded flat param: freed here.
  if (uses_param_mixed_precision() && !uses_sharded_strategy() && !force_full_precision()) {
    FreeLowPrecisionShardedParam();
  }
}

void FlatParamHandle::FreeUnshardedFlatParam() {
  CheckShardedStrategy();
  at::Tensor unsharded = GetPaddedUnshardedFlatParam();
  CheckOnComputeDevice(unsharded);
  ReleaseOrigParamsViewing(unsharded);
  ReleaseStorage(unsharded);
}

void FlatParamHandle::ReleaseOrigParamsViewing(const at::Tensor& storage_owner) {
  at::NoGradGuard no_grad;
  released_orig_data_.resize(orig_tensors_.size());
  for (size_t i = 0; i < orig_tensors_.size(); ++i) {
    at::Tensor& t = orig_tensors_[i];
    if (!SameStorage(t, storage_owner)) continue;
    at::Tensor& empty = released_orig_data_[i];
    // A fresh one where the dtype / device moved or something grew the last one in place.
    if (!empty.defined() || empty.scalar_type() != t.scalar_type() || empty.device() != t.device() ||
        StorageNbytes(empty) != 0 || empty.numel() != 0) {
      empty = EmptyLike0(t);
    }
    ReplaceData(t, empty);
  }
}

void FlatParamHandle::UseShardedFlatParam() {
  FlatParameter& fp = flat_param_;
  TORCH_CHECK(fp.local_shard.defined(), "FlatParamHandle::Reshard: call InitFlatParamAttributes() first");
  const bool in_forward = training_state_ == HandleTrainingState::FORWARD;
  const bool skip_use_sharded_views = options_.use_orig_params && at::GradMode::is_enabled() && in_forward &&
                                      !ReshardsAfterForward(options_.sharding_strategy) && uses_sharded_strategy();
  at::Tensor unsharded_flat_param;
  if (skip_use_sharded_views) unsharded_flat_param = fp.param.data();
  if (options_.offload_params) {
    TORCH_CHECK(fp.local_shard.device().is_cpu(), "Expects the local shard to be on CPU but got ",
                fp.local_shard.device());
  }
  ReplaceData(fp.param, fp.local_shard);
  if (!options_.use_orig_params) return;
  if (skip_use_sharded_views) {
    unsharded_flat_param_for_skipped_views_ = unsharded_flat_param;
  } else {
    UseShardedViews();
  }
  // Post-forward reshard: sharded gradient views (unsharded ones if a gradient was
  // accumulated in no_sync); the post-backward reshard defers them to after the reduction.
  if (in_forward && !skipped_use_sharded_views()) {
    const at::Tensor& grad = fp.param.grad();
    const bool accumulated_grad_in_no_sync =
        grad.defined() && uses_sharded_strategy() && grad.sizes() == c10::IntArrayRef(fp.unpadded_unsharded_size);
    if (accumulated_grad_in_no_sync) {
      UseUnshardedGradViews();
    } else {
      UseShardedGradViews();
    }
  }
}

// ----------------------------------------------------------------------------------------
// Views

std::vector<at::Tensor> FlatParamHandle::GetUnflatViews(const at::Tensor& tensor) const {
  return aligned_numel_ > 0 ? GetUnflatViewsAligned(tensor) : GetUnflatViewsUnaligned(tensor);
}

std::vector<at::Tensor> FlatParamHandle::GetUnflatViewsUnaligned(const at::Tensor& tensor) const {
  return UnflatTensors(tensor, /*aligned=*/false, /*aliases=*/false);
}

std::vector<at::Tensor> FlatParamHandle::GetUnflatViewsAligned(const at::Tensor& tensor) const {
  return UnflatTensors(tensor, /*aligned=*/true, /*aliases=*/false);
}

std::vector<at::Tensor> FlatParamHandle::UnflatAliases(const at::Tensor& tensor) const {
  return UnflatTensors(tensor, /*aligned=*/aligned_numel_ > 0, /*aliases=*/true);
}

std::vector<at::Tensor> FlatParamHandle::UnflatTensors(const at::Tensor& tensor, bool aligned, bool aliases) const {
  const FlatParameter& fp = flat_param_;
  const at::Tensor t = tensor.defined() ? tensor : fp.param.data();
  int64_t total = 0;
  if (aligned) {
    total = FlatTotalNumel(fp.segments);
  } else {
    for (int64_t n : fp.numels) total += n;
  }
  TORCH_CHECK(t.dim() == 1 && t.numel() == total, aligned ? "GetUnflatViewsAligned" : "GetUnflatViewsUnaligned",
              ": expects a 1-D tensor of ", total,
              aligned ? " elements (the unsharded flat parameter with alignment padding) but got shape "
                      : " elements (the unsharded flat parameter) but got shape ",
              c10::str(c10::IntArrayRef(t.sizes())));
  std::vector<at::Tensor> out;
  out.reserve(fp.num_params);
  if (aligned) {
    for (const FlatSegment& seg : fp.segments) {
      if (!seg.is_padding()) out.push_back(Slice(t, seg.start, seg.numel, fp.shapes[seg.param_index], aliases));
    }
  } else {
    int64_t offset = 0;
    for (int64_t i = 0; i < fp.num_params; ++i) {
      out.push_back(Slice(t, offset, fp.numels[i], fp.shapes[i], aliases));
      offset += fp.numels[i];
    }
  }
  return out;
}

void FlatParamHandle::UseUnshardedViews() {
  at::NoGradGuard no_grad;
  CheckUnsharded(flat_param_.param);
  // Aliases, not autograd views: set_data takes only their storage and geometry.
  const std::vector<at::Tensor>& views = UnshardedAliases();
  for (size_t i = 0; i < views.size(); ++i) ReplaceData(orig_tensors_[i], views[i]);
  // Aliases of a temporary buffer are not kept (they would keep it allocated).
  if (unsharded_alias_cache_.storage == nullptr) unsharded_alias_cache_.aliases.clear();
  // Shared registrations are the same tensors in C++: nothing more to swap.
}

const std::vector<at::Tensor>& FlatParamHandle::UnshardedAliases() {
  const FlatParameter& fp = flat_param_;
  const at::Tensor& flat = fp.param;
  const c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
  UnshardedAliasCache& cache = unsharded_alias_cache_;
  if (cache.storage == storage && cache.offset == flat.storage_offset() && cache.dtype == flat.scalar_type()) {
    return cache.aliases;
  }
  cache = UnshardedAliasCache{};
  cache.aliases = UnflatAliases();
  // Only a persistent buffer is remembered: a temporary one (NO_SHARD's, an offloaded
  // parameter's copy) would stay allocated through the aliases.
  const auto persistent = [&](const at::Tensor& buffer) {
    return buffer.defined() && buffer.storage().unsafeGetStorageImpl() == storage;
  };
  if (uses_sharded_strategy() && (persistent(fp.full_param_padded) || persistent(fp.full_prec_full_param_padded))) {
    cache.storage = storage;
    cache.offset = flat.storage_offset();
    cache.dtype = flat.scalar_type();
  }
  return cache.aliases;
}

void FlatParamHandle::UseShardedViews() {
  at::NoGradGuard no_grad;
  unsharded_flat_param_for_skipped_views_ = at::Tensor();
  if (!uses_sharded_strategy()) {
    // NO_SHARD: the unsharded parameter is at hand, so unflattened unsharded views.
    UseUnshardedViews();
    return;
  }
  FlatParameter& fp = flat_param_;
  CheckSharded(fp.param);
  const at::Tensor flat = fp.param.data();
  // One size-0 tensor for every parameter outside the local shard (as PyTorch).
  const at::Tensor size_0_empty = at::empty({0}, flat.options());
  for (int64_t i = 0; i < fp.num_params; ++i) {
    const ShardParamInfo& info = fp.shard_param_infos[i];
    if (!info.in_shard) {
      ReplaceData(orig_tensors_[i], size_0_empty);
    } else {
      ReplaceData(orig_tensors_[i], flat.narrow(0, info.offset_in_shard, info.numel_in_shard));
    }
  }
}

// ----------------------------------------------------------------------------------------
// Writeback

bool FlatParamHandle::WritebackOrigParams() {
  at::NoGradGuard no_grad;
  TORCH_CHECK(options_.use_orig_params, "WritebackOrigParams requires use_orig_params");
  FlatParameter& fp = flat_param_;
  if (uses_sharded_strategy() && !is_sharded(fp.param) && !skipped_use_sharded_views()) {
    return false;  // unsharded: nothing to write back (NO_SHARD may still need it)
  }
  const bool skipped = skipped_use_sharded_views();
  const at::Tensor flat_param_tensor =
      skipped && uses_sharded_strategy() ? unsharded_flat_param_for_skipped_views_ : fp.param;
  if (skipped && uses_sharded_strategy()) {
    TORCH_CHECK(StorageNbytes(flat_param_tensor) > 0,
                "If skipped using sharded views, the unsharded flat parameter should be allocated");
  }
  at::Tensor flat_param_grad = uses_sharded_strategy() || !options_.offload_params ? fp.param.grad() : fp.cpu_grad;
  bool wroteback = false;
  for (int64_t i = 0; i < fp.num_params; ++i) {
    const ShardParamInfo& info = fp.shard_param_infos[i];
    if (!info.in_shard) continue;
    const ParamInfo& pi = fp.param_infos[i];
    const auto module_params = pi.module->named_parameters(/*recurse=*/false);
    const at::Tensor* registered = module_params.find(pi.param_name);
    if (registered == nullptr || !registered->defined()) continue;  // deregistered: skip
    at::Tensor param = fp.params[i];
    const bool param_changed = !registered->is_same(param);
    const bool needs_param_writeback = param_changed || !SameStorage(param, flat_param_tensor);
    TORCH_CHECK(!(skipped && needs_param_writeback), "FSDP does not support changing the parameters between ",
                "forward and backward for ", ToString(options_.sharding_strategy), " (", fp.fqns[i], ")");
    if (param_changed) {
      // The gradient is not preserved after a parameter change.
      param = *registered;
      fp.params[i] = param;
      orig_tensors_[i] = param;
    }
    if (needs_param_writeback) {
      WritebackTensor(param, fp.param, i, info.numel_in_shard, info.offset_in_shard, true);
      wroteback = true;
    }
    if (skipped) continue;  // gradients are not exposed when sharded views were skipped
    if (!param.grad().defined() && fp.param.grad().defined()) {
      WritebackTensor(at::Tensor(), fp.param.grad(), i, info.numel_in_shard, info.offset_in_shard, false);
    } else if (param.grad().defined()) {
      // NO_SHARD + offload: cpu_grad owns the gradient storage; never a writeback.
      if (!uses_sharded_strategy() && options_.offload_params) continue;
      if (!flat_param_grad.defined() || !SameStorage(param.grad(), flat_param_grad)) {
        if (!flat_param_grad.defined()) flat_param_grad = at::zeros_like(fp.param.data());
        WritebackTensor(param.grad(), flat_param_grad, i, info.numel_in_shard, info.offset_in_shard, false);
        fp.param.mutable_grad() = flat_param_grad;
        flat_param_grad = fp.param.grad();
      }
    }
  }
  // Changing shared parameters would need the shared structures rebuilt (as PyTorch).
  for (const SharedParamInfo& spi : fp.shared_param_infos) {
    const auto params_a = spi.module->named_parameters(/*recurse=*/false);
    const auto params_b = spi.prim_module->named_parameters(/*recurse=*/false);
    const at::Tensor* a = params_a.find(spi.param_name);
    const at::Tensor* b = params_b.find(spi.prim_param_name);
    TORCH_CHECK_NOT_IMPLEMENTED(a != nullptr && b != nullptr && a->is_same(*b),
                                "Changing shared parameters is not supported yet (", spi.module_name, ".",
                                spi.param_name, " vs ", spi.prim_module_name, ".", spi.prim_param_name, ")");
  }
  return wroteback;
}

void FlatParamHandle::WritebackTensor(const at::Tensor& src, const at::Tensor& dst, int64_t tensor_index,
                                      int64_t expected_numel, int64_t offset, bool is_param) {
  if (src.defined()) {
    TORCH_CHECK(src.dim() == 1 && src.numel() == expected_numel, "Cannot writeback when the ",
                is_param ? "parameter" : "gradient", " shape changes\nExpects [", expected_numel, "] but got ",
                c10::str(c10::IntArrayRef(src.sizes())), " (", flat_param_.fqns[tensor_index], ")");
    dst.narrow(0, offset, expected_numel).copy_(src);
  } else {
    dst.narrow(0, offset, expected_numel).zero_();
    flat_param_.is_grad_none_mask.at(tensor_index) = true;
  }
}

}  // namespace fsdp::fsdp1
