// ColwiseParallel / RowwiseParallel on Linears: a colwise -> relu -> rowwise MLP must equal
// the unsharded MLP in output, input gradient and every parameter gradient (each rank's local
// gradient is its torch.chunk of the full one), on real multi-rank backends with even, uneven
// and empty shards; the layouts the styles publish (distributed_parameters/distributed_parameters.h).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "distributed_parameters/distributed_parameters.h"
#include "dtensor/placement.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "mesh/device_mesh.h"
#include "tensor_parallel/parallel_style.h"
#include "tensor_parallel/parallelize_module.h"
#include "testing/multi_rank.h"

namespace fsdp::tensor_parallel {
namespace {

using ::fsdp::distributed_parameters::DistributedParameterModule;
using ::fsdp::distributed_parameters::FindDistributedParameters;
using ::fsdp::dtensor::Placement;
using ::fsdp::dtensor::Placements;
using fsdp::testing::Backend;
using Linear = ::fsdp::Hooked<torch::nn::LinearImpl>;

// Piece `index` of `pieces` along `dim` by torch.chunk's rule, computed here from scratch
// (ceil-sized pieces, trailing ones short or empty) so the test does not trust ChunkOf.
at::Tensor ExpectedChunk(const at::Tensor& t, int64_t pieces, int64_t index, int64_t dim) {
  const int64_t n = t.size(dim);
  const int64_t step = (n + pieces - 1) / pieces;
  const int64_t start = std::min(n, index * step);
  return t.narrow(dim, start, std::min(step, n - start));
}

// Deterministic per rank without the global generator (threads would race on it).
at::Tensor Randn(at::IntArrayRef shape, at::Generator& gen) {
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat));
}

torch::nn::Linear MakeLinear(int64_t in, int64_t out, at::Generator& gen, bool bias = true) {
  torch::nn::Linear linear(torch::nn::LinearOptions(in, out).bias(bias));
  at::NoGradGuard no_grad;
  linear->weight.copy_(Randn({out, in}, gen));
  if (bias) linear->bias.copy_(Randn({out}, gen));
  return linear;
}

// A hooked copy of `plain` (same values and requires_grad), parallelized in place by `style`.
Linear Parallelize(const torch::nn::Linear& plain, const mesh::DeviceMeshPtr& mesh, const ParallelStylePtr& style) {
  Linear linear(plain->options);
  {
    at::NoGradGuard no_grad;
    linear->weight.copy_(plain->weight);
    if (plain->bias.defined()) linear->bias.copy_(plain->bias);
  }
  for (const auto& p : plain->named_parameters())
    linear->named_parameters()[p.key()].requires_grad_(p.value().requires_grad());
  parallelize_module(*linear, mesh, style);
  return linear;
}

void ExpectClose(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what << " is undefined";
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  // Sharded matmuls sum their inner products in another order than the full one (partial sums, then
  // an all-reduce): a few float32 ulps (2^-23) per term; 1e-5 (~80 ulps) of small, order-1 values.
  EXPECT_TRUE(at::allclose(actual, expected, 1e-5, 1e-5))
      << what << ": max abs diff " << (actual - expected).abs().max().item<float>();
}

struct MlpShape {
  int world;
  int64_t in, hidden, out;
};

std::string ShapeName(const MlpShape& s) {
  return "w" + std::to_string(s.world) + "_" + std::to_string(s.in) + "x" + std::to_string(s.hidden) + "x" +
         std::to_string(s.out);
}

// Readable test parameters in gtest's failure lines.
void PrintTo(const MlpShape& s, std::ostream* os) { *os << ShapeName(s); }

// Colwise(in -> hidden) -> relu -> rowwise(hidden -> out) vs the same MLP unsharded.
void CheckMlpParity(const comm::ProcessGroupPtr& group, const MlpShape& s) {
  const int64_t tp = group->size();
  auto mesh = mesh::DeviceMesh::Create(group, {tp}, {"tp"});
  const int64_t me = mesh->coordinate()[0];
  at::Generator gen = at::detail::createCPUGenerator(1234);
  torch::nn::Linear fc1 = MakeLinear(s.in, s.hidden, gen);
  torch::nn::Linear fc2 = MakeLinear(s.hidden, s.out, gen);
  const at::Tensor data = Randn({2, 3, s.in}, gen);  // [*, in]: a batch of 2-D inputs
  const at::Tensor target = Randn({2, 3, s.out}, gen);

  Linear tp1 = Parallelize(fc1, mesh, ColwiseParallel());
  Linear tp2 = Parallelize(fc2, mesh, RowwiseParallel());

  // The input requires grad so the colwise backward all-reduce is exercised too.
  at::Tensor x_ref = data.clone().requires_grad_(true);
  at::Tensor y_ref = fc2->forward(at::relu(fc1->forward(x_ref)));
  ((y_ref - target).pow(2).sum()).backward();

  at::Tensor x = data.clone().requires_grad_(true);
  at::Tensor h = tp1(x);
  ASSERT_EQ(h.size(-1), ExpectedChunk(fc1->weight, tp, me, 0).size(0));
  at::Tensor y = tp2(at::relu(h));
  ExpectClose(y, y_ref.detach(), "output");
  ((y - target).pow(2).sum()).backward();

  ExpectClose(x.grad(), x_ref.grad(), "input grad");
  ExpectClose(tp1->weight.grad(), ExpectedChunk(fc1->weight.grad(), tp, me, 0), "fc1.weight grad");
  ExpectClose(tp1->bias.grad(), ExpectedChunk(fc1->bias.grad(), tp, me, 0), "fc1.bias grad");
  ExpectClose(tp2->weight.grad(), ExpectedChunk(fc2->weight.grad(), tp, me, 1), "fc2.weight grad");
  ExpectClose(tp2->bias.grad(), fc2->bias.grad(), "fc2.bias grad");
  // The parameters themselves are the chunks, owning only their own bytes.
  ExpectClose(tp1->weight, ExpectedChunk(fc1->weight, tp, me, 0).detach(), "fc1.weight");
  ExpectClose(tp2->weight, ExpectedChunk(fc2->weight, tp, me, 1).detach(), "fc2.weight");
  EXPECT_EQ(tp1->weight.storage().nbytes(), tp1->weight.nbytes());
  EXPECT_TRUE(tp1->weight.is_leaf());

  // Without grad mode the same forward communicates the same way and gives the same output.
  at::NoGradGuard no_grad;
  ExpectClose(tp2(at::relu(tp1(data))), y_ref.detach(), "no-grad output");
}

