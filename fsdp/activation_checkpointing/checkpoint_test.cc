// Activation checkpointing on one process: gradients equal those without checkpointing
// (bitwise on the CPU), dropout replays its mask, nested checkpoints, inputs without grad,
// several outputs, the Checkpointed<Impl> module, activation memory, and the error paths.
#include "fsdp/activation_checkpointing/checkpoint.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include <iostream>
#include <map>
#include <string>

#include "fsdp/activation_checkpointing/checkpoint_wrapper.h"
#include "fsdp/common/test_models.h"
#include "testing/allocation_counter.h"
#include "testing/expect_error.h"

namespace fsdp::activation_checkpointing {
namespace {

namespace F = torch::nn::functional;
using test_models::BlockImpl;
using test_models::InitDeterministic;

// A residual MLP block with dropout: x + fc2(dropout(relu(fc1(x)))).
struct DropBlockImpl : torch::nn::Module {
  DropBlockImpl(int64_t d, int64_t hidden, double p = 0.0)
      : fc1(register_module("fc1", torch::nn::Linear(d, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, d))),
        p(p) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = F::relu(fc1(x));
    if (p > 0) h = F::dropout(h, F::DropoutFuncOptions().p(p).training(true));
    return x + fc2(h);
  }
  torch::nn::Linear fc1, fc2;
  double p;
};

using PlainBlock = Hooked<DropBlockImpl>;
using CkptBlock = Checkpointed<DropBlockImpl>;

// name -> gradient (undefined gradients as undefined tensors).
std::map<std::string, at::Tensor> Grads(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.named_parameters())
    out[p.key()] = p.value().grad().defined() ? p.value().grad().clone() : at::Tensor();
  return out;
}

void ExpectSameGrads(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, g] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    ASSERT_EQ(g.defined(), b.at(name).defined()) << name;
    if (g.defined()) {
      EXPECT_TRUE(at::equal(g, b.at(name))) << name << " max diff " << (g - b.at(name)).abs().max();
    }
  }
}

at::Tensor Input(int64_t rows, int64_t cols, bool requires_grad = true, uint64_t seed = 5) {
  return at::randn({rows, cols}, at::make_generator<at::CPUGeneratorImpl>(seed)).set_requires_grad(requires_grad);
}

TEST(Checkpoint, MlpGradientsEqualWithoutCheckpointingBitwise) {
  torch::nn::Linear fc1(6, 12), fc2(12, 6);
  InitDeterministic(*fc1, 1);
  InitDeterministic(*fc2, 2);
  auto fn = [&](const std::vector<at::Tensor>& in) { return in[0] + fc2(F::gelu(fc1(in[0]))).tanh(); };
  at::Tensor x = Input(4, 6);
  (fn({x}) * 3).pow(2).sum().backward();
  const at::Tensor x_grad = x.grad().clone();
  const auto g1 = Grads(*fc1), g2 = Grads(*fc2);
  for (auto* m : {&fc1, &fc2}) (*m)->zero_grad();
  x.mutable_grad() = at::Tensor();

  at::Tensor y = checkpoint(fn, {x});
  EXPECT_TRUE(y.requires_grad());
  (y * 3).pow(2).sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), x_grad));
  ExpectSameGrads(Grads(*fc1), g1);
  ExpectSameGrads(Grads(*fc2), g2);
}

TEST(Checkpoint, DropoutReplaysItsMaskAndLeavesTheRngStreamAsWithoutCheckpointing) {
  CkptBlock ckpt(8, 32, 0.5);
  PlainBlock plain(8, 32, 0.5);
  InitDeterministic(*ckpt);
  InitDeterministic(*plain);
  const at::Tensor x = Input(5, 8, /*requires_grad=*/false);
  torch::manual_seed(123);
  plain(x).pow(2).sum().backward();
  const at::Tensor next_plain = at::rand({4});
  torch::manual_seed(123);
  ckpt(x).pow(2).sum().backward();
  // The recomputation drew from a forked copy of the forward's state: the caller's stream
  // continues where the plain run's does.
  EXPECT_TRUE(at::equal(at::rand({4}), next_plain));
  ExpectSameGrads(Grads(*ckpt), Grads(*plain));

  // Without the replay the recomputation draws another mask: the gradients differ.
  ckpt->zero_grad();
  CheckpointOptions no_rng;
  no_rng.preserve_rng_state = false;
  ckpt->set_checkpoint_options(no_rng);
  torch::manual_seed(123);
  ckpt(x).pow(2).sum().backward();
  EXPECT_FALSE(at::equal(ckpt->fc1->weight.grad(), plain->fc1->weight.grad()));
}

