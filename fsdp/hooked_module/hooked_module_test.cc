// The hooked-module layer without any FSDP: hooks run in nesting order around the wrapped
// forward, see and replace tensors in arguments and outputs, const forwards work, modules
// stay usable in Sequential / AnyModule, and errors are clear.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "fsdp/hooked_module/hooked_module.h"
#include "testing/expect_error.h"

namespace fsdp {
namespace {

struct ScaleImpl : torch::nn::Module {
  explicit ScaleImpl(double s = 2.0) : scale(s) {}
  at::Tensor forward(const at::Tensor& x) { return x * scale; }
  double scale;
};

// A const forward with mixed argument types and a tuple output.
struct ConstPairImpl : torch::nn::Module {
  ConstPairImpl() : lin(register_module("lin", torch::nn::Linear(2, 2))) {}
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, int64_t k, at::Tensor y) const {
    return {lin.ptr()->forward(x) * static_cast<double>(k), y + 1};
  }
  torch::nn::Linear lin;
};

// Records its calls into `log`; adds `add` to every argument and multiplies every output.
class RecordingHook : public ForwardHook {
 public:
  RecordingHook(std::string name, std::vector<std::string>* log, double add = 0, double mul = 1)
      : name_(std::move(name)), log_(log), add_(add), mul_(mul) {}
  std::vector<at::Tensor> PreForward(std::vector<at::Tensor> args) override {
    log_->push_back("pre " + name_ + " " + std::to_string(args.size()));
    for (auto& a : args) a = a + add_;
    return args;
  }
  void PostForward(const std::vector<at::Tensor*>& outputs) override {
    log_->push_back("post " + name_ + " " + std::to_string(outputs.size()));
    for (at::Tensor* o : outputs) *o = *o * mul_;
  }