class TensorParallelMlpTest : public ::testing::TestWithParam<std::tuple<Backend, MlpShape>> {};

TEST_P(TensorParallelMlpTest, MatchesUnshardedOutputAndGradients) {
  const Backend backend = std::get<0>(GetParam());
  const MlpShape shape = std::get<1>(GetParam());
  fsdp::testing::RunOnRanks(backend, shape.world,
                            [&](const comm::ProcessGroupPtr& group) { CheckMlpParity(group, shape); });
}

INSTANTIATE_TEST_SUITE_P(Backends, TensorParallelMlpTest,
                         ::testing::Combine(::testing::Values(Backend::kThreaded, Backend::kGlooThreads),
                                            ::testing::Values(MlpShape{2, 6, 8, 5},    // even
                                                              MlpShape{3, 6, 7, 5},    // uneven: 3, 3, 1
                                                              MlpShape{3, 4, 2, 3},    // rank 2 holds nothing
                                                              MlpShape{1, 4, 3, 2})),  // degenerate tp=1
                         [](const auto& info) {
                           return fsdp::testing::BackendName(std::get<0>(info.param)) + "_" +
                                  ShapeName(std::get<1>(info.param));
                         });

TEST(LinearStyles, PublishTheParameterLayoutsUnderTheLinearsNames) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [](const comm::ProcessGroupPtr& group) {
    auto mesh = mesh::DeviceMesh::Create(group, {3}, {"tp"});
    at::Generator gen = at::detail::createCPUGenerator(7);
    torch::nn::Linear fc = MakeLinear(5, 7, gen);
    fc->bias.requires_grad_(false);
    Linear col = Parallelize(fc, mesh, ColwiseParallel());
    Linear row = Parallelize(fc, mesh, RowwiseParallel());

    // Same FQNs as the Linear, so state-dict keys and optimizer groups carry over.
    EXPECT_EQ(col->named_parameters().keys(), fc->named_parameters().keys());
    EXPECT_TRUE(col->weight.requires_grad());
    EXPECT_FALSE(col->bias.requires_grad());

    // Through the interface FSDP, DCP and the optimizer-state conversions use.
    const std::vector<std::pair<Linear*, std::vector<Placements>>> cases = {
        {&col, {{Placement::Shard(0)}, {Placement::Shard(0)}}},
        {&row, {{Placement::Shard(1)}, {Placement::Replicate()}}}};
    for (const auto& [m, placements] : cases) {
      const DistributedParameterModule* dist = FindDistributedParameters(**m);
      ASSERT_NE(dist, nullptr);
      const auto specs = dist->named_parameter_specs();
      ASSERT_EQ(specs.size(), 2u);
      EXPECT_EQ(specs[0].first, "weight");
      EXPECT_EQ(specs[1].first, "bias");
      EXPECT_EQ(specs[0].second.placements, placements[0]);
      EXPECT_EQ(specs[1].second.placements, placements[1]);
      EXPECT_EQ(specs[0].second.shape, (std::vector<int64_t>{7, 5}));
      EXPECT_EQ(specs[1].second.shape, (std::vector<int64_t>{7}));
      EXPECT_EQ(specs[0].second.local_shape(), (*m)->weight.sizes().vec());
      EXPECT_EQ(specs[1].second.local_shape(), (*m)->bias.sizes().vec());
    }
    EXPECT_EQ(row->weight.size(1), ExpectedChunk(fc->weight, 3, group->rank(), 1).size(1));
    // A plain module publishes nothing.
    EXPECT_EQ(FindDistributedParameters(*fc), nullptr);
  });
}

TEST(LinearStyles, WithoutBias) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& group) {
    auto mesh = mesh::DeviceMesh::Create(group, {2});
    at::Generator gen = at::detail::createCPUGenerator(3);
    torch::nn::Linear fc1 = MakeLinear(4, 6, gen, /*bias=*/false);
    torch::nn::Linear fc2 = MakeLinear(6, 3, gen, /*bias=*/false);
    const at::Tensor x = Randn({5, 4}, gen);
    Linear tp1 = Parallelize(fc1, mesh, ColwiseParallel());
    Linear tp2 = Parallelize(fc2, mesh, RowwiseParallel());
    EXPECT_EQ(FindDistributedParameters(*tp1)->named_parameter_specs().size(), 1u);
    EXPECT_EQ(tp2->named_parameters().size(), 1u);
    ExpectClose(tp2(tp1(x)), fc2->forward(fc1->forward(x)).detach(), "output");
  });
}

}  // namespace
}  // namespace fsdp::tensor_parallel
