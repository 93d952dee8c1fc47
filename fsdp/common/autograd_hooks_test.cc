// RegisterPostBackwardCallback: the callback runs once, after every routed tensor's
// gradient is computed; gradients pass through unchanged, as zeros where an output got
// none (autograd.Function's materialize_grads); the outputs alias their inputs' data and
// version counters and take in-place changes with correct gradients.
// PostAccumulateGradCallback: runs once per backward after .grad holds every use's
// contribution, after a hook installed earlier, and never once disarmed.
// GradientCountdown: fires once when every armed parameter's gradient is in, not while
// disarmed or with a frozen parameter.
// RunWhenGradientComputed: once per backward when that output's gradient exists, before the
// node that produced it runs; leaves too.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <memory>
#include <string>
#include <vector>

#include "fsdp/common/autograd_hooks.h"

namespace fsdp {
namespace {

TEST(RegisterPostBackwardCallback, RunsOnceAfterEveryGradientAndPassesThem) {
  const at::Tensor a = at::randn({3}).requires_grad_();
  const at::Tensor b = at::randn({3}).requires_grad_();
  const at::Tensor c = at::randn({3});  // no grad: passed as is
  int calls = 0;
  std::vector<bool> had_grads;
  const std::vector<at::Tensor> out = RegisterPostBackwardCallback({a, b, c}, [&] { ++calls; });
  ASSERT_EQ(out.size(), 3u);
  EXPECT_TRUE(out[2].is_same(c));
  EXPECT_FALSE(out[0].is_same(a));
  EXPECT_EQ(out[0].data_ptr(), a.data_ptr());
  EXPECT_EQ(out[0].grad_fn()->name(), "fsdp::PostBackwardNode");
  EXPECT_TRUE(out[0].grad_fn() == out[1].grad_fn());
  // The reference without the node: the same expression on the plain tensors.
  const at::Tensor loss = (out[0] * out[1] * 2).sum() + (out[1] * out[1]).sum();
  loss.backward();
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(at::allclose(a.grad(), b.detach() * 2));
  EXPECT_TRUE(at::allclose(b.grad(), a.detach() * 2 + b.detach() * 2));
}

TEST(RegisterPostBackwardCallback, AnUnusedOutputPassesZeros) {
  const at::Tensor a = at::randn({2, 2}).requires_grad_();
  const at::Tensor b = at::randn({4}).requires_grad_();
  int calls = 0;
  const std::vector<at::Tensor> out = RegisterPostBackwardCallback({a, b}, [&] { ++calls; });
  out[0].sum().backward();
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(at::equal(a.grad(), at::ones({2, 2})));
  ASSERT_TRUE(b.grad().defined());  // as a Python autograd.Function would give
  EXPECT_TRUE(at::equal(b.grad(), at::zeros({4})));
}

TEST(RegisterPostBackwardCallback, InPlaceChangesOfTheOutputKeepGradientsAndVersions) {
  const at::Tensor a = at::randn({3}).requires_grad_();
  const at::Tensor x = a * 1;  // a non-leaf input, as module inputs are
  int calls = 0;
  std::vector<at::Tensor> out = RegisterPostBackwardCallback({x}, [&] { ++calls; });
  const int64_t version = x._version();
  out[0].mul_(3);
  EXPECT_EQ(x._version(), version + 1);  // shared version counter
  (out[0] * out[0]).sum().backward();
  EXPECT_EQ(calls, 1);
  // d/da sum((3a)^2) = 18 a
  EXPECT_TRUE(at::allclose(a.grad(), a.detach() * 18));
}

TEST(RegisterPostBackwardCallback, NothingToRouteWithoutGradMode) {
  const at::Tensor a = at::randn({3}).requires_grad_();
  at::NoGradGuard no_grad;
  const std::vector<at::Tensor> out = RegisterPostBackwardCallback({a}, [] {});
  EXPECT_TRUE(out[0].is_same(a));
}

TEST(PostAccumulateGradCallback, RunsOncePerBackwardWithEveryUseAccumulated) {
  const at::Tensor w = at::randn({3}).requires_grad_();
  std::vector<at::Tensor> seen;
  PostAccumulateGradCallback hook(w, [&] { seen.push_back(w.grad().clone()); });
  const at::Tensor x = at::randn({3});
  // Two uses: d/dw sum(w*x + w*w) = x + 2w, seen whole by the one call.
  ((w * x).sum() + (w * w).sum()).backward();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_TRUE(at::allclose(seen[0], x + w.detach() * 2));
  (w * 3).sum().backward();  // a second backward accumulates into .grad and runs it again
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_TRUE(at::allclose(seen[1], x + w.detach() * 2 + 3));
}

TEST(PostAccumulateGradCallback, ChainsAfterAnEarlierHookAndDisarmsWhenDestroyed) {
  const at::Tensor w = at::randn({2}).requires_grad_();
  std::vector<int> order;
  auto first = std::make_unique<PostAccumulateGradCallback>(w, [&] { order.push_back(1); });
  {
    PostAccumulateGradCallback second(w, [&] { order.push_back(2); });
    w.sum().backward();
    EXPECT_EQ(order, (std::vector<int>{1, 2}));
  }
  w.sum().backward();  // `second` is gone: only the first runs
  EXPECT_EQ(order, (std::vector<int>{1, 2, 1}));
  first.reset();
  w.sum().backward();
  EXPECT_EQ(order, (std::vector<int>{1, 2, 1}));
  EXPECT_TRUE(at::allclose(w.grad(), at::full({2}, 3.0)));
}

TEST(PostAccumulateGradCallback, NotRunForATensorThatGotNoGradient) {
  const at::Tensor w = at::randn({2}).requires_grad_();
  const at::Tensor v = at::randn({2}).requires_grad_();
  int calls = 0;
  PostAccumulateGradCallback hook(w, [&] { ++calls; });
  v.sum().backward();
  EXPECT_EQ(calls, 0);
}

TEST(PostAccumulateGradCallback, RejectsANonLeaf) {
  const at::Tensor w = at::randn({2}).requires_grad_();
  try {
    PostAccumulateGradCallback hook(w * 2, [] {});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("`param` must be a leaf"), std::string::npos) << e.what();
  }
}

TEST(GradientCountdown, FiresOnceAllArmedGradientsAreInAndNeverWhenDisarmedOrFrozen) {
  const at::Tensor a = at::randn({2}).requires_grad_();
  const at::Tensor b = at::randn({2}).requires_grad_();
  int fired = 0;
  bool b_had_grad = false;
  GradientCountdown countdown;
  countdown.Install({a, b}, [&] {
    ++fired;
    b_had_grad = b.grad().defined();
  });
  EXPECT_TRUE(countdown.installed());
  (a * b).sum().backward();  // not armed
  EXPECT_EQ(fired, 0);
  countdown.Arm();
  (a * b).sum().backward();
  EXPECT_EQ(fired, 1);
  EXPECT_TRUE(b_had_grad);
  countdown.Arm();
  a.sum().backward();  // b gets no gradient: the count stays above zero
  EXPECT_EQ(fired, 1);
  countdown.Disarm();
  b.sum().backward();
  EXPECT_EQ(fired, 1);
  b.set_requires_grad(false);
  EXPECT_FALSE(countdown.AllRequireGrad());
  countdown.Arm();  // disarmed: b is frozen (two of a's gradients must not count as two)
  a.sum().backward();
  a.sum().backward();
  EXPECT_EQ(fired, 1);
}

TEST(RunWhenGradientComputed, RunsOncePerBackwardBeforeTheProducingNode) {
  const at::Tensor w = at::randn({4}).requires_grad_();
  const at::Tensor y = w * 2;  // MulBackward0 produces w's gradient after the hook
  int calls = 0;
  bool w_had_grad = true;
  RunWhenGradientComputed(y, [&] {
    ++calls;
    w_had_grad = w.grad().defined();
  });
  (y * y).sum().backward({}, /*retain_graph=*/true);
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(w_had_grad);
  y.sum().backward();
  EXPECT_EQ(calls, 2);
}

TEST(RunWhenGradientComputed, OnlyWhenThatOutputGotAGradient) {
  const at::Tensor w = at::randn({4}).requires_grad_();
  const std::vector<at::Tensor> halves = (w * 1).split(2);  // one node, two outputs
  int first = 0, second = 0;
  RunWhenGradientComputed(halves[0], [&] { ++first; });
  RunWhenGradientComputed(halves[1], [&] { ++second; });
  halves[1].sum().backward();  // the split node runs; halves[0] got no gradient
  EXPECT_EQ(first, 0);
  EXPECT_EQ(second, 1);
}

TEST(RunWhenGradientComputed, ALeafAndTheErrorForATensorWithoutGrad) {
  const at::Tensor w = at::randn({3}).requires_grad_();
  int calls = 0;
  RunWhenGradientComputed(w, [&] { ++calls; });
  (w * 3).sum().backward();
  EXPECT_EQ(calls, 1);
  try {
    RunWhenGradientComputed(at::ones({2}), [] {});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be a defined tensor that requires grad"), std::string::npos);
  }
}

}  // namespace
}  // namespace fsdp