 private:
  std::string name_;
  std::vector<std::string>* log_;
  double add_, mul_;
};

TEST(HookedModule, WithoutHooksIsThePlainForward) {
  Hooked<ScaleImpl> m(3.0);
  const at::Tensor x = at::arange(4, at::kFloat);
  EXPECT_TRUE(at::equal(m(x), x * 3));
  EXPECT_FALSE(m->has_forward_hooks());
}

TEST(HookedModule, HooksNestLikeWrappers) {
  std::vector<std::string> log;
  Hooked<ScaleImpl> m(2.0);
  auto inner = std::make_shared<RecordingHook>("inner", &log, /*add=*/1, /*mul=*/10);
  auto outer = std::make_shared<RecordingHook>("outer", &log, /*add=*/100, /*mul=*/-1);
  m->AddForwardHook(inner);
  m->AddForwardHook(outer, HookPosition::kOutermost);
  const at::Tensor x = at::zeros({3});
  // pre outer (+100), pre inner (+1), forward (*2), post inner (*10), post outer (*-1).
  const at::Tensor out = m(x);
  EXPECT_TRUE(at::equal(out, at::full({3}, -2020.f)));
  EXPECT_EQ(log, (std::vector<std::string>{"pre outer 1", "pre inner 1", "post inner 1", "post outer 1"}));
  EXPECT_TRUE(at::equal(x, at::zeros({3}))) << "the caller's tensor must not be modified";
  // An innermost hook added later runs closest to the forward.
  auto last = std::make_shared<RecordingHook>("last", &log);
  m->AddForwardHook(last);
  ASSERT_EQ(m->forward_hooks().size(), 3u);
  EXPECT_EQ(m->forward_hooks()[0].get(), outer.get());
  EXPECT_EQ(m->forward_hooks()[2].get(), last.get());
  EXPECT_TRUE(m->RemoveForwardHook(outer.get()));
  EXPECT_FALSE(m->RemoveForwardHook(outer.get()));
  log.clear();
  EXPECT_TRUE(at::equal(m(x), at::full({3}, 20.f)));
  EXPECT_EQ(log, (std::vector<std::string>{"pre inner 1", "pre last 1", "post last 1", "post inner 1"}));
  EXPECT_EQ(m->FindForwardHook<RecordingHook>().get(), inner.get());
}

TEST(HookedModule, ConstForwardWithMixedArgumentsAndTupleOutput) {
  std::vector<std::string> log;
  auto m = std::make_shared<HookedImpl<ConstPairImpl>>();
  const HookedImpl<ConstPairImpl>& cm = *m;
  const at::Tensor x = at::ones({1, 2}), y = at::zeros({2});
  auto [a0, b0] = cm.forward(x, 3, y);
  m->AddForwardHook(std::make_shared<RecordingHook>("h", &log, /*add=*/0, /*mul=*/2));
  auto [a1, b1] = cm.forward(x, 3, y);
  EXPECT_TRUE(at::allclose(a1, a0 * 2));
  EXPECT_TRUE(at::equal(b1, b0 * 2));
  // Two tensor arguments (the int64_t is passed through), two output tensors.
  EXPECT_EQ(log, (std::vector<std::string>{"pre h 2", "post h 2"}));
  // Parameter names are Impl's own.
  EXPECT_EQ(m->named_parameters().keys(), (std::vector<std::string>{"lin.weight", "lin.bias"}));
}

TEST(HookedModule, WorksInSequentialAndAnyModule) {
  std::vector<std::string> log;
  Hooked<ScaleImpl> a(2.0), b(5.0);
  b->AddForwardHook(std::make_shared<RecordingHook>("b", &log, /*add=*/1));
  torch::nn::Sequential seq(a, b);
  EXPECT_TRUE(at::equal(seq->forward(at::ones({2})), at::full({2}, 15.f)));
  torch::nn::AnyModule any(a);
  EXPECT_TRUE(at::equal(any.forward(at::ones({2})), at::full({2}, 2.f)));
  EXPECT_EQ(log, (std::vector<std::string>{"pre b 1", "post b 1"}));
}

TEST(HookedModule, Errors) {
  Hooked<ScaleImpl> m;
  EXPECT_ERROR_CONTAINS(m->AddForwardHook(nullptr), "AddForwardHook: hook is null");
  std::vector<std::string> log;
  auto h = std::make_shared<RecordingHook>("h", &log);
  m->AddForwardHook(h);
  EXPECT_ERROR_CONTAINS(m->AddForwardHook(h), "already attached");

  class DroppingHook : public ForwardHook {
    std::vector<at::Tensor> PreForward(std::vector<at::Tensor>) override { return {}; }
  };
  Hooked<ScaleImpl> d;
  d->AddForwardHook(std::make_shared<DroppingHook>());
  EXPECT_ERROR_CONTAINS(d(at::ones({1})), "forward pre-hook 0 returned 0 tensors for 1 tensor arguments");

  torch::nn::Linear plain(2, 2);
  EXPECT_EQ(AsHooked(*plain), nullptr);
  EXPECT_EQ(FindForwardHook<RecordingHook>(*plain), nullptr);
  EXPECT_EQ(FindForwardHook<RecordingHook>(*m).get(), h.get());
}

// Replaces ScaleImpl's forward: x * 10 + the module's own scale.
class TenTimes : public ForwardReplacement<at::Tensor, const at::Tensor&> {
 public:
  explicit TenTimes(const ScaleImpl& module) : module_(module) {}
  at::Tensor Forward(const at::Tensor& x) override { return x * 10 + module_.scale; }

 private:
  const ScaleImpl& module_;
};
class WrongSignature : public ForwardReplacement<at::Tensor, at::Tensor> {
 public:
  at::Tensor Forward(at::Tensor x) override { return x; }
};

TEST(HookedModule, ForwardReplacementRunsBetweenTheHooks) {
  Hooked<ScaleImpl> m(3.0);
  const at::Tensor x = at::arange(4, at::kFloat);
  auto replacement = std::make_shared<TenTimes>(*m);
  m->SetForwardReplacement(replacement);
  EXPECT_TRUE(at::equal(m(x), x * 10 + 3));
  std::vector<std::string> log;
  m->AddForwardHook(std::make_shared<RecordingHook>("h", &log, /*add=*/1, /*mul=*/2));
  EXPECT_TRUE(at::equal(m(x), ((x + 1) * 10 + 3) * 2));
  EXPECT_EQ(log, (std::vector<std::string>{"pre h 1", "post h 1"}));
  EXPECT_EQ(FindForwardReplacement<TenTimes>(*m), replacement);
  EXPECT_EQ(FindForwardReplacement<WrongSignature>(*m), nullptr);
  m->SetForwardReplacement(nullptr);  // restores Impl::forward
  EXPECT_TRUE(at::equal(m(x), (x + 1) * 3 * 2));
  EXPECT_ERROR_CONTAINS(m->SetForwardReplacement(std::make_shared<WrongSignature>()),
                        "replacement's Forward signature is not this module's forward's");
}

}  // namespace
}  // namespace fsdp
