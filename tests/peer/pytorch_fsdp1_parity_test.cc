// Our FSDP1 (wrap_fsdp, FULL_SHARD, each block then the root) vs PyTorch's own FSDP1
// (FullyShardedDataParallel from the venv's torch, a separate Python process group over gloo;
// tests/peer/fsdp1_peer.py) on the same model, initial weights and data: after 10 AdamW steps
// every parameter and its AdamW state (exp_avg, exp_avg_sq, step) agree within f32 tolerance,
// at 2 and 4 ranks, with the optimizer on the flat parameters (use_orig_params false) and on
// the original parameters (use_orig_params true). Skipped, with the reason, when ./x setup
// could not provide a Python torch (FSDP_PEER_PYTHON unset or not importable).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "fsdp/fsdp1/state_dict.h"
#include "fsdp/fsdp1/test_models.h"
#include "optim_state/fsdp1_optim_state.h"
#include "testing/multi_rank.h"
#include "testing/peer_python.h"
#include "tests/peer/peer_parity.h"

namespace fsdp {
namespace {

using fsdp1::FlatParamHandle;
using fsdp1::FullyShardedDataParallel;
using fsdp1::testing::InitDeterministic;
using fsdp1::testing::Net;
using optim_state::OptimStateDict;
using optim_state::StateMap;

// use_orig_params: the optimizer holds the original parameters, each a flattened view of its
// part of this rank's flat shard. Their state is placed at the same offsets of a flat-shard
// state, which is then unflattened like a flat parameter's (gathered over the shard group;
// collective).
OptimStateDict FullOptimStateOfOrigParams(const FullyShardedDataParallel& root, const torch::optim::Optimizer& opt) {
  std::map<const torch::nn::Module*, std::string> prefix;
  for (const auto& item : root.module().named_modules("", /*include_self=*/true)) {
    prefix[item.value().get()] = item.key().empty() ? "" : item.key() + ".";
  }
  optim_state::NamedParams named;
  for (const auto& item : root.module().named_parameters()) named.emplace_back(item.key(), item.value());
  const OptimStateDict local = optim_state::GetOptimStateDict(opt, named);
  OptimStateDict full;
  full.optimizer = local.optimizer;
  for (FlatParamHandle* h : root.handles()) {
    const fsdp1::FlatParameter& fp = h->flat_param();
    const std::string& module_prefix = prefix.at(&h->fully_sharded_module());
    StateMap flat;
    for (const auto& info : fp.shard_param_infos) {
      const auto it = local.state.find(module_prefix + fp.fqns[info.index]);
      if (!info.in_shard || it == local.state.end()) continue;
      for (const auto& [name, value] : it->second) {
        if (optim_state::Classify(value) != optim_state::StateKind::kPositiveDimTensor) {
          flat[name] = value;
          continue;
        }
        const at::Tensor& part = std::get<at::Tensor>(value);
        if (!flat.count(name)) flat[name] = at::zeros({fp.sharded_size.at(0)}, part.options());
        std::get<at::Tensor>(flat[name]).narrow(0, info.offset_in_shard, info.numel_in_shard).copy_(part.flatten());
      }
    }
    for (auto& [fqn, state] : optim_state::UnflattenOptimState(*h, flat, h->process_group(), module_prefix)) {
      full.state[fqn] = std::move(state);
    }
  }
  return full;
}

class PyTorchFsdp1Parity : public ::testing::TestWithParam<bool> {};

TEST_P(PyTorchFsdp1Parity, ParametersAndAdamWStateMatchAfterTenSteps) {
  const bool use_orig_params = GetParam();
  std::string why_not;
  const std::string python = testing::PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << why_not;
  for (int world : {2, 4}) {
    Net init;
    InitDeterministic(*init);
    const peer::TensorDict theirs =
        peer::RunPeer(python, "fsdp1_peer.py", world, *init, use_orig_params ? "--use-orig-params" : "");
    ASSERT_FALSE(theirs.is_empty());
    fsdp::testing::RunOnRanks(fsdp::testing::Backend::kGlooThreads, world, [&](const comm::ProcessGroupPtr& pg) {
      Net model;
      InitDeterministic(*model);
      const fsdp1::FSDPOptions options{.process_group = pg,
                                       .sharding_strategy = fsdp1::ShardingStrategy::FULL_SHARD,
                                       .use_orig_params = use_orig_params};
      for (auto& b : model->layers) fsdp1::wrap_fsdp(b.ptr(), options);
      const FullyShardedDataParallel root = fsdp1::wrap_fsdp(model.ptr(), options);
      torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(peer::kLr));
      test_models::TrainSteps(model, opt, 0, peer::kSteps, world, pg->rank());
      const fsdp1::FullStateDict params = fsdp1::GetFullStateDict(root);
      const OptimStateDict optim =
          use_orig_params ? FullOptimStateOfOrigParams(root, opt) : optim_state::GetFullOptimStateDict(root, opt);
      if (pg->rank() == 0) {
        peer::ExpectMatchesPeer(params, optim, theirs, 13,
                                absl::StrCat("FSDP1 W=", world, " use_orig_params=", use_orig_params));
      }
    });
  }
}

INSTANTIATE_TEST_SUITE_P(UseOrigParams, PyTorchFsdp1Parity, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "OrigParams" : "FlatParams"; });

}  // namespace
}  // namespace fsdp
