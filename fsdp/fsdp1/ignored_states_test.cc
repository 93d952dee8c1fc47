// FSDP1 ignored_modules / ignored_states and MixedPrecision::buffer_dtype, against PyTorch
// 2.15's semantics (torch/distributed/fsdp/_init_utils.py, _runtime_utils.py,
// _state_dict_utils.py) and single-rank training without FSDP as the reference.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <string>

#include "absl/strings/match.h"
#include "fsdp/fsdp1/state_dict.h"
#include "fsdp/fsdp1/test_models.h"
#include "testing/float_tolerance.h"
#include "testing/multi_rank.h"

namespace fsdp::fsdp1 {
namespace {

using fsdp::testing::Backend;
using testing::Batch;
using testing::BlockImpl;
using testing::InitDeterministic;
using testing::Net;

#define EXPECT_ERROR_EQ(statement, message)                                                   \
  do {                                                                                        \
    try {                                                                                     \
      statement;                                                                              \
      ADD_FAILURE() << #statement << " did not throw";                                        \
    } catch (const c10::Error& e) {                                                           \
      EXPECT_EQ(std::string(e.what_without_backtrace()), std::string(message)) << #statement; \
    }                                                                                         \
  } while (0)

bool InAnyHandle(FullyShardedDataParallel& root, const std::string& prefix) {
  for (FlatParamHandle* h : root.handles()) {
    for (const std::string& fqn : h->flat_param().fqns) {
      if (absl::StartsWith(fqn, prefix)) return true;
    }
  }
  return false;
}

// One training step on this rank's quarter / third of the batch; the ignored parameters'
// gradients are local (FSDP does not reduce them), so the test averages them by hand, as a
// user replicating them would.
void Step(Net& model, torch::optim::Optimizer& opt, int step, int world, int rank,
          const std::vector<at::Tensor>& ignored, const comm::ProcessGroupPtr& pg) {
  const int64_t local = 12 / world;
  const at::Tensor x = Batch(step, 12, 3, 1), y = Batch(step, 12, 1, 2);
  torch::nn::functional::mse_loss(model(x.narrow(0, rank * local, local)), y.narrow(0, rank * local, local)).backward();
  for (const at::Tensor& p : ignored) {
    if (pg) pg->all_reduce(p.mutable_grad())->wait();
    if (pg) p.mutable_grad().div_(world);
  }
  opt.step();
  opt.zero_grad();
}

// block1 ignored: its parameters stay full on every rank, are in no flat parameter, get local
// gradients only, and the state dict holds them as they are; training equals one rank.
void IgnoredParity(int world) {
  Net ref(2);
  InitDeterministic(*ref);
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int s = 0; s < 3; ++s) Step(ref, ref_opt, s, 1, 0, {}, nullptr);
  fsdp::testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
    Net model(2);
    InitDeterministic(*model);
    FSDPOptions options{.process_group = pg};
    wrap_fsdp(model->layers[0].ptr(), options);
    options.ignored_modules = std::vector<std::shared_ptr<torch::nn::Module>>{model->layers[1].ptr()};
    FullyShardedDataParallel root = wrap_fsdp(model.ptr(), options);
    EXPECT_FALSE(InAnyHandle(root, "block1."));
    EXPECT_TRUE(InAnyHandle(root, "in."));
    EXPECT_EQ(root.state()->ignored.params.size(), 4u);
    const at::Tensor w = model->layers[1]->fc1->weight;
    EXPECT_EQ(w.sizes(), (std::vector<int64_t>{7, 5}));
    std::vector<at::Tensor> ignored = model->layers[1]->parameters();
    torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(1e-2));
    // No reduction: right after backward the ranks' gradients differ.
    {
      const int64_t local = 12 / world;
      const at::Tensor x = Batch(0, 12, 3, 1).narrow(0, pg->rank() * local, local);
      model(x).sum().backward();
      at::Tensor lo = w.grad().clone(), hi = w.grad().clone();
      pg->all_reduce(lo, comm::ReduceOp::Min())->wait();
      pg->all_reduce(hi, comm::ReduceOp::Max())->wait();
      EXPECT_GT((hi - lo).abs().max().item<double>(), 0.0);
      opt.zero_grad();
    }
    for (int s = 0; s < 3; ++s) Step(model, opt, s, world, pg->rank(), ignored, pg);
    FullStateDict sd = GetFullStateDict(root);
    ASSERT_EQ(sd.size(), ref->named_parameters().size());
    for (const auto& item : ref->named_parameters()) {
      // Sliced vs whole-batch gradient sums through 3 AdamW steps at lr 1e-2 (parameters of order 1).
      EXPECT_LE((sd[item.key()] - item.value()).abs().max().item<double>(),
                fsdp::testing::AdamWParityTolerance(3, /*lr=*/1e-2))
          << item.key();
    }
    // Loading sets the ignored parameters too.
    FullStateDict twice;
    for (const auto& item : sd) twice.insert(item.key(), item.value() * 2);
    LoadFullStateDict(root, twice);
    EXPECT_TRUE(at::allclose(w, sd["block1.fc1.weight"] * 2));  // exact in float
  });
}

