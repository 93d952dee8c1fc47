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

#include "float8/float8_linear.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "mesh/device_mesh.h"
#include "tensor_parallel/parallel_style.h"
#include "tensor_parallel/parallelize_module.h"
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

}  // namespace
}  // namespace fsdp::float8
