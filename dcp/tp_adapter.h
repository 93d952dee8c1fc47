// The checkpoint adapter of tensor-parallel models without FSDP (dcp/tp_adapter.cc), internal
// to //dcp: AdapterFor (adapter.h) uses it for a model whose tree holds
// distributed_parameters::DistributedParameterModule modules and no FSDP state. Each such module's
// parameters are saved and loaded as the boxes of the global tensor their DTensor spec gives
// this rank (so a TP checkpoint reshards: TP 2 -> 4, TP <-> FSDP + TP, one rank); the rest of
// the model is whole. world(): the meshes' world group (all must share it). Errors
// (c10::Error starting with `caller`): a parameter whose shape is not its spec's local shape,
// meshes of different worlds.
#ifndef FSDP_DCP_TP_ADAPTER_H_
#define FSDP_DCP_TP_ADAPTER_H_

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>

#include "dcp/adapter.h"
#include "dtensor/dtensor_spec.h"

namespace fsdp::dcp::internal {

// Null when the model has no such parameters.
std::unique_ptr<ModelAdapter> MakeTensorParallelAdapter(torch::nn::Module& model, const char* caller);

// One tensor-parallel parameter (`fqn`, laid out by `spec`) as the boxes it holds of the
// global tensor: for FSDP adapters, whose models may hold tensor-parallel modules outside
// every fully_shard. Throws (starting with `caller`) when its shape is not the spec's
// local shape.
std::unique_ptr<ShardedParam> MakeTensorParallelParam(const dtensor::DTensorSpec& spec, const at::Tensor& param,
                                                      const std::string& fqn, const char* caller);

}  // namespace fsdp::dcp::internal

#endif  // FSDP_DCP_TP_ADAPTER_H_
