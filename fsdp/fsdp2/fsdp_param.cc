#include "fsdp/fsdp2/fsdp_param.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "fsdp/common/storage.h"
#include "fsdp/meta/meta.h"

namespace fsdp::fsdp2 {
namespace {

at::Tensor CastIfNeeded(const at::Tensor& t, std::optional<c10::ScalarType> dtype) {
  return dtype && t.scalar_type() != *dtype ? t.to(*dtype) : t;
}

// An extension's placeholder for the unsharded data (AllGatherExtension::PostAllGather).
bool IsPlaceholder(const at::Tensor& data, const std::vector<int64_t>& orig_size, c10::ScalarType dtype) {
  if (!data.defined() || data.scalar_type() != dtype || data.sizes() != c10::IntArrayRef(orig_size)) return false;
  for (const int64_t s : data.strides()) {
    if (s != 0) return false;
  }
  return true;
}

}  // namespace

FSDPParam::FSDPParam(at::Tensor param, ParamModuleInfo module_info, FSDPMeshInfo mesh_info,
                     std::optional<FSDPMeshInfo> post_forward_mesh_info, int64_t shard_dim,
                     const MixedPrecisionPolicy& mp_policy, OffloadPolicy offload_policy,
                     std::optional<dtensor::DTensorSpec> tp_spec, c10::Device device)
    : param_(std::move(param)),
      module_info_(std::move(module_info)),
      mesh_info_(std::move(mesh_info)),
      post_forward_mesh_info_(std::move(post_forward_mesh_info)),
      offload_(offload_policy),
      tp_spec_(std::move(tp_spec)),
      orig_dtype_(param_.scalar_type()) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(param_.is_contiguous(), "FSDP does not support non-contiguous parameters yet: ", module_info_.param_name,
              " shape=", c10::str(c10::IntArrayRef(param_.sizes())),
              " stride=", c10::str(c10::IntArrayRef(param_.strides())));
  TORCH_CHECK(param_.dim() >= 1, "FSDP does not support 0-D parameters: ", module_info_.param_name,
              " (view it as shape [1])");
  if (shard_dim < 0) shard_dim += param_.dim();
  TORCH_CHECK(shard_dim >= 0 && shard_dim < param_.dim(), "Shard dim ", shard_dim, " is invalid for ", param_.dim(),
              "D tensor: ", c10::str(c10::IntArrayRef(param_.sizes())));
  const int64_t world = mesh_info_.shard_size();
  TORCH_CHECK(shard_dim == 0 || param_.size(shard_dim) % world == 0, "FSDP does not support uneven sharding on dim ",
              shard_dim, ": ", c10::str(c10::IntArrayRef(param_.sizes())), " (world size: ", world, ")");
  layout_ = MakeDimShardLayout(param_.sizes().vec(), shard_dim, world, mesh_info_.shard_rank());

  // FSDP owns the padded sharded storage; the sharded parameter is a view into it. A meta
  // parameter has no values to copy: its shard is allocated on the compute device and
  // filled later (deferred init).
  needs_init_ = param_.is_meta();
  device_ = needs_init_ ? device : param_.device();
  at::Tensor padded = at::zeros(layout_.padded_sharded_size, param_.options().device(device_));
  const int64_t rows = layout_.sharded_size[shard_dim];
  if (rows > 0 && !needs_init_) padded.narrow(shard_dim, 0, rows).copy_(param_.narrow(shard_dim, layout_.offset, rows));
  if (offload_.offload_to_cpu) {
    padded = padded.cpu();
    if (offload_.pin_memory && !device_.is_cpu()) padded = padded.pin_memory();
  }
  sharded_param_data_ = padded.view(-1);
  sharded_local_ = padded.narrow(shard_dim, 0, rows);
  TORCH_INTERNAL_ASSERT(sharded_local_.is_contiguous());
  InitShardingSpec(layout_.orig_size, orig_dtype_);
  if (post_forward_mesh_info_) {
    const auto pf = MakeDimShardLayout(layout_.orig_size, 0, post_forward_mesh_info_->shard_size(),
                                       post_forward_mesh_info_->shard_rank());
    post_forward_size_ = pf.sharded_size;
  }
  SetParamData(sharded_local_);
  InitDtypeAttrs(mp_policy);
}

