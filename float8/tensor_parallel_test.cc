// Float8 linears under tensor parallelism: a colwise then a rowwise layer on 2 ranks against
// the same float8 layers unsharded on one. torchao computes each scale on the DTensor, so an
// amax over a sharded dim is global; ours all-reduces those amaxes, so every float8 operand
// has the bits of the unsharded run and only the sums split over ranks (the rowwise layer's
// output, the colwise layer's input gradient) are added in another order.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>

#include "comm/comm_trace.h"
#include "float8/float8_linear.h"
#include "float8/float8_parallel_style.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "mesh/device_mesh.h"
#include "tensor_parallel/parallel_style.h"
#include "tensor_parallel/parallelize_module.h"
#include "testing/expect_error.h"
#include "testing/float_tolerance.h"
#include "testing/multi_rank.h"

namespace fsdp::float8 {
namespace {

using Linear = Hooked<torch::nn::LinearImpl>;

struct PairImpl : torch::nn::Module {
  PairImpl() {
    up = register_module("up", Linear(torch::nn::LinearOptions(32, 64).bias(false)));
    down = register_module("down", Linear(torch::nn::LinearOptions(64, 16).bias(false)));
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.copy_(at::randn(p.sizes(), gen) * 0.2);
  }
  at::Tensor forward(const at::Tensor& x) { return down(at::relu(up(x))); }
  Linear up{nullptr}, down{nullptr};
};

struct StepResult {
  at::Tensor output, grad_input, grad_up, grad_down;
};

// One forward and backward of sum(output): its gradient is exact ones, so both runs cast the
// same grad_output.
StepResult Step(PairImpl& model) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const at::Tensor x = (at::randn({6, 32}, gen) * 2).requires_grad_();
  const at::Tensor y = model.forward(x);
  y.sum().backward();
  return {y.detach(), x.grad(), model.up->weight.grad(), model.down->weight.grad()};
}

void ExpectWithin(const at::Tensor& ours, const at::Tensor& reference, int64_t terms, double rounding,
                  const std::string& what) {
  // Two summation orders of `terms` float32 products, relative to sum |products| (bounded
  // by 4x the reference's magnitude here: float8 operands within 2^-3 of the float32 ones,
  // inputs of both signs), plus the recipe's intermediate `rounding` - below float8's
  // rounding step (2^-4 relative, e4m3), which a rank-local scale shows.
  const double tol = testing::SummationOrderTolerance(at::kFloat, terms) * 4 + rounding;
  const double scale = reference.abs().max().item<double>();
  EXPECT_LE((ours - reference).abs().max().item<double>(), tol * scale) << what;
}

TEST(Float8TensorParallel, ColwiseThenRowwiseEqualsUnsharded) {
  for (const std::string recipe : {"tensorwise", "rowwise", "rowwise_with_gw_hp"}) {
    SCOPED_TRACE(recipe);
    const Float8LinearConfig config = Float8LinearConfig::FromRecipeName(recipe);
    // The rowwise recipes run float32 matmuls through bfloat16 (torchao's workaround for
    // _scaled_mm), so each rank's partial sum is rounded to bfloat16 before the all-reduce:
    // up to one bfloat16 ulp (2^-8 relative) per partial and one for the sum's rounding in
    // the unsharded run. Tensorwise stays in float32.
    const double rounding = recipe == "tensorwise" ? 0.0 : 3 * std::pow(2.0, -8);
    PairImpl single;
    convert_to_float8_training(single, config);
    const StepResult reference = Step(single);
    fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
      auto mesh = mesh::DeviceMesh::Create(pg, {2});
      PairImpl model;
      convert_to_float8_training(model, config);
      tensor_parallel::parallelize_module(
          model, mesh, {{"up", tensor_parallel::ColwiseParallel()}, {"down", tensor_parallel::RowwiseParallel()}});
      const StepResult ours = Step(model);
      ExpectWithin(ours.output, reference.output, 64, rounding, "output");
      ExpectWithin(ours.grad_input, reference.grad_input, 64, rounding, "grad_input");
      // This rank's rows of up.weight, columns of down.weight: complete sums, and every
      // element of the colwise layer's output is a complete sum over K as in the unsharded
      // run (the same products in the same order), so the operands they come from agree.
      ExpectWithin(ours.grad_up, reference.grad_up.chunk(2, 0)[pg->rank()], 6, rounding, "up.weight.grad");
      ExpectWithin(ours.grad_down, reference.grad_down.chunk(2, 1)[pg->rank()], 6, rounding, "down.weight.grad");
    });
  }
}

