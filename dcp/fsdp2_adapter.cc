// The checkpoint adapter of fully_shard'ed (FSDP2) models (dcp/adapter.h), registered for
// the kind "fully_shard": each FSDPParam's sharded parameter is a DTensor (Shard on the FSDP
// mesh, (Replicate, Shard) for HSDP, (StridedShard, TP placements) for FSDP + TP), saved as
// the boxes of its local tensor, as torch/distributed/checkpoint/state_dict.py
// _get_model_state_dict hands DCP the DTensors. The optimizer holds the sharded parameters
// themselves, so the core's default optimizer functions serve.
#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "dcp/adapter.h"
#include "dcp/plan.h"
#include "dcp/tp_adapter.h"
#include "distributed_parameters/distributed_parameters.h"
#include "dtensor/dtensor_spec.h"
#include "fsdp/fsdp2/fsdp_param.h"
#include "fsdp/fsdp2/state_dict.h"

namespace fsdp::dcp::internal {
namespace {

using dtensor::Segment;

int64_t RunsLength(const std::vector<Segment>& runs) {
  int64_t n = 0;
  for (const Segment& s : runs) n += s.length;
  return n;
}

// The positions [start, start + length) of the concatenation of `runs`, as global runs.
std::vector<Segment> NarrowRuns(const std::vector<Segment>& runs, int64_t start, int64_t length) {
  std::vector<Segment> out;
  int64_t pos = 0;  // local position of the current run's first index
  for (const Segment& s : runs) {
    const int64_t lo = std::max(start, pos), hi = std::min(start + length, pos + s.length);
    if (hi > lo) out.push_back({s.start + (lo - pos), hi - lo});
    pos += s.length;
  }
  return out;
}

// The boxes of `p`'s sharded parameter: FSDP's chunk along its shard dim of the
// tensor-parallel local tensor (whose runs are dtensor::LocalSegments of the TP spec; no TP:
// the whole tensor). This is FSDPParam's actual layout, also where the StridedShard spec
// would not describe it (uneven TP). Precondition: `p` is resharded.
std::vector<Box> ShardBoxes(const fsdp2::FSDPParam& p) {
  const std::vector<int64_t>& global = p.sharding_spec().shape;
  const std::vector<int64_t>& local = p.sharded_size();
  const size_t dims = global.size();
  TORCH_CHECK(local.size() == dims, "dcp: parameter '", p.fqn(), "' has a shard of size ",
              c10::str(c10::IntArrayRef(local)), " for its global size ", c10::str(c10::IntArrayRef(global)));
  int64_t global_numel = 1;
  for (int64_t s : global) global_numel *= s;
  if (global_numel == 0) return {WholeBox(global)};
  std::vector<std::vector<Segment>> runs;
  if (const auto& tp = p.tp_spec()) {
    runs = dtensor::LocalSegments(tp->shape, tp->mesh->shape(), tp->mesh->coordinate(), tp->placements);
  } else {
    for (int64_t s : global) runs.push_back({Segment{0, s}});
  }
  const DimShardLayout& layout = p.layout();
  const int64_t d = layout.shard_dim;
  runs[d] = NarrowRuns(runs[d], layout.offset, layout.sharded_size[d]);
  for (size_t k = 0; k < dims; ++k) {
    TORCH_CHECK(RunsLength(runs[k]) == local[k], "dcp: parameter '", p.fqn(), "' holds ", RunsLength(runs[k]),
                " indices of dim ", k, " on this rank, but its local tensor has size ",
                c10::str(c10::IntArrayRef(local)));
  }
  return RunBoxes(runs);
}

class Fsdp2Param : public ShardedParam {
 public:
  explicit Fsdp2Param(fsdp2::FSDPParam& p)
      : ShardedParam(p.sharding_spec().shape, p.sharded_size(), ShardBoxes(p), p.ShardedDTensor().to_local().detach(),
                     p.param()),
        p_(p) {}

  at::Tensor Gather(const at::Tensor& local) const override { return fsdp2::GatherLikeParam(p_, local); }