void FSDPParam::InitShardingSpec(const std::vector<int64_t>& local_size, c10::ScalarType dtype) {
  using dtensor::Placement;
  const Placement fsdp = Placement::Shard(layout_.shard_dim);
  if (mesh_info_.is_spmd_mesh()) {
    TORCH_CHECK(tp_spec_.has_value(),
                "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh (e.g. via "
                "distribute_module; in C++ a DistributedParameterModule spec). Got plain tensor for parameter '",
                module_info_.param_name, "'.");
    InitShardingSpecSpmd(dtype);
    return;
  }
  const bool hsdp = mesh_info_.kind == FSDPMeshInfo::Kind::kHsdp;
  sharding_spec_fsdp_dim_ = mesh_info_.shards() ? (hsdp ? 1 : 0) : -1;
  if (!tp_spec_) {
    dtensor::Placements placements;
    switch (mesh_info_.kind) {
      case FSDPMeshInfo::Kind::kFsdp: placements = {fsdp}; break;
      case FSDPMeshInfo::Kind::kHsdp: placements = {Placement::Replicate(), fsdp}; break;
      case FSDPMeshInfo::Kind::kDdp: placements = {Placement::Replicate()}; break;
    }
    sharding_spec_ = dtensor::DTensorSpec::Make(mesh_info_.mesh, placements, local_size, dtype);
    return;
  }
  // FSDP + TP: FSDP's dim-0 chunk of the TP shard is a StridedShard of the global tensor
  // with split factor = the number of TP shards of that dim.
  TORCH_CHECK(tp_spec_->placements.size() <= 2, "FSDP only supports 1D TP/EP or 2D EP+TP, not ",
              dtensor::ToString(tp_spec_->placements));
  int64_t split_factor = 1;
  for (size_t m = 0; m < tp_spec_->placements.size(); ++m) {
    if (tp_spec_->placements[m].is_shard(layout_.shard_dim)) split_factor *= tp_spec_->mesh->size(static_cast<int>(m));
  }
  dtensor::Placements placements;
  if (hsdp) placements.push_back(Placement::Replicate());
  if (mesh_info_.kind == FSDPMeshInfo::Kind::kDdp) {
    placements.push_back(Placement::Replicate());
  } else {
    placements.push_back(split_factor > 1 ? Placement::StridedShard(layout_.shard_dim, split_factor) : fsdp);
  }
  for (const Placement& p : tp_spec_->placements) placements.push_back(p);
  auto spmd_mesh = mesh::Concatenate({mesh_info_.mesh, tp_spec_->mesh});
  sharding_spec_ = dtensor::DTensorSpec::Make(spmd_mesh, placements, tp_spec_->shape, dtype);
}