// ---------------------------------------------------------------- torchao's float8 styles

using dtensor::Placement;

// Llama's feed-forward: w2(silu(w1(x)) * w3(x)), fed sequence-sharded activations.
struct FeedForwardImpl : torch::nn::Module {
  explicit FeedForwardImpl(c10::ScalarType dtype) {
    w1 = register_module("w1", Linear(torch::nn::LinearOptions(32, 64).bias(false)));
    w3 = register_module("w3", Linear(torch::nn::LinearOptions(32, 64).bias(false)));
    w2 = register_module("w2", Linear(torch::nn::LinearOptions(64, 32).bias(false)));
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.set_data((at::randn(p.sizes(), gen) * 0.2).to(dtype));
  }
  at::Tensor forward(const at::Tensor& x) { return w2(at::silu(w1(x)) * w3(x)); }
  Linear w1{nullptr}, w3{nullptr}, w2{nullptr};
};
using FeedForward = Hooked<FeedForwardImpl>;

struct SpStep {
  at::Tensor output, grad_input;
  std::vector<at::Tensor> grads;
  int64_t all_gather_bytes = 0, all_reduces = 0;
};

// One forward and backward on this rank's sequence slice of a [2, 8, 32] batch, under the
// generic styles or torchao's float8 ones; the loss weights each output element differently,
// so the gradient reaching w2 is not uniform.
SpStep SequenceParallelStep(const comm::ProcessGroupPtr& pg, bool float8_styles, c10::ScalarType dtype) {
  namespace tp = tensor_parallel;
  auto trace = std::make_shared<comm::CommTrace>(pg);
  auto mesh = mesh::DeviceMesh::Create(trace, {pg->size()});
  FeedForward ffn(dtype);
  convert_to_float8_training(*ffn, Float8LinearConfig::FromRecipeName("tensorwise"));
  const Placement seq = Placement::Shard(1), rep = Placement::Replicate();
  tp::ParallelizePlan plan;
  if (float8_styles) {
    plan = {{"", PrepareFloat8ModuleInput({.input_layouts = {seq}, .desired_input_layouts = {rep}})},
            {"w1", Float8ColwiseParallel()},
            {"w3", Float8ColwiseParallel()},
            {"w2", Float8RowwiseParallel({.output_layouts = seq})}};
  } else {
    plan = {{"", tp::PrepareModuleInput({.input_layouts = {seq}, .desired_input_layouts = {rep}})},
            {"w1", tp::ColwiseParallel()},
            {"w3", tp::ColwiseParallel()},
            {"w2", tp::RowwiseParallel({.output_layouts = seq})}};
  }
  tp::parallelize_module(*ffn, mesh, plan);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(17);
  const at::Tensor x_full = at::randn({2, 8, 32}, gen).to(dtype);
  const at::Tensor weights_full = at::rand({2, 8, 32}, gen).to(dtype);
  const int64_t slice = 8 / pg->size();
  const at::Tensor x = x_full.narrow(1, pg->rank() * slice, slice).clone().requires_grad_();
  const at::Tensor y = ffn->forward(x);
  (y * weights_full.narrow(1, pg->rank() * slice, slice)).sum().backward();
  SpStep step{y.detach(), x.grad(), {}, trace->total_output_bytes("all_gather_into_tensor"), 0};
  for (const auto& p : ffn->parameters()) step.grads.push_back(p.grad());
  for (const auto& r : trace->records()) step.all_reduces += r.op == "all_reduce";
  return step;
}

// The float8 styles cast each sharded activation with the whole tensor's scale before its
// all-gather, which gives the bits casting after a high-precision all-gather gives (the
// generic styles over the same float8 linears, checked against the unsharded float8 layers
// above): outputs and gradients equal bit for bit, while the two all-gathers (forward input,
// backward output gradient) carry one byte per element instead of the dtype's.
TEST(Float8TensorParallelStyles, MoveFloat8AndEqualTheGenericStyles) {
  for (const c10::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (const int world : {2, 4}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " world=" + std::to_string(world));
      fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
        const SpStep generic = SequenceParallelStep(pg, false, dtype);
        const SpStep ours = SequenceParallelStep(pg, true, dtype);
        EXPECT_TRUE(at::equal(ours.output, generic.output));
        EXPECT_TRUE(at::equal(ours.grad_input, generic.grad_input));
        ASSERT_EQ(ours.grads.size(), 3u);
        for (size_t i = 0; i < ours.grads.size(); ++i) EXPECT_TRUE(at::equal(ours.grads[i], generic.grads[i])) << i;
        // Each all-gather's output is the whole [2, 8, 32] activation or its gradient.
        const int64_t elements = 2 * 8 * 32;
        EXPECT_EQ(generic.all_gather_bytes, 2 * elements * c10::elementSize(dtype));
        EXPECT_EQ(ours.all_gather_bytes, 2 * elements);
        // Amax all-reduces, as torchao's styles cast: forward: the module input once for w1
        // and w3, the three sharded weights, w2's K-sharded input; backward: each output
        // gradient once (w1, w3 column-sharded; w2's sequence-sharded), shared by its two
        // matmuls, and the three weights for the input gradients. Casting each gradient per
        // matmul again (as without the styles) would add two for w1 and w3.
        EXPECT_EQ(ours.all_reduces, (1 + 3 + 1) + (3 + 3));
      });
    }
  }
}

