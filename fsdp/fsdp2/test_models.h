// FSDP2's names for the shared test models (fsdp/common/test_models.h): blocks are
// Hooked<BlockImpl>; and the tensor-parallel Linears and blocks (through the parallel styles,
// on a tp mesh or an SPMD (dp, tp) mesh) the FSDP + TP tests share.
#ifndef FSDP_FSDP_FSDP2_TEST_MODELS_H_
#define FSDP_FSDP_FSDP2_TEST_MODELS_H_

#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/linear.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "distributed_parameters/distributed_parameters.h"
#include "dtensor/dtensor_spec.h"
#include "dtensor/placement.h"
#include "fsdp/common/test_models.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "mesh/device_mesh.h"
#include "tensor_parallel/parallel_style.h"
#include "tensor_parallel/parallelize_module.h"

namespace fsdp::fsdp2::testing {

using test_models::Batch;
using test_models::Block;
using test_models::BlockImpl;
using test_models::InitDeterministic;
using test_models::Net;
using test_models::NetImpl;
using test_models::NetOptions;
using test_models::TiedLinear;
using test_models::TiedLinearImpl;
using test_models::TrainSteps;
using test_models::UniqueParameters;

// The SPMD-mesh path of fully_shard's dp_mesh_dims (fsdp/fsdp2/fsdp_api.h) wants the
// parameters' specs on the whole mesh (its "tp" dim and data-parallel dims), with
// `dp_placement` on every dim but "tp". A style shards over (*spmd)["tp"] and reports specs on
// that 1-D mesh; this hook, added outermost, restates them on the whole mesh
// (distributed_parameters/distributed_parameters.h: the outermost DistributedParameterModule
// hook is the one found).
class SpmdLayoutHook final : public ForwardHook, public distributed_parameters::DistributedParameterModule {
 public:
  SpmdLayoutHook(std::shared_ptr<distributed_parameters::DistributedParameterModule> style, mesh::DeviceMeshPtr spmd,
                 dtensor::Placement dp_placement)
      : style_(std::move(style)), spmd_(std::move(spmd)), dp_(dp_placement) {}
  std::vector<std::pair<std::string, dtensor::DTensorSpec>> named_parameter_specs() const override {
    auto specs = style_->named_parameter_specs();
    for (auto& [name, spec] : specs) {
      dtensor::Placements placements(spmd_->ndim(), dp_);
      placements[spmd_->dim_index("tp")] = spec.placements[0];
      spec = dtensor::DTensorSpec::Make(spmd_, placements, spec.shape, spec.dtype);
    }
    return specs;
  }

 private:
  std::shared_ptr<distributed_parameters::DistributedParameterModule> style_;
  mesh::DeviceMeshPtr spmd_;
  dtensor::Placement dp_;
};

using HookedLinear = Hooked<torch::nn::LinearImpl>;

// A Linear with `plain`'s values, parallelized in place by `style` (ColwiseParallel() or
// RowwiseParallel()) over `tp`; `spmd` set: its layouts restated on that whole mesh.
inline HookedLinear ParallelLinear(const torch::nn::Linear& plain, const mesh::DeviceMeshPtr& tp,
                                   const tensor_parallel::ParallelStylePtr& style,
                                   const mesh::DeviceMeshPtr& spmd = nullptr,
                                   dtensor::Placement dp_placement = dtensor::Placement::Replicate()) {
  HookedLinear linear(plain->options);
  {
    at::NoGradGuard no_grad;
    linear->weight.copy_(plain->weight);
    if (plain->bias.defined()) linear->bias.copy_(plain->bias);
  }
  tensor_parallel::parallelize_module(*linear, tp, style);
  if (spmd) {
    linear->AddForwardHook(
        std::make_shared<SpmdLayoutHook>(linear->FindForwardHook<distributed_parameters::DistributedParameterModule>(),
                                         spmd, dp_placement),
        HookPosition::kOutermost);
  }
  return linear;
}

// FSDP over "dp" of a (dp=2, tp=2) mesh around tensor-parallel blocks (colwise fc1, rowwise
// fc2): FSDP shards each TP shard again, and the sharded parameter's spec is
// (StridedShard(0, sf=2), Shard(0)) on the (dp, tp) mesh. `spmd` set: the blocks' specs are
// on that whole mesh (the dp_mesh_dims path) instead of the tp mesh (the concatenation path).
struct TPBlockImpl : torch::nn::Module {
  TPBlockImpl(const BlockImpl& plain, const mesh::DeviceMeshPtr& tp, const mesh::DeviceMeshPtr& spmd,
              dtensor::Placement dp_placement)
      : fc1(register_module("fc1",
                            ParallelLinear(plain.fc1, tp, tensor_parallel::ColwiseParallel(), spmd, dp_placement))),
        fc2(register_module("fc2",
                            ParallelLinear(plain.fc2, tp, tensor_parallel::RowwiseParallel(), spmd, dp_placement))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2(torch::nn::functional::relu(fc1(x))); }
  HookedLinear fc1, fc2;
};
using TPBlock = Hooked<TPBlockImpl>;

inline torch::nn::Linear CloneLinear(const torch::nn::Linear& l) {
  return torch::nn::Linear(std::dynamic_pointer_cast<torch::nn::LinearImpl>(l->clone()));
}

// NetImpl's forward with TP blocks (the same parameter names); starts from `plain`'s values.
struct TPNetImpl : torch::nn::Module {
  TPNetImpl(const NetImpl& plain, const mesh::DeviceMeshPtr& tp, const mesh::DeviceMeshPtr& spmd = nullptr,
            dtensor::Placement dp_placement = dtensor::Placement::Replicate())
      : in(register_module("in", CloneLinear(plain.in))), head(register_module("head", CloneLinear(plain.head))) {
    for (size_t i = 0; i < plain.layers.size(); ++i) {
      layers.push_back(register_module(absl::StrCat("block", i), TPBlock(*plain.layers[i], tp, spmd, dp_placement)));
    }
    extra = register_parameter("extra", plain.extra.detach().clone());
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = in(x);
    for (auto& b : layers) h = b(h);
    return head(h) + extra.sum();
  }
  torch::nn::Linear in, head;
  std::vector<TPBlock> layers;
  at::Tensor extra;
};
using TPNet = Hooked<TPNetImpl>;

}  // namespace fsdp::fsdp2::testing

#endif  // FSDP_FSDP_FSDP2_TEST_MODELS_H_
