// The checkpoint adapter of tensor-parallel models without FSDP (adapter.h): parameters of
// dtensor::DistributedParameterModule modules (e.g. TensorParallelLinear) are DTensor shards
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

#include "absl/strings/str_cat.h"
#include "dcp/adapter.h"
#include "dcp/plan.h"
#include "dcp/tp_adapter.h"
#include "dtensor/dtensor.h"
#include "dtensor/tensor_parallel.h"

namespace fsdp::dcp::internal {
namespace {

class TensorParallelParam : public ShardedParam {
 public:
  TensorParallelParam(const dtensor::DTensorSpec& spec, const at::Tensor& param)
      : ShardedParam(spec.shape, param.sizes().vec(),
                     RunBoxes(dtensor::LocalSegments(spec.shape, spec.mesh->shape(), spec.mesh->coordinate(),
                                                     spec.placements)),
                     param.detach(), param),
        spec_(spec) {}

  at::Tensor Gather(const at::Tensor& local) const override {
    return dtensor::RedistributeLocal(local, spec_, dtensor::Placements(spec_.placements.size(),
                                                                        dtensor::Placement::Replicate()));
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
  TensorParallelAdapter(torch::nn::Module& model, const char* caller) {
    std::map<const c10::TensorImpl*, std::pair<std::string, const TensorParallelParam*>> by_impl;
    for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
      const auto* tp = dynamic_cast<const dtensor::DistributedParameterModule*>(item.value().get());
      if (tp == nullptr) continue;
      const auto own = item.value()->named_parameters(/*recurse=*/false);
      for (const auto& [name, spec] : tp->named_parameter_specs()) {
        const at::Tensor* p = own.find(name);
        if (p == nullptr || !p->defined()) continue;
        const std::string fqn = item.key().empty() ? name : absl::StrCat(item.key(), ".", name);
        TORCH_CHECK(p->sizes() == c10::IntArrayRef(spec.local_shape()), caller, ": tensor-parallel parameter '", fqn,
                    "' has shape ", p->sizes(), ", but its spec ", spec.ToString(), " gives this rank ",
                    c10::IntArrayRef(spec.local_shape()));
        const comm::ProcessGroupPtr w = spec.mesh->world();
        TORCH_CHECK(world_ == nullptr || world_.get() == w.get(), caller,
                    ": the model's tensor-parallel parameters live on meshes of different worlds ('", fqn, "')");
        world_ = w;
        params_.push_back(std::make_unique<TensorParallelParam>(spec, *p));
        by_impl.emplace(p->unsafeGetTensorImpl(), std::make_pair(fqn, params_.back().get()));
      }
    }
    // Every name of each parameter (tied ones too).
    for (const auto& item : model.named_parameters(/*recurse=*/true)) {
      const auto it = by_impl.find(item.value().unsafeGetTensorImpl());
      if (it != by_impl.end()) by_name_.emplace(item.key(), it->second.second);
    }
  }

  comm::ProcessGroupPtr world() const override { return world_; }
  const ShardedParam* Sharded(const std::string& fqn) const override {
    const auto it = by_name_.find(fqn);
    return it == by_name_.end() ? nullptr : it->second;
  }

 private:
  comm::ProcessGroupPtr world_;
  std::vector<std::unique_ptr<TensorParallelParam>> params_;
  std::map<std::string, const ShardedParam*> by_name_;
};

}  // namespace

bool HasTensorParallelModules(torch::nn::Module& model) {
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (dynamic_cast<const dtensor::DistributedParameterModule*>(m.get()) != nullptr) return true;
  }
  return false;
}

std::unique_ptr<ModelAdapter> MakeTensorParallelAdapter(torch::nn::Module& model, const char* caller) {
  return std::make_unique<TensorParallelAdapter>(model, caller);
}

}  // namespace fsdp::dcp::internal
