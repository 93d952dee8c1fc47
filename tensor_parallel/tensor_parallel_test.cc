// Tensor-parallel Linear: a colwise -> relu -> rowwise MLP must equal the unsharded MLP in
// output, input gradient and every parameter gradient (each rank's local gradient is its
// torch.chunk of the full one), on real multi-rank backends with even, uneven and empty
// shards.
#include "tensor_parallel/tensor_parallel.h"

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

#include "dtensor/placement.h"
#include "mesh/device_mesh.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::dtensor {
namespace {

using fsdp::testing::Backend;

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

  TensorParallelLinear tp1 = ParallelizeLinear(fc1, mesh, TensorParallelStyle::kColwise);
  TensorParallelLinear tp2 = ParallelizeLinear(fc2, mesh, TensorParallelStyle::kRowwise);

  // The input requires grad so the colwise backward all-reduce is exercised too.
  at::Tensor x_ref = data.clone().requires_grad_(true);
  at::Tensor y_ref = fc2->forward(at::relu(fc1->forward(x_ref)));
  ((y_ref - target).pow(2).sum()).backward();

  at::Tensor x = data.clone().requires_grad_(true);
  at::Tensor h = tp1->forward(x);
  ASSERT_EQ(h.size(-1), ExpectedChunk(fc1->weight, tp, me, 0).size(0));
  at::Tensor y = tp2->forward(at::relu(h));
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
  ExpectClose(tp2->forward(at::relu(tp1->forward(data))), y_ref.detach(), "no-grad output");
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

TEST(TensorParallelLinearTest, ParameterSpecsNamesAndRequiresGrad) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [](const comm::ProcessGroupPtr& group) {
    auto mesh = mesh::DeviceMesh::Create(group, {3}, {"tp"});
    at::Generator gen = at::detail::createCPUGenerator(7);
    torch::nn::Linear fc = MakeLinear(5, 7, gen);
    fc->bias.requires_grad_(false);
    TensorParallelLinear col = ParallelizeLinear(fc, mesh, TensorParallelStyle::kColwise);
    TensorParallelLinear row = ParallelizeLinear(fc, mesh, TensorParallelStyle::kRowwise);

    // Same FQNs as the Linear, so state-dict keys and optimizer groups carry over.
    EXPECT_EQ(col->named_parameters().keys(), fc->named_parameters().keys());
    EXPECT_TRUE(col->weight.requires_grad());
    EXPECT_FALSE(col->bias.requires_grad());

    EXPECT_EQ(col->parameter_spec("weight").placements, Placements{Placement::Shard(0)});
    EXPECT_EQ(col->parameter_spec("bias").placements, Placements{Placement::Shard(0)});
    EXPECT_EQ(row->parameter_spec("weight").placements, Placements{Placement::Shard(1)});
    EXPECT_EQ(row->parameter_spec("bias").placements, Placements{Placement::Replicate()});
    for (TensorParallelLinear* m : {&col, &row}) {
      // Through the interface FSDP uses: global shapes and this rank's local shapes.
      const std::shared_ptr<torch::nn::Module> base = m->ptr();
      auto* dist = dynamic_cast<DistributedParameterModule*>(base.get());
      ASSERT_NE(dist, nullptr);
      const auto specs = dist->named_parameter_specs();
      ASSERT_EQ(specs.size(), 2u);
      EXPECT_EQ(specs[0].first, "weight");
      EXPECT_EQ(specs[0].second.shape, (std::vector<int64_t>{7, 5}));
      EXPECT_EQ(specs[1].second.shape, (std::vector<int64_t>{7}));
      EXPECT_EQ(specs[0].second.local_shape(), (*m)->weight.sizes().vec());
      EXPECT_EQ(specs[1].second.local_shape(), (*m)->bias.sizes().vec());
    }
    EXPECT_EQ(row->local_in_features(), ExpectedChunk(fc->weight, 3, group->rank(), 1).size(1));
    EXPECT_ERROR_CONTAINS(col->parameter_spec("scale"), "no distributed parameter named 'scale'");
  });
}

TEST(TensorParallelLinearTest, WithoutBias) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& group) {
    auto mesh = mesh::DeviceMesh::Create(group, {2});
    at::Generator gen = at::detail::createCPUGenerator(3);
    torch::nn::Linear fc1 = MakeLinear(4, 6, gen, /*bias=*/false);
    torch::nn::Linear fc2 = MakeLinear(6, 3, gen, /*bias=*/false);
    const at::Tensor x = Randn({5, 4}, gen);
    auto tp1 = ParallelizeLinear(fc1, mesh, TensorParallelStyle::kColwise);
    auto tp2 = ParallelizeLinear(fc2, mesh, TensorParallelStyle::kRowwise);
    EXPECT_EQ(tp1->named_parameter_specs().size(), 1u);
    EXPECT_EQ(tp2->named_parameters().size(), 1u);
    ExpectClose(tp2->forward(tp1->forward(x)), fc2->forward(fc1->forward(x)).detach(), "output");
  });
}

TEST(TensorParallelLinearTest, Errors) {
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& group) {
    auto mesh = mesh::DeviceMesh::Create(group, {2}, {"tp"});
    at::Generator gen = at::detail::createCPUGenerator(5);
    torch::nn::Linear fc = MakeLinear(6, 5, gen);
    auto col = ParallelizeLinear(fc, mesh, TensorParallelStyle::kColwise);
    auto row = ParallelizeLinear(fc, mesh, TensorParallelStyle::kRowwise);

    EXPECT_ERROR_CONTAINS(col->forward(at::ones({2, 5})), "input's last dimension is 5 but expected 6 (in_features");
    // Rowwise takes this rank's 3 of the 6 input columns, not all of them.
    EXPECT_ERROR_CONTAINS(row->forward(at::ones({2, 6})),
                          "input's last dimension is 6 but expected 3 (this rank's Shard(-1) chunk "
                          "of in_features=6)");
    EXPECT_ERROR_CONTAINS(col->forward(at::ones({})), "at least 1 dimension");

    auto mesh_2d = mesh::DeviceMesh::Create(group, {2, 1}, {"dp", "tp"});
    EXPECT_ERROR_CONTAINS(ParallelizeLinear(fc, mesh_2d, TensorParallelStyle::kColwise),
                          "tp_mesh must be 1-D, got DeviceMesh((dp=2, tp=1)");
    EXPECT_ERROR_CONTAINS(ParallelizeLinear(fc, nullptr, TensorParallelStyle::kRowwise), "tp_mesh is null");
    // The 1-D slice of the same mesh is accepted.
    EXPECT_EQ(ParallelizeLinear(fc, (*mesh_2d)["dp"], TensorParallelStyle::kRowwise)->local_in_features(), 3);
  });
}

}  // namespace
}  // namespace fsdp::dtensor
