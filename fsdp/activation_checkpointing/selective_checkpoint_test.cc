// Selective checkpointing on one process: the gradients of full recomputation (bitwise), a kept
// output really replaces its call in the recomputation (a random draw is not drawn again), the
// memory it keeps, in-place and view operators always rerun, and the error paths (a kept output
// changed in place, a second backward, a recomputation that calls other operators).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/linear.h>

#include <map>
#include <string>
#include <vector>

#include "fsdp/activation_checkpointing/checkpoint.h"
#include "fsdp/common/test_models.h"
#include "testing/allocation_counter.h"
#include "testing/expect_error.h"

namespace fsdp::activation_checkpointing {
namespace {

using test_models::InitDeterministic;

at::Tensor RandomInput(int64_t rows, int64_t cols, uint64_t seed) {
  return at::randn({rows, cols}, at::make_generator<at::CPUGeneratorImpl>(seed)).set_requires_grad(true);
}

std::string OpName(const OpCall& call) { return call.op.operator_name().name; }

// Saves the calls of the operators named in `names`, recomputes the rest; counts what it saw.
SelectivePolicyFactory SaveOps(std::vector<std::string> names, std::map<std::string, int>* seen = nullptr) {
  return [names, seen] {
    return [names, seen](const OpCall& call) {
      if (seen != nullptr) ++(*seen)[OpName(call)];
      for (const std::string& n : names) {
        if (OpName(call) == n) return CheckpointPolicy::kMustSave;
      }
      return CheckpointPolicy::kPreferRecompute;
    };
  };
}

SelectivePolicyFactory SaveEverything() {
  return [] { return [](const OpCall&) { return CheckpointPolicy::kMustSave; }; };
}

struct Mlp {
  Mlp() : fc1(torch::nn::LinearOptions(8, 16).bias(false)), fc2(16, 8) {
    InitDeterministic(*fc1, 1);
    InitDeterministic(*fc2, 2);
  }
  // A view among the operators, as a transformer block has them (no in-place operator: one on a
  // kept output is an error, see the error test).
  at::Tensor operator()(const at::Tensor& x) {
    at::Tensor h = fc1(x).relu();
    return x + fc2(h.view({-1, 16})).tanh();
  }
  std::vector<at::Tensor> Grads(const at::Tensor& x) const {
    return {x.grad().clone(), fc1->weight.grad().clone(), fc2->weight.grad().clone(), fc2->bias.grad().clone()};
  }
  void ZeroGrads(at::Tensor& x) {
    fc1->zero_grad();
    fc2->zero_grad();
    x.mutable_grad() = at::Tensor();
  }
  torch::nn::Linear fc1, fc2;
};

void ExpectBitwiseEqual(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "gradient " << i;
}

TEST(SelectiveCheckpoint, GradientsEqualFullRecomputationBitwiseWhateverThePolicySaves) {
  Mlp mlp;
  at::Tensor x = RandomInput(4, 8, 3);
  (mlp(x) * 3).pow(2).sum().backward();
  const std::vector<at::Tensor> reference = mlp.Grads(x);
  const std::vector<SelectivePolicyFactory> policies = {SaveOps({"aten::mm"}), SaveOps({"aten::addmm", "aten::tanh"}),
                                                        SaveEverything(), SaveOps({})};
  for (size_t p = 0; p < policies.size(); ++p) {
    SCOPED_TRACE(p);
    mlp.ZeroGrads(x);
    CheckpointOptions options;
    options.selective_policy = policies[p];
    at::Tensor y = checkpoint([&](const std::vector<at::Tensor>& in) { return mlp(in[0]); }, {x}, options);
    (y * 3).pow(2).sum().backward();
    ExpectBitwiseEqual(mlp.Grads(x), reference);
  }
}

TEST(SelectiveCheckpoint, PolicySeesTheOperatorsBelowAutogradWithTheirArgumentsOnceAForward) {
  Mlp mlp;
  at::Tensor x = RandomInput(4, 8, 3);
  std::map<std::string, int> seen;
  std::vector<std::vector<int64_t>> mm_rhs;
  CheckpointOptions options;
  options.selective_policy = [&] {
    return [&](const OpCall& call) {
      ++seen[OpName(call)];
      if (OpName(call) == "aten::mm") mm_rhs.push_back(call.arguments[1].toTensor().sizes().vec());
      return CheckpointPolicy::kPreferRecompute;
    };
  };
  at::Tensor y = checkpoint([&](const std::vector<at::Tensor>& in) { return mlp(in[0]); }, {x}, options);
  y.sum().backward();
  // fc1 (no bias) decomposes to aten::mm on the transposed weight, fc2 to aten::addmm; the
  // views are not shown (they always run again). Only the forward asks.
  EXPECT_EQ(seen["aten::mm"], 1);
  EXPECT_EQ(seen["aten::addmm"], 1);
  EXPECT_EQ(seen["aten::relu"], 1);
  EXPECT_EQ(seen["aten::tanh"], 1);
  EXPECT_EQ(seen.count("aten::view"), 0u);
  EXPECT_EQ(seen.count("aten::t"), 0u);
  ASSERT_EQ(mm_rhs.size(), 1u);
  EXPECT_EQ(mm_rhs[0], (std::vector<int64_t>{8, 16}));
}

TEST(SelectiveCheckpoint, InPlaceOperatorsAlwaysRunAgain) {
  at::Tensor x = RandomInput(3, 4, 9);
  auto fn = [](const std::vector<at::Tensor>& in) { return (in[0] * 2).add_(1) * in[0]; };
  fn({x}).sum().backward();
  const at::Tensor reference = x.grad().clone();
  x.mutable_grad() = at::Tensor();
  std::map<std::string, int> seen;
  CheckpointOptions options;
  options.selective_policy = SaveOps({"aten::add_"}, &seen);
  checkpoint(fn, {x}, options).sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), reference));
  EXPECT_EQ(seen.count("aten::add_"), 0u);  // never asked: its effect cannot be kept
  EXPECT_EQ(seen["aten::mul"], 2);
}

