#include "train.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <stdexcept>
#include <thread>

#include "comm/process_group.h"
#include "comm/reduce_op.h"
#include "comm/threaded_process_group.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "mesh/device_mesh.h"

namespace consumer {
namespace {

using fsdp::Hooked;

constexpr int64_t kIn = 6, kDim = 10, kHidden = 24, kOut = 3, kBlocks = 3;

// Pre-norm residual MLP block. tanh rather than ReLU: no dead units, whose near-zero
// gradients AdamW would turn into full-size steps on float rounding noise.
struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        fc1(register_module("fc1", torch::nn::Linear(kDim, kHidden))),
        fc2(register_module("fc2", torch::nn::Linear(kHidden, kDim))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2(at::tanh(fc1(ln(x)))); }
  torch::nn::LayerNorm ln;
  torch::nn::Linear fc1, fc2;
};

// Hooked<Impl> is Impl whose forward runs FSDP's hooks once fully_shard attached them;
// without fully_shard it is the plain module (the single-rank reference uses it so).
struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : in(register_module("in", torch::nn::Linear(kIn, kDim))),
        head(register_module("head", torch::nn::Linear(kDim, kOut))) {
    for (int64_t i = 0; i < kBlocks; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), Hooked<BlockImpl>()));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = in(x);
    for (auto& block : blocks) h = block(h);
    return head(h);
  }
  torch::nn::Linear in, head;
  std::vector<Hooked<BlockImpl>> blocks;
};
using Mlp = Hooked<MlpImpl>;

// Same values on every rank and in the reference: one generator per parameter.
void InitDeterministic(torch::nn::Module& model) {
  at::NoGradGuard no_grad;
  uint64_t seed = 7;
  for (auto& p : model.parameters()) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed++);
    p.copy_(at::randn(p.sizes(), gen) * (0.5 / std::sqrt(double(p.size(-1)))));
  }
}

// Regression onto a fixed smooth function of the input.
std::pair<at::Tensor, at::Tensor> Batch(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  at::Tensor x = at::randn({kGlobalBatch, kIn}, gen);
  auto target_gen = at::make_generator<at::CPUGeneratorImpl>(99);
  at::Tensor w = at::randn({kIn, kOut}, target_gen);
  return {x, at::sin(at::matmul(x, w))};
}

torch::optim::AdamWOptions Options(const TrainConfig& config) {
  return torch::optim::AdamWOptions(config.lr).weight_decay(0.01);
}

int64_t Numel(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) n += t.numel();
  return n;
}

}  // namespace

TrainResult TrainFsdp2Rank(const TrainConfig& config, const fsdp::comm::ProcessGroupPtr& group) {
  const int world = config.world;
  if (world < 1 || kGlobalBatch % world != 0) {
    throw std::invalid_argument("world must divide the global batch of " + std::to_string(kGlobalBatch));
  }
  if (group->size() != world) {
    throw std::invalid_argument("the process group has " + std::to_string(group->size()) + " ranks, the config " +
                                std::to_string(world));
  }
  at::set_num_threads(1);  // the ranks share the machine's cores; the reference runs on one thread
  const int r = group->rank();
  auto mesh = fsdp::mesh::DeviceMesh::Create(group, {world});
  Mlp model;
  InitDeterministic(*model);
  TrainResult result;
  result.full_numel = Numel(model->parameters());
  for (const auto& p : model->parameters()) {
    result.max_chunk_numel += (p.size(0) + world - 1) / world * (p.numel() / p.size(0));
  }
  for (auto& block : model->blocks) fsdp::fsdp2::fully_shard(block.ptr(), {.mesh = mesh});
  fsdp::fsdp2::fully_shard(model.ptr(), {.mesh = mesh});
  // Built after fully_shard: the optimizer sees (and keeps state for) the shards only.
  torch::optim::AdamW opt(model->parameters(), Options(config));
  result.local_numel = {Numel(model->parameters())};
  const int64_t local = kGlobalBatch / world;
  for (int step = 0; step < config.steps; ++step) {
    auto [x, y] = Batch(step);
    at::Tensor loss =
        torch::nn::functional::mse_loss(model(x.narrow(0, r * local, local)), y.narrow(0, r * local, local));
    loss.backward();  // FSDP reduce-scatters (averages) the gradients into the shards
    opt.step();
    opt.zero_grad();
    at::Tensor global = loss.detach().clone();
    group->all_reduce(global, fsdp::comm::ReduceOp::Avg())->wait();
    result.losses.push_back(global.item<double>());
  }
  // Collective: every rank takes part in the all-gathers and gets the full parameters.
  const fsdp::fsdp2::FullStateDict full = fsdp::fsdp2::GetFullStateDict(*model);
  for (const auto& item : full) result.params[item.key()] = item.value().clone();
  return result;
}

