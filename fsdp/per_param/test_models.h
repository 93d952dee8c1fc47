// FSDP2's names for the shared test models (fsdp/common/test_models.h): blocks are
// FullySharded<BlockImpl>; and the SPMD tensor-parallel Linear the FSDP + TP tests share.
#ifndef FSDP_FSDP_PER_PARAM_TEST_MODELS_H_
#define FSDP_FSDP_PER_PARAM_TEST_MODELS_H_

#include <torch/nn/modules/linear.h>

#include <string>
#include <utility>
#include <vector>

#include "dtensor/tensor_parallel.h"
#include "fsdp/common/test_models.h"
#include "fsdp/per_param/fully_shard.h"
#include "mesh/device_mesh.h"

namespace fsdp::per_param::testing {

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

}  // namespace fsdp::per_param::testing

#endif  // FSDP_FSDP_PER_PARAM_TEST_MODELS_H_