  // For a parameter sharded on dim 0, laid out like its padded shard (zero padding), so that
  // FSDPParam::ResetShardedParam adopts its storage instead of copying it (CommitShard).
  at::Tensor Staging(at::ScalarType dtype) const override {
    const at::Tensor& shard = p_.sharded_param_data();
    if (!shard.defined() || p_.shard_dim() != 0 || shard.scalar_type() != dtype || !shard.is_cpu()) {
      return ShardedParam::Staging(dtype);
    }
    const int64_t padded = shard.numel();
    int64_t numel = 1;
    for (int64_t s : local_size()) numel *= s;
    at::Tensor flat = at::empty({padded}, at::TensorOptions().dtype(dtype));
    if (padded > numel) flat.narrow(0, numel, padded - numel).zero_();
    return flat.narrow(0, 0, numel).view(local_size());
  }

  void Commit(const at::Tensor& value) const override {
    const at::Tensor& param = p_.param();
    if (value.is_same(param)) {
      // read in place
    } else if (value.device() == param.device() && value.dtype() == param.dtype() && !param.is_meta()) {
      param.set_data(value);  // ResetShardedParam adopts a Staging tensor's storage
    } else {
      param.data().copy_(value);
    }
    p_.ResetShardedParam();  // PyTorch's load_state_dict post-hook
    p_.MarkInitialized();    // deferred init (fsdp/fsdp2/meta_init.h)
  }

 private:
  fsdp2::FSDPParam& p_;
};

// Tensor-parallel parameters outside every fully_shard (e.g. a parallelized head next to
// fully_shard'ed blocks) are their DTensor boxes, as a TP-only model's (tp_adapter.h).
class Fsdp2Adapter : public ModelAdapter {
 public:
  Fsdp2Adapter(torch::nn::Module& model, const char* caller) {
    absl::flat_hash_map<const c10::TensorImpl*, const ShardedParam*> by_impl;
    const auto tp_specs = distributed_parameters::DistributedParameterSpecs(model);
    for (const fsdp2::NamedParameter& p : fsdp2::NamedParameters(model)) {  // reshards
      if (p.fsdp_param == nullptr) {
        const auto spec = tp_specs.find(p.param.unsafeGetTensorImpl());
        if (spec == tp_specs.end() || by_impl.contains(p.param.unsafeGetTensorImpl())) continue;
        params_.push_back(MakeTensorParallelParam(spec->second, p.param, p.fqn, caller));
        by_impl.emplace(p.param.unsafeGetTensorImpl(), params_.back().get());
        continue;
      }
      if (world_ == nullptr) {
        world_ = p.fsdp_param->sharding_spec().mesh->world();
        device_ = p.fsdp_param->device();
      }
      params_.push_back(std::make_unique<Fsdp2Param>(*p.fsdp_param));
      by_impl.emplace(p.param.unsafeGetTensorImpl(), params_.back().get());
    }
    for (const auto& item : model.named_parameters(/*recurse=*/true)) {  // tied parameters: each name
      if (!item.value().defined()) continue;
      auto it = by_impl.find(item.value().unsafeGetTensorImpl());
      if (it != by_impl.end()) by_fqn_.emplace(item.key(), it->second);
    }
  }

  comm::ProcessGroupPtr world() const override { return world_; }
  c10::Device device() const override { return device_; }
  const ShardedParam* Sharded(const std::string& fqn) const override {
    auto it = by_fqn_.find(fqn);
    return it == by_fqn_.end() ? nullptr : it->second;
  }

 private:
  comm::ProcessGroupPtr world_;
  c10::Device device_{c10::kCPU};
  std::vector<std::unique_ptr<ShardedParam>> params_;
  std::map<std::string, const ShardedParam*> by_fqn_;
};

std::unique_ptr<ModelAdapter> MakeFsdp2Adapter(torch::nn::Module& model, const char* caller) {
  return std::make_unique<Fsdp2Adapter>(model, caller);
}

const bool kFsdp2AdapterRegistered = RegisterModelAdapter("fully_shard", &MakeFsdp2Adapter);

}  // namespace
}  // namespace fsdp::dcp::internal