TrainResult TrainFsdp2(const TrainConfig& config) {
  const int world = config.world;
  if (world < 1 || kGlobalBatch % world != 0) {
    throw std::invalid_argument("world must divide the global batch of " + std::to_string(kGlobalBatch));
  }
  at::set_num_threads(1);  // the ranks are threads sharing the machine's cores
  std::vector<fsdp::comm::ProcessGroupPtr> groups = fsdp::comm::CreateThreadedProcessGroups(world);
  std::vector<TrainResult> ranks(world);
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        ranks[r] = TrainFsdp2Rank(config, groups[r]);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        // The other ranks' pending and later collectives fail at once instead of timing out.
        fsdp::comm::AbortThreadedWorld(*groups[r], "rank " + std::to_string(r) + " failed: " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  std::string failed;
  for (int r = 0; r < world; ++r) {
    if (!errors[r].empty()) failed += "rank " + std::to_string(r) + ": " + errors[r] + "\n";
  }
  if (!failed.empty()) throw std::runtime_error("FSDP2 training failed:\n" + failed);
  std::vector<int64_t> local_numel;
  for (const TrainResult& rank : ranks) local_numel.push_back(rank.local_numel.front());
  TrainResult result = std::move(ranks[0]);
  result.local_numel = std::move(local_numel);
  return result;
}

TrainResult TrainSingleRank(const TrainConfig& config) {
  at::set_num_threads(1);
  TrainResult result;
  Mlp model;
  InitDeterministic(*model);
  torch::optim::AdamW opt(model->parameters(), Options(config));
  result.full_numel = Numel(model->parameters());
  result.local_numel = {result.full_numel};
  result.max_chunk_numel = result.full_numel;
  for (int step = 0; step < config.steps; ++step) {
    auto [x, y] = Batch(step);
    at::Tensor loss = torch::nn::functional::mse_loss(model(x), y);
    loss.backward();
    opt.step();
    opt.zero_grad();
    result.losses.push_back(loss.item<double>());
  }
  for (const auto& item : model->named_parameters()) result.params[item.key()] = item.value().detach().clone();
  return result;
}

Comparison Compare(const TrainResult& fsdp, const TrainResult& reference) {
  Comparison c;
  if (fsdp.losses.size() != reference.losses.size()) c.problems.push_back("different number of steps");
  for (size_t i = 0; i < std::min(fsdp.losses.size(), reference.losses.size()); ++i) {
    const double expected = reference.losses[i];
    c.max_loss_diff =
        std::max(c.max_loss_diff, std::abs(fsdp.losses[i] - expected) / std::max(1.0, std::abs(expected)));
  }
  for (const auto& [name, ref] : reference.params) {
    auto it = fsdp.params.find(name);
    if (it == fsdp.params.end()) {
      c.problems.push_back("missing from FSDP: " + name);
      continue;
    }
    if (!it->second.sizes().equals(ref.sizes())) {
      c.problems.push_back("shape differs: " + name);
      continue;
    }
    const double scale = std::max(1.0, ref.abs().max().item<double>());
    c.max_param_diff = std::max(c.max_param_diff, (it->second - ref).abs().max().item<double>() / scale);
  }
  for (const auto& [name, value] : fsdp.params) {
    if (!reference.params.count(name)) c.problems.push_back("unexpected in FSDP: " + name);
  }
  return c;
}

double ParityTolerance(const TrainConfig& config) { return config.steps * config.lr * std::ldexp(1.0, -10); }

}  // namespace consumer