// y = x * rand_like(x): without the RNG replay a recomputed draw differs from the forward's, so
// the gradient x.grad = 2 y r tells whether the draw ran again. The products round in another
// order than autograd's (three float roundings): 8 float epsilons of relative tolerance, where
// another draw differs by O(1).
bool GradIsFromDraw(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& r) {
  constexpr double kRtol = 8 * 1.1920929e-07;
  return at::allclose(grad, 2 * x.detach() * r * r, kRtol, /*atol=*/0.0);
}
TEST(SelectiveCheckpoint, AKeptOutputReplacesItsCallInTheRecomputation) {
  at::Tensor x = RandomInput(3, 5, 7);
  at::Tensor r_forward;
  auto fn = [&](const std::vector<at::Tensor>& in) {
    at::Tensor r = at::rand_like(in[0]);
    if (!r_forward.defined()) r_forward = r.clone();
    return in[0] * r;
  };
  CheckpointOptions options;
  options.preserve_rng_state = false;
  options.selective_policy = SaveOps({"aten::rand_like"});
  at::Tensor y = checkpoint(fn, {x}, options);
  y.pow(2).sum().backward();
  EXPECT_TRUE(GradIsFromDraw(x.grad(), x, r_forward));

  // The same without the policy: the recomputation draws again, the gradient is another.
  x.mutable_grad() = at::Tensor();
  r_forward = at::Tensor();
  options.selective_policy = nullptr;
  y = checkpoint(fn, {x}, options);
  y.pow(2).sum().backward();
  EXPECT_FALSE(GradIsFromDraw(x.grad(), x, r_forward));
}

TEST(SelectiveCheckpoint, KeepsTheSavedOutputsAliveUntilBackward) {
  Mlp mlp;
  const at::Tensor x = RandomInput(64, 8, 3);
  auto live_after_forward = [&](const SelectivePolicyFactory& policy) {
    testing::ScopedAllocationCounter counter;
    CheckpointOptions options;
    options.selective_policy = policy;
    at::Tensor y = checkpoint([&](const std::vector<at::Tensor>& in) { return mlp(in[0]); }, {x}, options);
    const int64_t live = counter.current() - y.nbytes();
    y.sum().backward();
    return live;
  };
  const int64_t mm_output_bytes = 64 * 16 * 4;  // fc1's output, [64, 16] float
  const int64_t none = live_after_forward(SaveOps({}));
  const int64_t with_mm = live_after_forward(SaveOps({"aten::mm"}));
  // Exactly fc1's output more, which the forward would otherwise have freed.
  EXPECT_EQ(with_mm - none, mm_output_bytes);
}

