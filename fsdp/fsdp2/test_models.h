// FSDP2's names for the shared test models (fsdp/common/test_models.h): blocks are
// Hooked<BlockImpl>; and the SPMD tensor-parallel Linear the FSDP + TP tests share.
#ifndef FSDP_FSDP_FSDP2_TEST_MODELS_H_
#define FSDP_FSDP_FSDP2_TEST_MODELS_H_

#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/linear.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/common/test_models.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "mesh/device_mesh.h"
#include "tensor_parallel/tensor_parallel.h"

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

// A tensor-parallel Linear on the "tp" dim of a (dp, tp) mesh whose parameter specs live on
// the whole mesh, with `dp_placement` on dp: the parameters fully_shard's dp_mesh_dims
// expects (the SPMD-mesh path).
struct SpmdLinearImpl : dtensor::TensorParallelLinearImpl {
  SpmdLinearImpl(const torch::nn::Linear& linear, mesh::DeviceMeshPtr spmd, dtensor::TensorParallelStyle style,
                 dtensor::Placement dp_placement = dtensor::Placement::Replicate())
      : TensorParallelLinearImpl(linear, (*spmd)["tp"], style), spmd_(std::move(spmd)), dp_(dp_placement) {}
  std::vector<std::pair<std::string, dtensor::DTensorSpec>> named_parameter_specs() const override {
    auto specs = TensorParallelLinearImpl::named_parameter_specs();
    for (auto& [name, spec] : specs) {
      spec = dtensor::DTensorSpec::Make(spmd_, {dp_, spec.placements[0]}, spec.shape, spec.dtype);
    }
    return specs;
  }
  mesh::DeviceMeshPtr spmd_;
  dtensor::Placement dp_;
};

// FSDP over "dp" of a (dp=2, tp=2) mesh around tensor-parallel blocks (colwise fc1, rowwise
// fc2): FSDP shards each TP shard again, and the sharded parameter's spec is
// (StridedShard(0, sf=2), Shard(0)) on the (dp, tp) mesh. `spmd` set: the blocks' specs are
// on that whole mesh (the dp_mesh_dims path) instead of the tp mesh (the concatenation path).
struct TPBlockImpl : torch::nn::Module {
  TPBlockImpl(const BlockImpl& plain, const mesh::DeviceMeshPtr& tp, const mesh::DeviceMeshPtr& spmd,
              dtensor::Placement dp_placement)
      : fc1(register_module("fc1",
                            Parallel(plain.fc1, tp, spmd, dtensor::TensorParallelStyle::kColwise, dp_placement))),
        fc2(register_module("fc2",
                            Parallel(plain.fc2, tp, spmd, dtensor::TensorParallelStyle::kRowwise, dp_placement))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2(torch::nn::functional::relu(fc1(x))); }
  static dtensor::TensorParallelLinear Parallel(const torch::nn::Linear& l, const mesh::DeviceMeshPtr& tp,
                                                const mesh::DeviceMeshPtr& spmd, dtensor::TensorParallelStyle style,
                                                dtensor::Placement dp_placement) {
    if (!spmd) return dtensor::ParallelizeLinear(l, tp, style);
    std::shared_ptr<dtensor::TensorParallelLinearImpl> impl =
        std::make_shared<SpmdLinearImpl>(l, spmd, style, dp_placement);
    return dtensor::TensorParallelLinear(impl);
  }
  dtensor::TensorParallelLinear fc1, fc2;
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