TEST(Checkpoint, NestedCheckpointsMatch) {
  PlainBlock a(5, 9), b(5, 9);
  InitDeterministic(*a, 3);
  InitDeterministic(*b, 30);
  const at::Tensor x = Input(3, 5);
  auto plain_fn = [&](const at::Tensor& t) { return b(a(t)).sin(); };
  plain_fn(x).sum().backward();
  const at::Tensor x_grad = x.grad().clone();
  const auto ga = Grads(*a), gb = Grads(*b);
  a->zero_grad();
  b->zero_grad();
  x.mutable_grad() = at::Tensor();

  int inner_calls = 0;
  auto outer = [&](const std::vector<at::Tensor>& in) {
    at::Tensor h = checkpoint(
        [&](const std::vector<at::Tensor>& i) {
          ++inner_calls;
          return a(i[0]);
        },
        {in[0]});
    h = checkpoint(
        [&](const std::vector<at::Tensor>& i) {
          ++inner_calls;
          return b(i[0]);
        },
        {h});
    return h.sin();
  };
  checkpoint(outer, {x}).sum().backward();
  // Forward: each inner once (under the outer's no-grad: no node); the outer's recompute:
  // each inner once more with a node; their backward: once more each.
  EXPECT_EQ(inner_calls, 6);
  EXPECT_TRUE(at::equal(x.grad(), x_grad));
  ExpectSameGrads(Grads(*a), ga);
  ExpectSameGrads(Grads(*b), gb);
}

TEST(Checkpoint, InputsWithoutGradStillGiveParameterGradients) {
  PlainBlock m(4, 6);
  InitDeterministic(*m);
  const at::Tensor x = Input(3, 4, /*requires_grad=*/false);
  m(x).pow(2).sum().backward();
  const auto expected = Grads(*m);
  m->zero_grad();
  at::Tensor y = checkpoint([&](const std::vector<at::Tensor>& in) { return m(in[0]); }, {x});
  ASSERT_TRUE(y.requires_grad());  // non-reentrant semantics (the reentrant one says no)
  y.pow(2).sum().backward();
  ExpectSameGrads(Grads(*m), expected);
  EXPECT_FALSE(x.grad().defined());

  // Told that nothing fn reads requires grad: the outputs do not either.
  CheckpointOptions opts;
  opts.params = std::vector<at::Tensor>{};
  EXPECT_FALSE(checkpoint([](const std::vector<at::Tensor>& in) { return in[0] * 2; }, {x}, opts).requires_grad());
  // Under no-grad fn just runs.
  at::NoGradGuard no_grad;
  EXPECT_FALSE(checkpoint([&](const auto& in) { return m(in[0]); }, {x}).requires_grad());  // README's form
}

TEST(Checkpoint, SeveralOutputsOneUnusedAndAnIntegerInput) {
  torch::nn::Linear fc(4, 4);
  InitDeterministic(*fc);
  const at::Tensor x = Input(3, 4), idx = at::arange(3);
  auto fn = [&](const std::vector<at::Tensor>& in) {
    at::Tensor h = fc(in[0]).index_select(0, in[1]);
    return std::vector<at::Tensor>{h.relu(), h.exp(), in[1] * 2};
  };
  auto plain = fn({x, idx});
  (plain[0].sum() + plain[2].sum()).backward();
  const at::Tensor x_grad = x.grad().clone();
  const auto g = Grads(*fc);
  fc->zero_grad();
  x.mutable_grad() = at::Tensor();
  auto outs = checkpoint_multi(fn, {x, idx});
  ASSERT_EQ(outs.size(), 3u);
  EXPECT_FALSE(outs[2].requires_grad());
  EXPECT_TRUE(at::equal(outs[2], idx * 2));
  (outs[0].sum() + outs[2].sum()).backward();
  EXPECT_TRUE(at::equal(x.grad(), x_grad));
  ExpectSameGrads(Grads(*fc), g);
}

TEST(CheckpointedModule, SameNamesAndGradientsAsThePlainModuleAndTheSwitch) {
  Checkpointed<BlockImpl> ckpt(5, 7);
  Hooked<BlockImpl> plain(5, 7);
  InitDeterministic(*ckpt);
  InitDeterministic(*plain);
  EXPECT_EQ(ckpt->named_parameters().keys(), plain->named_parameters().keys());  // no wrapper level
  const at::Tensor x = Input(4, 5);
  plain(x).pow(2).sum().backward();
  const at::Tensor x_grad = x.grad().clone();
  x.mutable_grad() = at::Tensor();
  ckpt(x).pow(2).sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), x_grad));
  ExpectSameGrads(Grads(*ckpt), Grads(*plain));

  // In a tree: the switch reaches Checkpointed modules only, filtered by the predicate.
  struct TreeImpl : torch::nn::Module {
    TreeImpl() {
      a = register_module("a", Checkpointed<BlockImpl>(5, 7));
      b = register_module("b", Checkpointed<BlockImpl>(5, 7));
      c = register_module("c", Hooked<BlockImpl>(5, 7));
    }
    Checkpointed<BlockImpl> a{nullptr}, b{nullptr};
    Hooked<BlockImpl> c{nullptr};
  };
  auto tree = std::make_shared<TreeImpl>();
  EXPECT_EQ(apply_activation_checkpointing(*tree, nullptr, false), 2);
  EXPECT_FALSE(tree->a->checkpointing_enabled());
  EXPECT_EQ(
      apply_activation_checkpointing(*tree, [](const std::string& name, torch::nn::Module&) { return name == "b"; }),
      1);
  EXPECT_FALSE(tree->a->checkpointing_enabled());
  EXPECT_TRUE(tree->b->checkpointing_enabled());
  // Disabled: plain forward (the output's grad_fn is the block's own add, not the checkpoint).
  EXPECT_EQ(tree->a(x).grad_fn()->name(), "AddBackward0");
  EXPECT_NE(tree->b(x).grad_fn()->name().find("CheckpointFunction"), std::string::npos);
}

