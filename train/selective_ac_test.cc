// torchtitan's SelectiveAC policy: its operator list is torchtitan's own
// (testdata/golden_sac_save_ops.txt, testing/golden/gen_train.py), every second matmul is
// recomputed, forced shapes are recomputed and not counted, the count restarts per forward; on a
// Llama decoder layer it keeps half the matmuls and trains bitwise like full recomputation.
#include "train/selective_ac.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "models/llama/model.h"
#include "testing/expect_error.h"

namespace fsdp::train {
namespace {

using activation_checkpointing::CheckpointPolicy;
using activation_checkpointing::OpCall;

TEST(TorchtitanSaveOps, AreTorchtitansDefaultSaveOps) {
  std::ifstream in("train/testdata/golden_sac_save_ops.txt");
  ASSERT_TRUE(in) << "train/testdata/golden_sac_save_ops.txt";
  std::vector<std::string> golden;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line[0] != '#') golden.push_back(line);
  }
  std::vector<std::string> ours = TorchtitanSaveOps();
  std::sort(ours.begin(), ours.end());
  EXPECT_EQ(ours, golden);
}

CheckpointPolicy Ask(const activation_checkpointing::SelectivePolicy& policy, const char* op, const char* overload,
                     std::vector<c10::IValue> args) {
  const c10::OperatorHandle handle = c10::Dispatcher::singleton().findSchemaOrThrow(op, overload);
  return policy(OpCall{handle, args, {}});
}

TEST(TorchtitanSelectivePolicy, KeepsEverySecondMatmulAndTheOtherSaveOps) {
  auto block = std::make_shared<torch::nn::Module>();
  block->register_module("proj", torch::nn::Linear(4, 6));
  block->register_module("gate", torch::nn::Linear(8, 3));
  const auto factory = TorchtitanSelectivePolicy(*block, "layers.0", {"gate"});
  const auto policy = factory();
  const at::Tensor x = at::zeros({2, 4});
  const at::Tensor rhs = at::zeros({4, 6});
  const at::Tensor gate_rhs = at::zeros({8, 3});  // the forced (in, out) shape
  EXPECT_EQ(Ask(policy, "aten::mm", "", {x, rhs}), CheckpointPolicy::kMustSave);
  EXPECT_EQ(Ask(policy, "aten::mm", "", {x, gate_rhs}), CheckpointPolicy::kPreferRecompute);  // not counted
  EXPECT_EQ(Ask(policy, "aten::mm", "", {x, rhs}), CheckpointPolicy::kPreferRecompute);
  EXPECT_EQ(Ask(policy, "aten::linear", "", {x, at::zeros({6, 4}), c10::IValue()}), CheckpointPolicy::kMustSave);
  EXPECT_EQ(Ask(policy, "aten::linear", "", {x, at::zeros({3, 8}), c10::IValue()}),
            CheckpointPolicy::kPreferRecompute);  // linear's weight is (out, in): forced
  EXPECT_EQ(Ask(policy, "aten::mm", "", {x, rhs}), CheckpointPolicy::kPreferRecompute);
  EXPECT_EQ(Ask(policy, "aten::addmm", "", {x, x, rhs, 1, 1}), CheckpointPolicy::kMustSave);
  EXPECT_EQ(Ask(policy, "aten::max", "", {x}), CheckpointPolicy::kMustSave);
  EXPECT_EQ(Ask(policy, "aten::relu", "", {x}), CheckpointPolicy::kPreferRecompute);
  // A new forward counts from zero again.
  const auto next = factory();
  EXPECT_EQ(Ask(next, "aten::mm", "", {x, rhs}), CheckpointPolicy::kMustSave);

  EXPECT_ERROR_CONTAINS(TorchtitanSelectivePolicy(*block, "layers.0", {"layers"}),
                        "force_recompute_mm_shapes_by_fqns matches layers.0, which is no Linear");
}

// A Llama decoder layer: q, k, v, o, gate, up, down are seven matmuls; the policy keeps the
// 1st, 3rd, 5th and 7th, and the gradients are those of full recomputation, bitwise.
TEST(TorchtitanSelectivePolicy, OnALlamaLayerKeepsHalfTheMatmulsAndChangesNoGradient) {
  models::llama::LlamaConfig config;  // the default small model (GQA: 4 heads, 2 kv heads)
  config.num_hidden_layers = 1;
  config.attention = models::llama::AttentionKernel::kSdpa;
  torch::manual_seed(3);
  models::llama::LlamaForCausalLM model(config);
  auto& layer = model->model->decoder_layers.at(0);
  const at::Tensor ids = at::randint(0, 64, {2, 8});
  const at::Tensor positions = at::arange(8).expand({2, 8});
  auto grads = [&] {
    model->zero_grad();
    model->forward(ids, positions).pow(2).mean().backward();
    std::vector<at::Tensor> out;
    for (const at::Tensor& p : model->parameters()) out.push_back(p.grad().clone());
    return out;
  };
  layer->set_checkpointing_enabled(true);
  const std::vector<at::Tensor> full = grads();
  activation_checkpointing::CheckpointOptions options;
  int kept_mm = 0, asked_mm = 0;
  const auto torchtitan = TorchtitanSelectivePolicy(*layer, "model.layers.0", {"moe.router.gate"});
  options.selective_policy = [&] {
    return [&, policy = torchtitan()](const OpCall& call) {
      const CheckpointPolicy p = policy(call);
      if (call.op.operator_name().name == "aten::mm") {
        ++asked_mm;
        kept_mm += p == CheckpointPolicy::kMustSave ? 1 : 0;
      }
      return p;
    };
  };
  layer->set_checkpoint_options(options);
  const std::vector<at::Tensor> selective = grads();
  EXPECT_EQ(asked_mm, 7);
  EXPECT_EQ(kept_mm, 4);
  ASSERT_EQ(selective.size(), full.size());
  for (size_t i = 0; i < full.size(); ++i) EXPECT_TRUE(at::equal(selective[i], full[i])) << "parameter " << i;
}

}  // namespace
}  // namespace fsdp::train