TEST(FsdpIgnoredStates, IgnoredModuleStaysFullAndTrainsLikeOneRank) {
  IgnoredParity(2);
  IgnoredParity(3);
}

TEST(FsdpIgnoredStates, AutoWrapSkipsIgnoredModulesAndParameters) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    Net model(3);
    FSDPOptions options{.process_group = pg, .auto_wrap_policy = ModuleTypeWrapPolicy<BlockImpl>()};
    options.ignored_states = std::vector<IgnoredState>{model->layers[1].ptr(), model->layers[2].ptr()};
    FullyShardedDataParallel root = wrap_fsdp(model.ptr(), options);
    EXPECT_NE(GetState(*model->layers[0]), nullptr);
    EXPECT_EQ(GetState(*model->layers[1]), nullptr);
    EXPECT_EQ(GetState(*model->layers[2]), nullptr);
    EXPECT_FALSE(InAnyHandle(root, "block1."));
    EXPECT_FALSE(InAnyHandle(root, "block2."));
    // The auto-wrapped child got the root's ignored parameters (PyTorch's root_kwargs).
    EXPECT_EQ(GetState(*model->layers[0])->ignored.params.size(), 8u);
    // Parameters as ignored_states: `extra` stays a plain 6-element parameter.
    Net other(1);
    FSDPOptions by_param{.process_group = pg};
    by_param.ignored_states = std::vector<IgnoredState>{other->extra};
    FullyShardedDataParallel r2 = wrap_fsdp(other.ptr(), by_param);
    for (const std::string& fqn : r2.handle()->flat_param().fqns) EXPECT_NE(fqn, "extra");
    EXPECT_EQ(other->extra.numel(), 6);
  });
}

TEST(FsdpIgnoredStates, BadInputFailsNamingTheArgument) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    Net model(2);
    FSDPOptions both{.process_group = pg};
    both.ignored_modules = std::vector<std::shared_ptr<torch::nn::Module>>{model->in.ptr()};
    both.ignored_states = std::vector<IgnoredState>{model->head.ptr()};
    EXPECT_ERROR_EQ(wrap_fsdp(model.ptr(), both),
                    "wrap_fsdp: Cannot pass both ignored_modules and ignored_states at the same time. Please just "
                    "pass ignored_states.");
    FSDPOptions mixed{.process_group = pg};
    mixed.ignored_states = std::vector<IgnoredState>{model->head.ptr(), model->extra};
    EXPECT_ERROR_EQ(wrap_fsdp(model.ptr(), mixed),
                    "wrap_fsdp: ignored_states expects all nn.Parameter or all nn.Module list elements but got both "
                    "parameters and modules");
    FSDPOptions null_module{.process_group = pg};
    null_module.ignored_modules = std::vector<std::shared_ptr<torch::nn::Module>>{nullptr};
    EXPECT_ERROR_EQ(wrap_fsdp(model.ptr(), null_module),
                    "wrap_fsdp: `ignored_modules` should be an iterable of `torch.nn.Module`s but got a null module");
    wrap_fsdp(model->layers[0].ptr(), {.process_group = pg});
    FSDPOptions fsdp_module{.process_group = pg};
    fsdp_module.ignored_modules = std::vector<std::shared_ptr<torch::nn::Module>>{model->layers[0].ptr()};
    EXPECT_ERROR_EQ(wrap_fsdp(model.ptr(), fsdp_module),
                    "wrap_fsdp: `ignored_modules` should not include FSDP modules");
    // Ignoring the root itself: PyTorch warns and ignores every parameter (no handle).
    Net lone(1);
    FSDPOptions self{.process_group = pg};
    self.ignored_modules = std::vector<std::shared_ptr<torch::nn::Module>>{lone.ptr()};
    FullyShardedDataParallel r = wrap_fsdp(lone.ptr(), self);
    EXPECT_EQ(r.handle(), nullptr);
  });
}

// A linear layer scaled by a floating buffer, with an integer buffer counting calls; records
// the dtype the forward saw.
struct ScaledImpl : torch::nn::Module {
  ScaledImpl()
      : fc(register_module("fc", torch::nn::Linear(5, 5))),
        scale(register_buffer("scale", at::linspace(0.9, 1.1, 5) + 1e-3)),
        count(register_buffer("count", at::zeros({1}, at::kLong))) {}
  at::Tensor forward(const at::Tensor& x) {
    seen = scale.scalar_type();
    count.add_(1);
    return fc(x) * scale;
  }
  torch::nn::Linear fc;
  at::Tensor scale, count;
  c10::ScalarType seen = c10::ScalarType::Undefined;
};
using Scaled = ::fsdp::Hooked<ScaledImpl>;

