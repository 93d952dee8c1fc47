// The checkpoint adapter of tensor-parallel models without FSDP (adapter.h): parameters whose
// layout a distributed_parameters::DistributedParameterModule publishes (a parallel style's hook) are DTensor shards
// whose layout is their module's spec; everything else is whole. Part of the core (no FSDP
// code): AdapterFor picks it for a model with such modules and no FSDP state.
#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "dcp/adapter.h"
#include "dcp/plan.h"
#include "dcp/tp_adapter.h"
#include "distributed_parameters/distributed_parameters.h"
#include "dtensor/dtensor.h"

namespace fsdp::dcp::internal {
namespace {

class TensorParallelParam : public ShardedParam {
 public:
  TensorParallelParam(const dtensor::DTensorSpec& spec, const at::Tensor& param)
      : ShardedParam(
            spec.shape, param.sizes().vec(),
            RunBoxes(dtensor::LocalSegments(spec.shape, spec.mesh->shape(), spec.mesh->coordinate(), spec.placements)),
            param.detach(), param),
        spec_(spec) {}

  at::Tensor Gather(const at::Tensor& local) const override {
    return dtensor::DTensor::FromSpec(local, spec_).full_tensor();
  }

  void Commit(const at::Tensor& value) const override {
    if (value.is_same(live())) return;  // read in place
    at::NoGradGuard no_grad;
    live().copy_(value);
  }

 private:
  dtensor::DTensorSpec spec_;
};

class TensorParallelAdapter : public ModelAdapter {
 public:
  TensorParallelAdapter(torch::nn::Module& model,
                        const absl::flat_hash_map<const c10::TensorImpl*, dtensor::DTensorSpec>& specs,
                        const char* caller) {
    std::map<const c10::TensorImpl*, const ShardedParam*> made;  // tied: one per tensor
    for (const auto& item : model.named_parameters(/*recurse=*/true)) {
      const at::Tensor& p = item.value();
      const auto spec = p.defined() ? specs.find(p.unsafeGetTensorImpl()) : specs.end();
      if (spec == specs.end()) continue;
      auto [it, added] = made.emplace(p.unsafeGetTensorImpl(), nullptr);
      if (added) {
        const dtensor::DTensorSpec& s = spec->second;
        params_.push_back(MakeTensorParallelParam(s, p, item.key(), caller));
        const comm::ProcessGroupPtr& w = s.mesh->world();
        TORCH_CHECK(world_ == nullptr || world_.get() == w.get(), caller,
                    ": the model's tensor-parallel parameters live on meshes of different worlds ('", item.key(), "')");
        world_ = w;
        it->second = params_.back().get();
      }
      by_name_.emplace(item.key(), it->second);
    }
  }

  comm::ProcessGroupPtr world() const override { return world_; }
  const ShardedParam* Sharded(const std::string& fqn) const override {
    const auto it = by_name_.find(fqn);
    return it == by_name_.end() ? nullptr : it->second;
  }

 private:
  comm::ProcessGroupPtr world_;
  std::vector<std::unique_ptr<ShardedParam>> params_;
  std::map<std::string, const ShardedParam*> by_name_;
};

}  // namespace

std::unique_ptr<ShardedParam> MakeTensorParallelParam(const dtensor::DTensorSpec& spec, const at::Tensor& param,
                                                      const std::string& fqn, const char* caller) {
  TORCH_CHECK(param.sizes() == c10::IntArrayRef(spec.local_shape()), caller, ": tensor-parallel parameter '", fqn,
              "' has shape ", param.sizes(), ", but its spec ", spec.ToString(), " gives this rank ",
              c10::IntArrayRef(spec.local_shape()));
  return std::make_unique<TensorParallelParam>(spec, param);
}

std::unique_ptr<ModelAdapter> MakeTensorParallelAdapter(torch::nn::Module& model, const char* caller) {
  const auto specs = distributed_parameters::DistributedParameterSpecs(model);
  if (specs.empty()) return nullptr;
  return std::make_unique<TensorParallelAdapter>(model, specs, caller);
}

}  // namespace fsdp::dcp::internal
