#include "float8/fsdp_float8.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "comm/process_group.h"
#include "float8/float8_linear.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "mesh/device_mesh.h"

namespace fsdp::float8 {

fsdp2::AllGatherExtension::PreAllGatherResult Float8WeightAllGather::PreAllGather(
    const at::Tensor& sharded_param, const mesh::DeviceMesh& shard_mesh, const std::vector<int64_t>& orig_size,
    const MixedPrecisionPolicy& /*mp_policy: torchao casts the sharded weight itself*/) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(orig_size.size() == 2, "float8 all-gather: a Linear weight is 2-D, got size ",
              c10::IntArrayRef(orig_size));
  at::Tensor scale = precomputed_scale_;
  if (!scale.defined()) {
    // The shard dim is the mesh's last (HSDP's replicas hold the same weight).
    const at::Tensor amax = AllReduceAmax(TensorToAmax(sharded_param, ScalingGranularity::kTensorwise, std::nullopt),
                                          shard_mesh.group(shard_mesh.ndim() - 1));
    scale = AmaxToScale(amax, float8_dtype_, /*round_scales_to_power_of_2=*/false);
  }
  at::Tensor data = ToFloat8(sharded_param, scale, float8_dtype_, std::nullopt).data;
  // FSDP gathers padded shards: the rows of the largest shard.
  const int64_t world = shard_mesh.size(shard_mesh.ndim() - 1);
  const int64_t padded_rows = (orig_size[0] + world - 1) / world;
  if (data.size(0) < padded_rows) {
    data = at::cat({data, at::zeros({padded_rows - data.size(0), orig_size[1]}, data.options())});
  }
  orig_size_ = orig_size;
  return {{std::move(data)}, c10::IValue(scale)};
}

at::Tensor Float8WeightAllGather::PostAllGather(const std::vector<at::Tensor>& outputs, const c10::IValue& metadata,
                                                c10::ScalarType param_dtype, const at::Tensor& /*out*/) {
  TORCH_CHECK(outputs.size() == 1 && metadata.isTensor(), "float8 all-gather: expected one output and a scale");
  gathered_data_ = outputs[0].narrow(0, 0, orig_size_[0]).view(orig_size_);
  gathered_scale_ = metadata.toTensor();
  if (!placeholder_.defined() || placeholder_.scalar_type() != param_dtype ||
      placeholder_.sizes() != c10::IntArrayRef(orig_size_)) {
    placeholder_ = at::full({1}, std::numeric_limits<double>::quiet_NaN(), gathered_data_.options().dtype(param_dtype))
                       .expand(orig_size_);
  }
  return placeholder_;
}

std::optional<Float8Tensor> Float8WeightAllGather::Gathered(const at::Tensor& weight) const {
  if (!placeholder_.defined() || !weight.defined() || !weight.has_storage() ||
      weight.storage().unsafeGetStorageImpl() != placeholder_.storage().unsafeGetStorageImpl()) {
    return std::nullopt;
  }
  return Float8Tensor{gathered_data_, gathered_scale_, weight.scalar_type(), std::nullopt};
}

void precompute_float8_dynamic_scale_for_fsdp(torch::nn::Module& root) {
  at::NoGradGuard no_grad;
  absl::flat_hash_map<std::string, const fsdp2::FSDPParamInfo*> managed;
  const std::vector<fsdp2::FSDPGroupInfo> groups = fsdp2::ListFSDPGroups(root);
  for (const auto& group : groups) {
    for (const auto& p : group.params) managed.emplace(p.fqn, &p);
  }
  // The weights by the ranks their shards spread over (mesh and sharded dims): one stacked
  // all-reduce per dim of each; FSDP and FSDP + TP models have one such set.
  struct Reduction {
    mesh::DeviceMeshPtr mesh;
    std::vector<int> dims;
    std::vector<Float8WeightAllGather*> extensions;
    std::vector<at::Tensor> amaxes;
  };
  std::vector<Reduction> reductions;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    const auto f8 = AsFloat8Linear(*item.value());
    if (!f8 || !f8->weight_all_gather()) continue;
    const std::string fqn = item.key().empty() ? "weight" : item.key() + ".weight";
    const auto found = managed.find(fqn);
    TORCH_CHECK(found != managed.end(), "precompute_float8_dynamic_scale_for_fsdp: weight '", fqn,
                "' has the float8 all-gather but no fully_shard manages it");
    const at::Tensor& weight = f8->linear().weight;
    TORCH_CHECK(!f8->weight_all_gather()->Gathered(weight), "precompute_float8_dynamic_scale_for_fsdp: weight '", fqn,
                "' is unsharded; call it between steps (after the optimizer step)");
    Float8WeightAllGather* extension = f8->weight_all_gather().get();
    TORCH_CHECK(
        reductions.empty() || reductions.front().extensions.front()->float8_dtype() == extension->float8_dtype(),
        "precompute_float8_dynamic_scale_for_fsdp: float8 weights of different dtypes");
    const dtensor::DTensorSpec& spec = found->second->sharding_spec;
    std::vector<int> dims;
    for (int d = 0; d < spec.mesh->ndim(); ++d) {
      if (spec.placements[d].is_shard()) dims.push_back(d);
    }
    auto it = std::find_if(reductions.begin(), reductions.end(),
                           [&](const Reduction& r) { return r.mesh == spec.mesh && r.dims == dims; });
    if (it == reductions.end()) it = reductions.insert(reductions.end(), Reduction{spec.mesh, dims, {}, {}});
    it->extensions.push_back(extension);
    it->amaxes.push_back(TensorToAmax(weight, ScalingGranularity::kTensorwise, std::nullopt));
  }
  for (Reduction& r : reductions) {
    at::Tensor amax = at::stack(r.amaxes);
    for (const int d : r.dims) amax = AllReduceAmax(amax, r.mesh->group(d));
    // torchao clamps in the weights' dtype, then divides in float64.
    const c10::ScalarType weight_dtype = amax.scalar_type();
    at::Tensor scale = Float8Max(r.extensions.front()->float8_dtype()) / at::clamp(amax, kAmaxEps).to(at::kDouble);
    if (weight_dtype == at::kHalf) scale = at::clamp(scale, c10::nullopt, 65504.0);
    scale = scale.to(at::kFloat);
    for (size_t i = 0; i < r.extensions.size(); ++i) r.extensions[i]->set_precomputed_scale(scale[i]);
  }
}

}  // namespace fsdp::float8