TEST(Float8TensorParallelStyles, ReprsAreTorchaos) {
  EXPECT_EQ(Float8ColwiseParallel()->ToString(),
            "Float8ColwiseParallel(input_layouts=(Replicate(),), output_layouts=(Shard(dim=-1),), "
            "use_local_output=True)");
  EXPECT_EQ(Float8RowwiseParallel({.output_layouts = Placement::Shard(1)})->ToString(),
            "Float8RowwiseParallel(input_layouts=(Shard(dim=-1),), output_layouts=(Shard(dim=1),), "
            "use_local_output=True)");
  EXPECT_EQ(PrepareFloat8ModuleInput(
                {.input_layouts = {Placement::Shard(1)}, .desired_input_layouts = {Placement::Replicate()}})
                ->ToString(),
            "PrepareFloat8ModuleInput(input_layouts=(Shard(dim=1),), desired_input_layouts=(Replicate(),), "
            "input_kwarg_layouts={}, desired_input_kwarg_layouts={}, use_local_output=False)");
}

TEST(Float8TensorParallelStyles, Errors) {
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    namespace tp = tensor_parallel;
    auto mesh = mesh::DeviceMesh::Create(pg, {2});
    {
      FeedForward plain(at::kFloat);  // not converted
      EXPECT_ERROR_CONTAINS(tp::parallelize_module(*plain, mesh, {{"w1", Float8ColwiseParallel()}}),
                            "Float8ColwiseParallel: expecting module 'w1' to be a float8 linear");
      EXPECT_ERROR_CONTAINS(
          tp::parallelize_module(*plain, mesh,
                                 {{"", PrepareFloat8ModuleInput({.input_layouts = {Placement::Shard(1)},
                                                                 .desired_input_layouts = {Placement::Replicate()}})}}),
          "has no float8 linear below it");
    }
    FeedForward rowwise(at::kFloat);
    convert_to_float8_training(*rowwise, Float8LinearConfig::FromRecipeName("rowwise"));
    EXPECT_ERROR_CONTAINS(tp::parallelize_module(*rowwise, mesh, {{"w2", Float8RowwiseParallel()}}),
                          "Float8RowwiseParallel: module 'w2' casts its input");
    FeedForward ffn(at::kFloat);
    convert_to_float8_training(*ffn, Float8LinearConfig::FromRecipeName("tensorwise"));
    EXPECT_ERROR_CONTAINS(
        tp::parallelize_module(*ffn, mesh,
                               {{"", PrepareFloat8ModuleInput({.input_layouts = {Placement::Shard(1)},
                                                               .desired_input_layouts = {Placement::Replicate()},
                                                               .fwd_config_submodule_fqn = "w4"})}}),
        "fwd_config_submodule_fqn 'w4' is not a float8 linear below it");
    EXPECT_ERROR_CONTAINS(PrepareFloat8ModuleInput({.float8_dtype = at::kFloat8_e5m2}),
                          "float8_dtype Float8_e5m2 is not supported");
    auto custom = std::make_shared<const tp::StyleRedistribution>();
    EXPECT_ERROR_CONTAINS(Float8ColwiseParallel({.redistribution = custom}), "options.redistribution must be null");
    // A Partial input has no value to cast.
    tp::parallelize_module(*ffn, mesh,
                           {{"", PrepareFloat8ModuleInput({.input_layouts = {Placement::Partial()},
                                                           .desired_input_layouts = {Placement::Replicate()}})}});
    EXPECT_ERROR_CONTAINS(ffn->forward(at::ones({2, 8, 32})), "cannot cast a Partial tensor");
  });
}

}  // namespace
}  // namespace fsdp::float8