// The parameter is a DTensor on the whole SPMD mesh, Replicate on the data-parallel dims;
// FSDP turns each dp shard dim into Shard, or StridedShard when mesh dims to its right shard
// the same tensor dim (they split first, so FSDP's chunks interleave with theirs). Several dp
// shard dims become one flattened dim in the first one's place (PyTorch 2.15's
// _build_spmd_sharding_spec; HSDP: after a Replicate for the replicate dims, dropped there).
void FSDPParam::InitShardingSpecSpmd(c10::ScalarType dtype) {
  using dtensor::Placement;
  const mesh::DeviceMeshPtr& spmd = mesh_info_.spmd_mesh;
  // PyTorch compares mesh objects; meshes here are values, so: same ranks, shape and names.
  TORCH_CHECK(dtensor::SameMesh(*tp_spec_->mesh, *spmd) && tp_spec_->mesh->dim_names() == spmd->dim_names(),
              "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but got different mesh "
              "objects: ",
              tp_spec_->mesh->ToString(), " vs ", spmd->ToString(), " (", module_info_.param_name, ")");
  const dtensor::Placements& orig = tp_spec_->placements;
  const std::vector<int>& shard_dims = mesh_info_.spmd_dp_shard_dims;
  const std::vector<int>& replicate_dims = mesh_info_.spmd_dp_replicate_dims;
  auto expect_replicate = [&](const std::vector<int>& dims, const char* what) {
    for (int idx : dims) {
      TORCH_CHECK(orig[idx].is_replicate(), "Expected Replicate() on DP ", what, " dim '", spmd->dim_names()[idx],
                  "' (index ", idx, ") but got ", orig[idx].ToString());
    }
  };
  expect_replicate(shard_dims, "shard");
  expect_replicate(replicate_dims, "replicate");
  dtensor::Placements placements = orig;
  for (int d : shard_dims) {
    int64_t split_factor = 1;
    for (int j = d + 1; j < spmd->ndim(); ++j) {
      if (orig[j].is_shard(layout_.shard_dim)) split_factor *= spmd->size(j);
    }
    placements[d] = split_factor > 1 ? Placement::StridedShard(layout_.shard_dim, split_factor)
                                     : Placement::Shard(layout_.shard_dim);
  }
  if (shard_dims.size() <= 1) {
    sharding_spec_fsdp_dim_ = shard_dims.empty() ? -1 : shard_dims[0];
    sharding_spec_ = dtensor::DTensorSpec::Make(spmd, placements, tp_spec_->shape, dtype);
    return;
  }
  const bool hsdp = mesh_info_.kind == FSDPMeshInfo::Kind::kHsdp;
  auto contains = [](const std::vector<int>& dims, int d) {
    return std::find(dims.begin(), dims.end(), d) != dims.end();
  };
  std::vector<mesh::DeviceMeshPtr> submeshes;
  dtensor::Placements spec_placements;
  for (int d = 0; d < spmd->ndim(); ++d) {
    if (d == shard_dims[0]) {
      submeshes.push_back(mesh_info_.mesh);  // HSDP: (replicate, shard), both flattened as needed
      if (hsdp) spec_placements.push_back(Placement::Replicate());
      sharding_spec_fsdp_dim_ = static_cast<int>(spec_placements.size());
      spec_placements.push_back(placements[d]);
    } else if (!contains(shard_dims, d) && !(hsdp && contains(replicate_dims, d))) {
      submeshes.push_back((*spmd)[spmd->dim_names()[d]]);
      spec_placements.push_back(placements[d]);
    }
  }
  sharding_spec_ = dtensor::DTensorSpec::Make(mesh::Concatenate(submeshes), spec_placements, tp_spec_->shape, dtype);
}

void FSDPParam::InitDtypeAttrs(const MixedPrecisionPolicy& policy) {
  orig_dtype_ = sharded_local_.scalar_type();
  const ResolvedDtypes resolved = ResolveDtypes(policy, orig_dtype_);
  param_dtype_ = resolved.param_dtype;
  reduce_dtype_ = resolved.reduce_dtype;
}

void FSDPParam::AssertInStates(std::initializer_list<ShardedState> states, const char* what) const {
  for (ShardedState s : states) {
    if (s == sharded_state_) return;
  }
  std::vector<std::string> names;
  for (ShardedState s : states) names.push_back(fsdp::ToString(s));
  TORCH_CHECK(false, "FSDPParam(", fqn_, ")::", what, ": expects to be in one of [", absl::StrJoin(names, ", "),
              "], not ", fsdp::ToString(sharded_state_));
}

void FSDPParam::SwapGrad(at::Tensor& incoming, at::Tensor& outgoing) {
  // Moves, not copies: each copy of a gradient is an atomic reference-count round trip, and
  // this runs twice per parameter per unshard / reshard. mutable_grad() is grad()'s tensor
  // without its non-leaf warning check (parameters are leaves).
  at::Tensor& grad = param_.mutable_grad();
  outgoing = std::move(grad);
  grad = std::move(incoming);
  incoming = at::Tensor();
}

