// FSDP2 parity: N AdamW steps with fully_shard on W ranks equal N steps of the same model on
// one rank (the reference runs on every rank without FSDP, on the whole batch).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "absl/strings/str_cat.h"
#include "comm/comm_trace.h"
#include "fsdp/per_param/fully_shard.h"
#include "testing/expect_error.h"
#include "testing/multi_rank.h"

namespace fsdp::per_param {
namespace {

using fsdp::testing::Backend;

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t hidden)
      : fc1(register_module("fc1", torch::nn::Linear(d, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, d))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2(torch::nn::functional::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
using Block = FullySharded<BlockImpl>;

struct Config {
  std::string name;
  std::variant<bool, int64_t> reshard_after_forward = true;
  bool hsdp = false;
  int micro_batches = 1;       // > 1: accumulate without sync, then sync on the last
  bool freeze_first_fc1 = false;
  bool use_block_twice = false;
  bool explicit_prefetch = false;
  bool offload = false;
  bool bf16 = false;
};

// 3 -> 5 (uneven rows on most world sizes), blocks of 5 -> 7 -> 5, head 5 -> 1 (a parameter
// smaller than the world), a 6-element bias.
struct NetImpl : torch::nn::Module {
  NetImpl(int64_t blocks, bool use_block_twice)
      : in(register_module("in", torch::nn::Linear(3, 5))),
        head(register_module("head", torch::nn::Linear(5, 1))),
        twice(use_block_twice) {
    for (int64_t i = 0; i < blocks; ++i) layers.push_back(register_module(absl::StrCat("block", i), Block(5, 7)));
    extra = register_parameter("extra", at::zeros({6}));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = in(x);
    for (auto& b : layers) h = b(h);
    if (twice) h = layers.front()(h);
    return head(h) + extra.sum();
  }
  torch::nn::Linear in, head;
  std::vector<Block> layers;
  at::Tensor extra;
  bool twice;
};
using Net = FullySharded<NetImpl>;

// Same values on every rank without the (thread-shared) global generator.
void InitDeterministic(torch::nn::Module& m) {
  at::NoGradGuard no_grad;
  uint64_t seed = 11;
  for (auto& p : m.parameters()) {
    p.copy_(at::randn(p.sizes(), at::make_generator<at::CPUGeneratorImpl>(seed++)) * 0.4);
  }
}

at::Tensor Batch(int step, int64_t rows, int64_t cols, uint64_t salt) {
  return at::randn({rows, cols}, at::make_generator<at::CPUGeneratorImpl>(1000 * step + salt));
}

constexpr int kSteps = 4;
constexpr int64_t kBatch = 12;  // divisible by 1..4

void RunParity(const Config& cfg, const comm::ProcessGroupPtr& world) {
  const int w = world->size(), me = world->rank();
  Net ref(2, cfg.use_block_twice), model(2, cfg.use_block_twice);
  InitDeterministic(*ref);
  InitDeterministic(*model);
  if (cfg.freeze_first_fc1) {
    for (auto* m : {&ref, &model}) {
      (*m)->layers[0]->fc1->weight.set_requires_grad(false);
      (*m)->layers[0]->fc1->bias.set_requires_grad(false);
    }
  }
  mesh::DeviceMeshPtr mesh = cfg.hsdp ? mesh::DeviceMesh::Create(world, {2, w / 2}, {"replicate", "shard"})
                                      : mesh::DeviceMesh::Create(world, {w});
  FullyShardOptions opts;
  opts.mesh = mesh;
  opts.reshard_after_forward = cfg.reshard_after_forward;
  opts.offload_policy.offload_to_cpu = cfg.offload;
  if (cfg.bf16) opts.mp_policy.param_dtype = at::kBFloat16;
  std::vector<FSDPModule> blocks;
  for (auto& b : model->layers) blocks.push_back(fully_shard(b.ptr(), opts));
  FSDPModule root = fully_shard(model.ptr(), opts);
  if (cfg.explicit_prefetch) {
    blocks[0].set_modules_to_forward_prefetch({blocks[1]});
    blocks[1].set_modules_to_backward_prefetch({blocks[0]});
  }
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));

  const int64_t local = kBatch / w;
  for (int step = 0; step < kSteps; ++step) {
    for (int mb = 0; mb < cfg.micro_batches; ++mb) {
      const at::Tensor x = Batch(step * 10 + mb, kBatch, 3, 1), y = Batch(step * 10 + mb, kBatch, 1, 2);
      // The reference sees the whole batch; micro-batch losses are summed by accumulation.
      torch::nn::functional::mse_loss(ref(x), y).backward();
      const bool last = mb + 1 == cfg.micro_batches;
      root.set_requires_gradient_sync(last);
      // Data-parallel ranks (the whole world, HSDP replicas included) split the batch.
      const at::Tensor lx = x.narrow(0, me * local, local), ly = y.narrow(0, me * local, local);
      torch::nn::functional::mse_loss(model(lx), ly).backward();
    }
    ref_opt.step();
    ref_opt.zero_grad();
    opt.step();
    opt.zero_grad();
  }
  // Every FSDP parameter, gathered, equals the reference's parameter of the same name.
  const double tol = cfg.bf16 ? 3e-2 : 1e-6;
  auto ref_params = ref->named_parameters();
  int checked = 0;
  for (FSDPState* s : CollectStates(*model)) {
    if (!s->param_group()) continue;
    for (const auto& p : s->param_group()->fsdp_params()) {
      const at::Tensor full = p->ShardedDTensor().full_tensor();
      const at::Tensor expected = ref_params[p->fqn()];
      const double scale = std::max(1.0, expected.abs().max().item<double>());
      const double diff = (full - expected).abs().max().item<double>();
      EXPECT_LE(diff, tol * scale) << cfg.name << " " << p->fqn() << " rank " << me;
      ++checked;
    }
  }
  EXPECT_EQ(checked, static_cast<int>(ref->parameters().size()));
}

struct ParityCase {
  Backend backend;
  int world;
  Config cfg;
};

class ParityTest : public ::testing::TestWithParam<ParityCase> {};

TEST_P(ParityTest, TrainingEqualsSingleRank) {
  const ParityCase c = GetParam();
  fsdp::testing::RunOnRanks(c.backend, c.world, [c](const comm::ProcessGroupPtr& pg) { RunParity(c.cfg, pg); });
}

std::vector<ParityCase> Cases() {
  std::vector<ParityCase> cases;
  for (Backend b : {Backend::kThreaded, Backend::kGlooThreads}) {
    for (int w : {1, 2, 3, 4}) cases.push_back({b, w, Config{"default"}});
  }
  auto add = [&](Config cfg, int w = 4) { cases.push_back({Backend::kThreaded, w, std::move(cfg)}); };
  add(Config{.name = "no_reshard", .reshard_after_forward = false});
  add(Config{.name = "reshard_to_2", .reshard_after_forward = int64_t{2}});
  add(Config{.name = "hsdp", .hsdp = true});
  add(Config{.name = "grad_accumulation", .micro_batches = 4});
  add(Config{.name = "hsdp_grad_accumulation", .hsdp = true, .micro_batches = 3});
  add(Config{.name = "frozen", .freeze_first_fc1 = true}, 3);
  add(Config{.name = "block_used_twice", .use_block_twice = true}, 3);
  add(Config{.name = "explicit_prefetch", .explicit_prefetch = true});
  add(Config{.name = "cpu_offload", .offload = true}, 3);
  add(Config{.name = "bf16", .bf16 = true}, 2);
  cases.push_back({Backend::kGlooThreads, 4, Config{.name = "hsdp", .hsdp = true}});
  return cases;
}

std::string CaseName(const ::testing::TestParamInfo<ParityCase>& info) {
  return absl::StrCat(fsdp::testing::BackendName(info.param.backend), "_w", info.param.world, "_", info.param.cfg.name);
}

INSTANTIATE_TEST_SUITE_P(Configs, ParityTest, ::testing::ValuesIn(Cases()), CaseName);

}  // namespace
}  // namespace fsdp::per_param