TEST(SelectiveCheckpointErrors, InPlaceChangeOfAKeptOutputSecondBackwardAndMismatch) {
  Mlp mlp;
  at::Tensor x = RandomInput(4, 8, 3);
  CheckpointOptions options;
  // fc1's output is changed by relu_ after the forward kept it: PyTorch refuses it too.
  options.selective_policy = SaveOps({"aten::mm"});
  at::Tensor y =
      checkpoint([&](const std::vector<at::Tensor>& in) { return mlp.fc1(in[0]).relu_().sum(); }, {x}, options);
  EXPECT_ERROR_CONTAINS(y.backward(), "was modified in place after the forward");

  auto out_of_place = [&](const std::vector<at::Tensor>& in) { return (mlp.fc1(in[0]) * 2).sum(); };
  y = checkpoint(out_of_place, {x}, options);
  y.backward({}, /*retain_graph=*/true);
  EXPECT_ERROR_CONTAINS(y.backward(), "an extra time");

  // The recomputation multiplies other shapes than the forward did.
  int calls = 0;
  auto changing = [&](const std::vector<at::Tensor>& in) {
    const at::Tensor a = in[0].narrow(0, 0, ++calls == 1 ? 4 : 2);
    return at::mm(a, mlp.fc1->weight.t()).sum();
  };
  y = checkpoint(changing, {x}, options);
  EXPECT_ERROR_CONTAINS(y.backward(), "other argument shapes");
  calls = 0;
  auto extra = [&](const std::vector<at::Tensor>& in) {
    at::Tensor out = at::mm(in[0], mlp.fc1->weight.t());
    if (++calls > 1) out = at::mm(out, at::eye(16));
    return out.sum();
  };
  y = checkpoint(extra, {x}, options);
  EXPECT_ERROR_CONTAINS(y.backward(), "has no counterpart in the forward");

  options.selective_policy = [] { return SelectivePolicy(); };
  EXPECT_ERROR_CONTAINS(checkpoint(out_of_place, {x}, options), "empty policy");
}

// The forward runs without grad, the recomputation with it: code that adds an alias or a copy
// only under grad (DTensor's redistribute of an unchanged tensor whose gradient moves, a custom
// Function returning its input) calls operators in one pass only. Operators the forward kept
// nothing of need no counterpart, as in PyTorch; the gradients are full recomputation's.
TEST(SelectiveCheckpoint, CallsMadeOnlyWithGradNeedNoCounterpart) {
  Mlp mlp;
  const at::Tensor x = RandomInput(4, 8, 3);
  const auto fn = [&](const std::vector<at::Tensor>& in) {
    at::Tensor h = at::mm(in[0], mlp.fc1->weight.t());
    if (at::GradMode::is_enabled()) h = h.view_as(h).clone();
    return at::mm(h.relu(), mlp.fc2->weight.t()).sum();
  };
  const at::Tensor plain_x = x.detach().requires_grad_();
  fn({plain_x}).backward();
  const at::Tensor want_x = plain_x.grad().clone(), want_w = mlp.fc1->weight.grad().clone();
  mlp.fc1->weight.mutable_grad().reset();
  CheckpointOptions options;
  options.selective_policy = SaveOps({"aten::mm"});
  const at::Tensor ckpt_x = x.detach().requires_grad_();
  checkpoint(fn, {ckpt_x}, options).backward();
  EXPECT_TRUE(at::equal(ckpt_x.grad(), want_x));
  EXPECT_TRUE(at::equal(mlp.fc1->weight.grad(), want_w));
}

}  // namespace
}  // namespace fsdp::activation_checkpointing