void FSDPParam::SetParamData(const at::Tensor& data) {
  // set_data (also from and to the meta device for deferred init), without the dispatcher
  // when dtype and device stay. Records nothing for autograd, so no NoGradGuard (two
  // thread-local switches per call, on a per-step path; docs/design/measured-choices.md).
  ::fsdp::ReplaceData(param_, data);
}

int64_t FSDPParam::AllGatherInputNumel() const {
  if (extension_) {
    int64_t bytes = 0;
    for (const auto& t : extension_inputs_) bytes += t.numel() * static_cast<int64_t>(t.element_size());
    return bytes;
  }
  return sharded_state_ == ShardedState::kShardedPostForward ? post_forward_data_.numel() : sharded_param_data_.numel();
}

at::Tensor FSDPParam::AllGatherInput() {
  AssertInStates({ShardedState::kSharded, ShardedState::kShardedPostForward}, "all_gather_inputs");
  if (sharded_state_ == ShardedState::kShardedPostForward) {
    return post_forward_data_;  // already in the parameter dtype
  }
  if (extension_) return ExtensionAllGatherInput();
  // Straight from the member (a local copy first would cost one more reference-count round
  // trip); an offloaded shard goes to the compute device first (asynchronously from pinned
  // memory).
  if (sharded_param_data_.device() == device_) return CastIfNeeded(sharded_param_data_, param_dtype_);
  return CastIfNeeded(sharded_param_data_.to(device_, /*non_blocking=*/sharded_param_data_.is_pinned()), param_dtype_);
}

void FSDPParam::SetAllGatherExtension(std::shared_ptr<AllGatherExtension> extension, MixedPrecisionPolicy mp_policy) {
  TORCH_CHECK(layout_.shard_dim == 0, "All-gather extensions need dim-0 sharding; ", module_info_.param_name,
              " is sharded on dim ", layout_.shard_dim);
  TORCH_CHECK(!post_forward_mesh_info_ || post_forward_mesh_info_->mesh == mesh_info_.mesh,
              "Resharding to a post-forward mesh (reshard_after_forward as an int) is not supported with an "
              "all-gather extension (",
              module_info_.param_name, ")");
  extension_ = std::move(extension);
  extension_mp_policy_ = std::move(mp_policy);
}

// fsdp_pre_all_gather: the extension's inputs, checked, packed as bytes (they share the
// group's byte-packed all-gather with the other parameters).
at::Tensor FSDPParam::ExtensionAllGatherInput() {
  AllGatherExtension::PreAllGatherResult pre =
      extension_->PreAllGather(sharded_local_, *mesh_info_.mesh, layout_.orig_size, extension_mp_policy_);
  TORCH_CHECK(!pre.inputs.empty(), "fsdp_pre_all_gather of ", module_info_.param_name, " returned no inputs");
  if (layout_.sharded_size != layout_.padded_sharded_size) {
    for (const auto& t : pre.inputs) {
      TORCH_CHECK(
          t.sizes() == c10::IntArrayRef(layout_.padded_sharded_size),
          "When a parameter is unevenly sharded by FSDP (orig size=", c10::str(c10::IntArrayRef(layout_.orig_size)),
          ", FSDP world size=", mesh_info_.shard_size(),
          "), fsdp_pre_all_gather must return all-gather inputs with the padded sharded size ",
          c10::str(c10::IntArrayRef(layout_.padded_sharded_size)), " but got ", c10::str(c10::IntArrayRef(t.sizes())));
    }
  }
  std::vector<at::Tensor> bytes;
  for (const auto& t : pre.inputs) {
    TORCH_CHECK(t.dim() >= 1, "fsdp_pre_all_gather of ", module_info_.param_name, " returned a 0-D input");
    bytes.push_back(t.contiguous().view(-1).view(at::kByte));
  }
  extension_inputs_ = std::move(pre.inputs);
  extension_metadata_ = std::move(pre.metadata);
  return at::cat(bytes);
}

