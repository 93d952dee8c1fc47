// The state base both FSDPs derive from (fsdp/common/fsdp_state_base.h): the first hook error
// poisons every later call, and the weak state references handles hold fail clearly once
// their module is gone.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp/common/fsdp_state_base.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "testing/expect_error.h"

namespace fsdp {
namespace {

struct ScaleImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) { return x * 2; }
};

// A minimal FSDP-like state: its pre-forward fails when told to; the failure poisons it.
class ToyState final : public FSDPStateBase {
 public:
  ToyState() : FSDPStateBase("toy parameters") {}
  const char* api_name() const override { return "toy"; }
  std::vector<at::Tensor> PreForward(std::vector<at::Tensor> args) override {
    return Guard("pre-forward", [&] {
      if (fail) throw std::runtime_error("collective timed out");
      return args;
    });
  }
  bool fail = false;

 private:
  std::string& poison_record() const override { return record_; }
  mutable std::string record_;
};

TEST(FSDPStateBase, FirstHookErrorPoisonsEveryLaterCall) {
  Hooked<ScaleImpl> m;
  auto state = std::make_shared<ToyState>();
  m->AddForwardHook(state);
  EXPECT_NO_THROW(m(at::ones({1})));
  state->fail = true;
  EXPECT_THROW(m(at::ones({1})), std::runtime_error);
  state->fail = false;
  EXPECT_ERROR_CONTAINS(m(at::ones({1})),
                        "pre-forward: FSDP cannot continue after an earlier error on this rank "
                        "(pre-forward: collective timed out): toy parameters may be unsharded");
  EXPECT_ERROR_CONTAINS(state->CheckNotPoisoned("state dict"), "state dict: FSDP cannot continue");
}

TEST(StateRef, FailsClearlyOnceTheModuleIsGone) {
  StateRef<ToyState> empty;
  EXPECT_ERROR_CONTAINS(empty.Get("Handle"), "Handle: empty handle");
  StateRef<ToyState> ref;
  {
    Hooked<ScaleImpl> m;
    auto state = std::make_shared<ToyState>();
    m->AddForwardHook(state);
    ref = StateRef<ToyState>(state.get());
    EXPECT_EQ(ref.Get("Handle"), state.get());
  }
  EXPECT_ERROR_CONTAINS(ref.Get("Handle"), "Handle: the module this handle was returned for has been destroyed");
}

}  // namespace
}  // namespace fsdp
