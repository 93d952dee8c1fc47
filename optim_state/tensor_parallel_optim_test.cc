// Full optimizer-state dicts of a tensor-parallel model no fully_shard manages: each state
// tensor is gathered to its parameter's global shape (equal to one rank's training of the
// plain model), and a full dict saved at tp 2 loads at tp 4 into each rank's shards.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <memory>
#include <mutex>
#include <string>

#include "fsdp/hooked_module/hooked_module.h"
#include "mesh/device_mesh.h"
#include "optim_state/fsdp2_optim_state.h"
#include "optim_state/optim_state_dict.h"
#include "tensor_parallel/parallel_style.h"
#include "tensor_parallel/parallelize_module.h"
#include "testing/multi_rank.h"

namespace fsdp::optim_state {
namespace {

using HookedLinear = Hooked<torch::nn::LinearImpl>;

struct TwoLayerImpl : torch::nn::Module {
  TwoLayerImpl() : a(register_module("a", HookedLinear(8, 12))), b(register_module("b", HookedLinear(12, 8))) {
    at::NoGradGuard no_grad;
    int k = 0;
    for (auto& p : parameters()) p.copy_(at::sin(at::arange(p.numel(), at::kFloat) * 0.7 + (++k)).view(p.sizes()));
  }
  at::Tensor forward(const at::Tensor& x) { return b(at::relu(a(x))); }
  HookedLinear a, b;
};
using TwoLayer = Hooked<TwoLayerImpl>;

constexpr int kSteps = 3;

// kSteps AdamW steps on the same batch; with `tp_mesh` the Megatron pair a colwise, b rowwise.
std::unique_ptr<torch::optim::AdamW> Train(TwoLayer& model, const mesh::DeviceMeshPtr& tp_mesh) {
  if (tp_mesh) {
    tensor_parallel::parallelize_module(
        *model, tp_mesh, {{"a", tensor_parallel::ColwiseParallel()}, {"b", tensor_parallel::RowwiseParallel()}});
  }
  auto opt = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2));
  const at::Tensor x = at::cos(at::arange(5 * 8, at::kFloat)).view({5, 8});
  for (int step = 0; step < kSteps; ++step) {
    opt->zero_grad();
    model(x).pow(2).sum().backward();  // the output is replicated: every rank the same loss
    opt->step();
  }
  return opt;
}

TEST(Fsdp2OptimState, TensorParallelOnlyStateIsFullAndReshards) {
  TwoLayer ref;
  auto ref_opt = Train(ref, nullptr);
  NamedParams ref_named;
  for (const auto& item : ref->named_parameters()) ref_named.emplace_back(item.key(), item.value());
  const OptimStateDict expected = GetOptimStateDict(*ref_opt, ref_named);
  OptimStateDict saved;
  std::mutex mu;
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    TwoLayer model;
    auto opt = Train(model, mesh::DeviceMesh::Create(pg, {2}));
    const OptimStateDict full = GetFullOptimStateDict(*model, *opt);
    ASSERT_EQ(full.state.size(), expected.state.size());
    for (const auto& [fqn, values] : expected.state) {
      for (const auto& [name, value] : values) {
        const auto* want = std::get_if<at::Tensor>(&value);
        if (want == nullptr || want->dim() == 0) continue;
        const at::Tensor& got = std::get<at::Tensor>(full.state.at(fqn).at(name));
        ASSERT_EQ(got.sizes(), want->sizes()) << fqn << " " << name;
        // The rowwise layer's contraction is split in two partial sums: float32 rounding of
        // sums of 12 terms (eps 1.2e-7 x 12 x the magnitudes, through kSteps moment updates)
        // stays below 1e-5 relative; a wrong layout or a missed gather is off by O(1).
        const double scale = std::max(1.0, want->abs().max().item<double>());
        EXPECT_LE((got - *want).abs().max().item<double>(), 1e-5 * scale) << fqn << " " << name;
      }
    }
    if (pg->rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      saved = full;
    }
  });
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
    TwoLayer model;
    auto mesh = mesh::DeviceMesh::Create(pg, {4});
    tensor_parallel::parallelize_module(
        *model, mesh, {{"a", tensor_parallel::ColwiseParallel()}, {"b", tensor_parallel::RowwiseParallel()}});
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
    LoadFullOptimStateDict(*model, opt, saved);
    // This rank's shard of a.weight's moments: rows 3r .. 3r+2 of the full [12, 8].
    const OptimStateDict local = GetShardedOptimStateDict(*model, opt);
    const at::Tensor& shard = std::get<at::Tensor>(local.state.at("a.weight").at("exp_avg"));
    const at::Tensor& whole = std::get<at::Tensor>(saved.state.at("a.weight").at("exp_avg"));
    EXPECT_TRUE(at::equal(shard, whole.narrow(0, 3 * pg->rank(), 3)));
    // b.weight is Shard(1): columns 3r .. 3r+2 of [8, 12].
    const at::Tensor& cols = std::get<at::Tensor>(local.state.at("b.weight").at("exp_avg_sq"));
    EXPECT_TRUE(at::equal(
        cols, std::get<at::Tensor>(saved.state.at("b.weight").at("exp_avg_sq")).narrow(1, 3 * pg->rank(), 3)));
    const OptimStateDict again = GetFullOptimStateDict(*model, opt);
    for (const auto& [fqn, values] : saved.state) {
      for (const auto& [name, value] : values) {
        if (const auto* t = std::get_if<at::Tensor>(&value)) {
          EXPECT_TRUE(at::equal(*t, std::get<at::Tensor>(again.state.at(fqn).at(name)))) << fqn << " " << name;
        }
      }
    }
  });
}

}  // namespace
}  // namespace fsdp::optim_state
