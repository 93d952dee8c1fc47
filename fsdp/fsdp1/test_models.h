// Models and helpers shared by the FSDP1 runtime tests: residual MLP blocks inside a net
// with uneven shapes, deterministic init and batches, and the full (gathered) parameters of
// a wrapped model by name.
#ifndef FSDP_FSDP_FSDP1_TEST_MODELS_H_
#define FSDP_FSDP_FSDP1_TEST_MODELS_H_

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/linear.h>

#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/common/parity_harness.h"
#include "fsdp/common/test_models.h"
#include "fsdp/fsdp1/fsdp_state.h"  // the runtime: tests look at handles and flat parameters
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"

namespace fsdp::fsdp1::testing {

using test_models::Batch;
using test_models::Block;
using test_models::BlockImpl;
using test_models::InitDeterministic;
using test_models::Net;
using test_models::NetImpl;

// Every original parameter of the wrapped tree, all-gathered from the flat parameters' local
// shards (collective over each handle's process group), by name relative to `root`.
inline std::map<std::string, at::Tensor> FullParams(FullyShardedDataParallel& root) {
  std::map<const torch::nn::Module*, std::string> prefix;
  for (const auto& item : root.module().named_modules("", /*include_self=*/true)) {
    prefix[item.value().get()] = item.key().empty() ? "" : item.key() + ".";
  }
  std::map<std::string, at::Tensor> out;
  for (FlatParamHandle* h : root.handles()) {
    const FlatParameter& fp = h->flat_param();
    at::Tensor full = fp.local_shard;
    if (h->uses_sharded_strategy()) {
      full = at::empty({fp.local_shard.numel() * h->world_size()}, fp.local_shard.options());
      h->process_group()->all_gather_into_tensor(full, fp.local_shard)->wait();
    }
    std::vector<at::Tensor> views = h->GetUnflatViews(full.narrow(0, 0, fp.unpadded_unsharded_size[0]));
    for (int64_t i = 0; i < fp.num_params; ++i) {
      out[prefix[&h->fully_sharded_module()] + fp.fqns[i]] = views[i].clone();
    }
  }
  return out;
}

// max |full - reference| <= tol * max(1, reference scale) for every parameter of `ref`
// (parity::ExpectParamsMatch on FullParams(root)).
inline void ExpectParamsMatch(FullyShardedDataParallel& root, torch::nn::Module& ref, double tol,
                              const std::string& label) {
  parity::ExpectParamsMatch(FullParams(root), ref, tol, label);
}

}  // namespace fsdp::fsdp1::testing

#endif  // FSDP_FSDP_FSDP1_TEST_MODELS_H_