struct TopImpl : torch::nn::Module {
  TopImpl()
      : in(register_module("in", torch::nn::Linear(3, 5))),
        a(register_module("a", Scaled())),
        b(register_module("b", Scaled())),
        head(register_module("head", torch::nn::Linear(5, 1))) {}
  at::Tensor forward(const at::Tensor& x) { return head(b(a(in(x)))); }
  torch::nn::Linear in;
  Scaled a, b;
  torch::nn::Linear head;
};
using Top = ::fsdp::Hooked<TopImpl>;

void TrainTop(Top& model, torch::optim::Optimizer& opt, int steps, int world, int rank) {
  const int64_t local = 12 / world;
  for (int s = 0; s < steps; ++s) {
    const at::Tensor x = Batch(s, 12, 3, 1), y = Batch(s, 12, 1, 2);
    torch::nn::functional::mse_loss(model(x.narrow(0, rank * local, local)), y.narrow(0, rank * local, local))
        .backward();
    opt.step();
    opt.zero_grad();
  }
}

// buffer_dtype: buffers are bf16 in forward (from the root's lazy init on), integer buffers
// untouched; full state dicts hold the original float32; training equals one rank whose
// buffers were bf16 from the start.
void BufferDtypeParity(int world) {
  Top ref;
  InitDeterministic(*ref);
  {
    at::NoGradGuard g;
    for (Scaled* m : {&ref->a, &ref->b}) (*m)->scale.set_data((*m)->scale.to(at::kBFloat16));
  }
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  TrainTop(ref, ref_opt, 3, 1, 0);
  fsdp::testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
    Top model;
    InitDeterministic(*model);
    const at::Tensor orig_scale = model->a->scale.clone();
    FSDPOptions options{.process_group = pg, .mixed_precision = MixedPrecision{.buffer_dtype = at::kBFloat16}};
    wrap_fsdp(model->a.ptr(), options);
    FullyShardedDataParallel root = wrap_fsdp(model.ptr(), options);
    EXPECT_EQ(model->a->scale.scalar_type(), at::kFloat);  // cast at the root's lazy init
    torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(1e-2));
    TrainTop(model, opt, 3, world, pg->rank());
    EXPECT_EQ(model->a->seen, at::kBFloat16);
    EXPECT_EQ(model->b->seen, at::kBFloat16);
    EXPECT_EQ(model->a->scale.scalar_type(), at::kBFloat16);
    EXPECT_EQ(model->a->count.scalar_type(), at::kLong);
    EXPECT_EQ(model->a->count.item<int64_t>(), 3);
    // bf16 buffers against the reference's f32 ones, through 3 AdamW steps at lr 1e-2: kept at 1e-5,
    // the scale buffer's bf16 rounding (u = 2^-8) shifts each step's gradient by ~u relative, which
    // AdamW's normalised step cancels except where an element is near zero; a whole step is 1e-2.
    testing::ExpectParamsMatch(root, *ref, 1e-5, "buffer_dtype w" + std::to_string(world));
    FullStateDict sd = GetFullStateDict(root);
    EXPECT_EQ(sd["a.scale"].scalar_type(), at::kFloat);
    EXPECT_EQ(sd["b.scale"].scalar_type(), at::kFloat);
    EXPECT_EQ(sd["a.count"].scalar_type(), at::kLong);
    EXPECT_TRUE(at::equal(sd["a.scale"], orig_scale.to(at::kBFloat16).to(at::kFloat)));
    EXPECT_FALSE(at::equal(sd["a.scale"], orig_scale));       // it went through bf16
    EXPECT_EQ(model->a->scale.scalar_type(), at::kBFloat16);  // the module keeps the cast buffer
  });
}

TEST(FsdpBufferDtype, BuffersCastForForwardAndSavedInTheirOriginalDtype) {
  BufferDtypeParity(2);
  BufferDtypeParity(3);
}

TEST(FsdpBufferDtype, IgnoredBuffersStayAndFullPrecisionEvalRestoresTheOthers) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    at::NoGradGuard no_grad;  // forwards only
    const at::Tensor x = Batch(0, 4, 3, 1);
    {
      Top model;
      FSDPOptions options{.process_group = pg, .mixed_precision = MixedPrecision{.buffer_dtype = at::kBFloat16}};
      options.ignored_modules = std::vector<std::shared_ptr<torch::nn::Module>>{model->b.ptr()};
      wrap_fsdp(model.ptr(), options);
      model(x);
      EXPECT_EQ(model->a->seen, at::kBFloat16);
      EXPECT_EQ(model->b->seen, at::kFloat);  // ignored: not cast
    }
    Top model;
    FSDPOptions options{.process_group = pg,
                        .mixed_precision = MixedPrecision{.param_dtype = at::kBFloat16, .buffer_dtype = at::kBFloat16},
                        .use_full_prec_in_eval = true};
    wrap_fsdp(model.ptr(), options);
    model(x);
    EXPECT_EQ(model->a->seen, at::kBFloat16);
    model->eval();
    model(x);
    EXPECT_EQ(model->a->seen, at::kFloat);  // forced full precision in eval: original dtype
    model->train();
    model(x);
    EXPECT_EQ(model->a->seen, at::kBFloat16);
  });
}

}  // namespace
}  // namespace fsdp::fsdp1