// fsdp_post_all_gather: splits the gathered bytes into each input gathered over the ranks
// ([world * rows, ...]) and lets the extension rebuild the unsharded data, in place after the
// first time.
void FSDPParam::InitExtensionUnshardedParam() {
  const int64_t world = all_gather_output_.numel() / AllGatherInputNumel();
  const at::Tensor rows = all_gather_output_.view({world, -1});
  std::vector<at::Tensor> outputs;
  int64_t offset = 0;
  for (const auto& input : extension_inputs_) {
    const int64_t n = input.numel() * static_cast<int64_t>(input.element_size());
    std::vector<int64_t> gathered = input.sizes().vec();
    gathered[0] *= world;
    outputs.push_back(rows.narrow(1, offset, n).contiguous().view(input.scalar_type()).view(gathered));
    offset += n;
  }
  const c10::ScalarType dtype = param_dtype_.value_or(orig_dtype_);
  if (extension_unsharded_.defined()) AllocStorage(extension_unsharded_);
  at::Tensor data = extension_->PostAllGather(outputs, extension_metadata_, dtype, extension_unsharded_);
  if (IsPlaceholder(data, layout_.orig_size, dtype)) {
    TORCH_CHECK(!extension_unsharded_.defined(), "fsdp_post_all_gather of ", module_info_.param_name,
                " returned a placeholder after returning unsharded data");
    unsharded_view_ = data;
    extension_inputs_.clear();
    extension_metadata_ = c10::IValue();
    return;
  }
  TORCH_CHECK(
      data.defined() && data.numel() == Numel(layout_.orig_size) && data.scalar_type() == dtype && data.is_contiguous(),
      "fsdp_post_all_gather of ", module_info_.param_name, " must return a contiguous ", c10::toString(dtype),
      " tensor of ", Numel(layout_.orig_size), " elements, got ",
      data.defined() ? data.toString() + c10::str(c10::IntArrayRef(data.sizes())) : std::string("undefined"));
  if (!extension_unsharded_.defined()) {
    extension_unsharded_ = data;
    unsharded_view_ = data.as_strided(layout_.orig_size, dtensor::ContiguousStride(layout_.orig_size), 0);
  } else {
    TORCH_CHECK(data.is_same(extension_unsharded_) || data.data_ptr() == extension_unsharded_.data_ptr(),
                "fsdp_post_all_gather of ", module_info_.param_name,
                " must write into `out` after the first all-gather (autograd may hold views of it)");
  }
  extension_inputs_.clear();
  extension_metadata_ = c10::IValue();
}

const at::Tensor& FSDPParam::InitAllGatherOutput(int64_t world_size) {
  const int64_t numel = world_size * AllGatherInputNumel();
  const c10::ScalarType dtype = extension_ ? at::kByte : param_dtype_.value_or(orig_dtype_);
  if (!all_gather_output_.defined() || all_gather_output_.numel() != numel ||
      all_gather_output_.scalar_type() != dtype) {
    // Recreated only when the dtype policy changed before the first forward.
    all_gather_output_ = at::empty({numel}, sharded_param_data_.options().dtype(dtype));
    if (!extension_) unsharded_view_ = at::Tensor();
  }
  return all_gather_output_;
}

void FSDPParam::AllocAllGatherOutput() { AllocStorage(all_gather_output_); }

void FSDPParam::InitUnshardedParam() {
  if (extension_) {
    InitExtensionUnshardedParam();
    return;
  }
  if (unsharded_view_.defined()) return;  // same storage across unshards
  unsharded_view_ = all_gather_output_.as_strided(layout_.orig_size, dtensor::ContiguousStride(layout_.orig_size), 0);
}

void FSDPParam::FreeUnshardedParam() {
  if (all_gather_output_.defined()) FreeStorage(all_gather_output_);
  if (extension_unsharded_.defined()) FreeStorage(extension_unsharded_);
}