// A wide block: its activations (relu output, 8x the input) dominate.
constexpr int64_t kRows = 64, kDim = 128, kHidden = 1024, kBlocks = 8;

int64_t LiveBytesAfterForward(bool checkpointing) {
  std::vector<CkptBlock> blocks;
  for (int64_t i = 0; i < kBlocks; ++i) {
    blocks.emplace_back(kDim, kHidden);
    blocks.back()->set_checkpointing_enabled(checkpointing);
  }
  const at::Tensor x = Input(kRows, kDim);
  int64_t live = 0;
  at::Tensor out;
  {
    testing::ScopedAllocationCounter counter;
    at::Tensor h = x;
    for (auto& b : blocks) h = b(h);
    out = h;
    live = counter.current();
    out.sum().backward();
  }
  EXPECT_TRUE(blocks[0]->fc1->weight.grad().defined());
  return live;
}

TEST(CheckpointMemory, LiveAfterForwardIsAboutTheBlockInputsNotTheActivations) {
  const int64_t input_bytes = kRows * kDim * 4;
  const int64_t rng_bytes = static_cast<int64_t>(at::detail::getDefaultCPUGenerator().get_state().nbytes());
  const int64_t plain = LiveBytesAfterForward(false);
  const int64_t ckpt = LiveBytesAfterForward(true);
  // Checkpointed: each block keeps its input (the previous block's output) and an RNG state,
  // plus the last output; 1 KiB per block of slack for small metadata tensors.
  EXPECT_LE(ckpt, kBlocks * (input_bytes + rng_bytes + 1024) + input_bytes) << "plain " << plain;
  // Plain: at least each block's relu output (kHidden / kDim = 8 inputs' worth).
  EXPECT_GE(plain, kBlocks * kRows * kHidden * 4);
  EXPECT_LT(ckpt * 5, plain) << "checkpointed " << ckpt << " bytes, plain " << plain;
  std::cout << "live after forward of " << kBlocks << " blocks: checkpointed " << ckpt << " bytes, plain " << plain
            << " bytes (block input " << input_bytes << ")\n";
}

// PyTorch's checkpoint frees a block's saved input once that block's backward ran, while the
// rest of the graph (here kept alive by `loss`) still exists: peak memory of a backward pass
// depends on it (full activation checkpointing in the trainer).
TEST(CheckpointMemory, BackwardReleasesEachBlockInput) {
  std::vector<CkptBlock> blocks;
  for (int i = 0; i < 4; ++i) blocks.emplace_back(8, 16);
  const at::Tensor x = Input(4, 8);
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> block_inputs;  // of blocks 1..3
  at::Tensor h = x;
  for (auto& b : blocks) {
    h = b(h);
    block_inputs.push_back(h.storage().getWeakStorageImpl());
  }
  block_inputs.pop_back();  // the last block's output is no block's input
  const at::Tensor loss = h.sum();
  h.reset();
  for (const auto& weak : block_inputs) EXPECT_FALSE(weak.expired());  // saved for backward
  loss.backward();
  EXPECT_TRUE(blocks[0]->fc1->weight.grad().defined());
  for (size_t i = 0; i < block_inputs.size(); ++i) EXPECT_TRUE(block_inputs[i].expired()) << "input of block " << i + 1;
}

TEST(CheckpointErrors, BadArgumentsAndUnsupportedUses) {
  const at::Tensor x = Input(2, 3);
  auto id = [](const std::vector<at::Tensor>& in) { return in[0] * 2; };
  EXPECT_ERROR_CONTAINS(checkpoint(id, {x, at::Tensor()}), "inputs[1]");
  EXPECT_ERROR_CONTAINS(checkpoint(CheckpointFn(), {x}), "fn is empty");
  CheckpointOptions opts;
  opts.params = std::vector<at::Tensor>{at::Tensor()};
  EXPECT_ERROR_CONTAINS(checkpoint(id, {x}, opts), "options.params[0]");
  // torch::autograd::grad would see parameters' .grad change: refused as PyTorch's reentrant.
  at::Tensor y = checkpoint(id, {x});
  EXPECT_ERROR_CONTAINS(torch::autograd::grad({y.sum()}, {x}), "not compatible with torch::autograd::grad");
  // A recomputation that differs from the first forward.
  int calls = 0;
  at::Tensor z =
      checkpoint([&](const std::vector<at::Tensor>& in) { return ++calls == 1 ? in[0] * 2 : in[0].sum(); }, {x});
  EXPECT_ERROR_CONTAINS(z.sum().backward(), "recomputed output 0");
}

}  // namespace
}  // namespace fsdp::activation_checkpointing