void FSDPParam::ToSharded() {
  if (sharded_state_ == ShardedState::kUnsharded) SwapGrad(stashed_sharded_grad_, stashed_unsharded_grad_);
  SetParamData(sharded_local_);
  FreeUnshardedParam();
  post_forward_data_ = at::Tensor();
  sharded_state_ = ShardedState::kSharded;
}

void FSDPParam::ToShardedPostForward() {
  TORCH_CHECK(!is_dtensor(), "Resharding to smaller mesh is not supported for DTensor parameters yet");
  AssertInStates({ShardedState::kUnsharded}, "to_sharded_post_forward");
  TORCH_INTERNAL_ASSERT(post_forward_mesh_info_.has_value());
  const int64_t world = post_forward_mesh_info_->shard_size();
  const int64_t numel = all_gather_output_.numel();
  TORCH_CHECK(numel % world == 0, "All-gather output size (", numel, ") must be divisible by the shard world size (",
              world, ")");
  const int64_t shard_numel = numel / world;
  // A copy, so that the full all-gather output can be freed.
  post_forward_data_ =
      all_gather_output_.narrow(0, shard_numel * post_forward_mesh_info_->shard_rank(), shard_numel).clone();
  SwapGrad(stashed_sharded_grad_, stashed_unsharded_grad_);
  SetParamData(post_forward_data_.as_strided(post_forward_size_, dtensor::ContiguousStride(post_forward_size_), 0));
  FreeUnshardedParam();
  sharded_state_ = ShardedState::kShardedPostForward;
}

void FSDPParam::ToUnsharded() {
  TORCH_INTERNAL_ASSERT(unsharded_view_.defined(), "ToUnsharded before InitUnshardedParam");
  if (sharded_state_ != ShardedState::kUnsharded) SwapGrad(stashed_unsharded_grad_, stashed_sharded_grad_);
  SetParamData(unsharded_view_);
  post_forward_data_ = at::Tensor();
  sharded_state_ = ShardedState::kUnsharded;
}

at::Tensor FSDPParam::TakeUnshardedGrad() {
  if (unsharded_accumulated_grad_.defined()) {
    at::Tensor g = std::move(unsharded_accumulated_grad_);
    unsharded_accumulated_grad_ = at::Tensor();
    return g;
  }
  at::Tensor g;
  if (sharded_state_ == ShardedState::kUnsharded) {
    g = std::move(param_.mutable_grad());
  } else {
    g = std::move(stashed_unsharded_grad_);
    stashed_unsharded_grad_ = at::Tensor();
  }
  return g;
}

void FSDPParam::ToAccumulatedGradIfNeeded() {
  at::Tensor& grad = sharded_state_ == ShardedState::kUnsharded ? param_.mutable_grad() : stashed_unsharded_grad_;
  if (!grad.defined() || grad.scalar_type() == unsharded_grad_dtype()) return;
  unsharded_accumulated_grad_ = grad.to(unsharded_grad_dtype());
  grad = at::Tensor();
}

void FSDPParam::AccumulateUnshardedGradIfNeeded() {
  at::Tensor& grad = sharded_state_ == ShardedState::kUnsharded ? param_.mutable_grad() : stashed_unsharded_grad_;
  if (!unsharded_accumulated_grad_.defined() || !grad.defined()) return;
  at::NoGradGuard no_grad;
  unsharded_accumulated_grad_.add_(grad);
  grad = at::Tensor();
}

at::Tensor FSDPParam::AdoptShardedGrad(const at::Tensor& sharded_grad) {
  TORCH_CHECK(sharded_grad.sizes() == c10::IntArrayRef(layout_.sharded_size), "FSDPParam(", fqn_, "): expects size ",
              c10::str(c10::IntArrayRef(layout_.sharded_size)), " but got ",
              c10::str(c10::IntArrayRef(sharded_grad.sizes())));
  at::Tensor& grad = sharded_state_ == ShardedState::kUnsharded ? stashed_sharded_grad_ : param_.mutable_grad();
  if (grad.defined()) return grad;
  grad = sharded_grad;
  return at::Tensor();
}

at::Tensor FSDPParam::sharded_grad() const {
  return sharded_state_ == ShardedState::kUnsharded ? stashed_sharded_grad_ : param_.grad();
}

void FSDPParam::ResetShardedParam() {
  AssertInStates({ShardedState::kSharded}, "reset_sharded_param");
  const at::Tensor current = param_.data();
  if (current.is_alias_of(sharded_param_data_)) return;  // unchanged or changed in place
  TORCH_CHECK(current.sizes() == c10::IntArrayRef(layout_.sharded_size), "FSDPParam(", fqn_,
              ")::reset_sharded_param: expects size ", c10::str(c10::IntArrayRef(layout_.sharded_size)), " but got ",
              c10::str(c10::IntArrayRef(current.sizes())));
  at::NoGradGuard no_grad;
  const int64_t rows = layout_.sharded_size[layout_.shard_dim];
  const int64_t padded_numel = sharded_param_data_.numel();
  // As reset_sharded_param (torch/distributed/fsdp/_fully_shard/_fsdp_param.py): a new local
  // tensor whose storage is laid out like the padded shard becomes the sharded storage (no
  // copy; dcp::Load stages its reads so); its padding is zeroed, as PyTorch's new_zeros pad.
  if (layout_.shard_dim == 0 && current.is_contiguous() && current.storage_offset() == 0 &&
      current.device() == sharded_param_data_.device() && current.dtype() == sharded_param_data_.dtype() &&
      current.is_pinned() == sharded_param_data_.is_pinned() &&
      current.storage().nbytes() == static_cast<size_t>(padded_numel) * current.element_size()) {
    sharded_param_data_ = at::empty({0}, current.options()).set_(current.storage(), 0, {padded_numel});
    if (padded_numel > current.numel()) {
      sharded_param_data_.narrow(0, current.numel(), padded_numel - current.numel()).zero_();
    }
    sharded_local_ = sharded_param_data_.view(layout_.padded_sharded_size).narrow(0, 0, rows);
    SetParamData(sharded_local_);
    return;
  }
  at::Tensor padded = at::zeros(layout_.padded_sharded_size, current.options());
  if (rows > 0) padded.narrow(layout_.shard_dim, 0, rows).copy_(current);
  sharded_param_data_ = padded.view(-1);
  sharded_local_ = padded.narrow(layout_.shard_dim, 0, rows);
  SetParamData(sharded_local_);
}

void FSDPParam::InitShard(const at::Tensor& shard) {
  AssertInStates({ShardedState::kSharded}, "init_shard");
  TORCH_CHECK(shard.sizes() == c10::IntArrayRef(layout_.sharded_size), "FSDPParam(", fqn_,
              ")::InitShard: expects size ", c10::str(c10::IntArrayRef(layout_.sharded_size)), " but got ",
              c10::str(c10::IntArrayRef(shard.sizes())));
  at::NoGradGuard no_grad;
  if (shard.numel() > 0) sharded_local_.copy_(shard);
  SetParamData(sharded_local_);
  needs_init_ = false;
}

dtensor::DTensor FSDPParam::ShardedDTensor() const {
  return dtensor::DTensor::FromSpec(sharded_local_, sharding_spec_);
}

dtensor::DTensor FSDPParam::ShardedGradDTensor() const {
  const at::Tensor g = sharded_grad();
  return g.defined() ? dtensor::DTensor::FromSpec(g, sharding_spec_) : dtensor::DTensor();
}

std::string FSDPParam::ToString() const {
  return absl::StrCat("FSDPParam(fqn=", fqn_, ", orig_size=", c10::str(c10::IntArrayRef(layout_.orig_size)), ")");
}

}  // namespace fsdp::fsdp2
