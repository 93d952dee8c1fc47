// Models and helpers shared by the tests of both FSDPs (and optim_state's): a residual MLP
// block, a net with uneven shapes, an optional block reuse and tied weights, deterministic
// init and batches, and a training loop. One model type for every FSDP: blocks and the net
// are fsdp::Hooked modules, which fully_shard, wrap_fsdp or nothing at all can take.
#ifndef FSDP_FSDP_COMMON_TEST_MODELS_H_
#define FSDP_FSDP_COMMON_TEST_MODELS_H_

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/hooked_module/hooked_module.h"

namespace fsdp::test_models {

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t hidden)
      : fc1(register_module("fc1", torch::nn::Linear(d, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, d))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2(torch::nn::functional::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
// A linear map through a weight registered elsewhere too (weight tying, as an output head
// sharing the embedding).
struct TiedLinearImpl : torch::nn::Module {
  explicit TiedLinearImpl(const at::Tensor& shared) : weight(register_parameter("weight", shared)) {}
  at::Tensor forward(const at::Tensor& x) { return at::linear(x, weight); }
  at::Tensor weight;
};
TORCH_MODULE(TiedLinear);

struct NetOptions {
  int64_t blocks = 2;
  int64_t hidden = 7;
  bool use_block_twice = false;
  bool tie = false;  // `mix` and `tied` share one weight (both in the root's group)
};

using Block = Hooked<BlockImpl>;

// 3 -> 5 (uneven rows on most world sizes), blocks of 5 -> 7 -> 5 (each a Hooked<BlockImpl>),
// head 5 -> 1 (a parameter smaller than the world), a 6-element parameter used directly.
struct NetImpl : torch::nn::Module {
  NetImpl(int64_t blocks, int64_t hidden = 7, bool use_block_twice = false)
      : NetImpl(NetOptions{.blocks = blocks, .hidden = hidden, .use_block_twice = use_block_twice}) {}
  explicit NetImpl(NetOptions options = {})
      : in(register_module("in", torch::nn::Linear(3, 5))),
        head(register_module("head", torch::nn::Linear(5, 1))),
        opts(options) {
    for (int64_t i = 0; i < opts.blocks; ++i)
      layers.push_back(register_module(absl::StrCat("block", i), Block(5, opts.hidden)));
    extra = register_parameter("extra", at::zeros({6}));
    if (opts.tie) {
      mix = register_module("mix", torch::nn::Linear(5, 5));
      tied = register_module("tied", TiedLinear(mix->weight));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = in(x);
    for (auto& b : layers) h = b(h);
    if (opts.use_block_twice) h = layers.front()(h);
    if (opts.tie) h = tied(torch::nn::functional::relu(mix(h)));
    return head(h) + extra.sum();
  }
  torch::nn::Linear in, head;
  std::vector<Block> layers;
  at::Tensor extra;
  torch::nn::Linear mix{nullptr};
  TiedLinear tied{nullptr};
  NetOptions opts;
};
using Net = Hooked<NetImpl>;

// Same values on every rank without the (thread-shared) global generator.
inline void InitDeterministic(torch::nn::Module& m, uint64_t seed = 11) {
  at::NoGradGuard no_grad;
  for (auto& p : m.parameters()) {
    p.copy_(at::randn(p.sizes(), at::make_generator<at::CPUGeneratorImpl>(seed++)) * 0.4);
  }
}

// A deferred-init function (fsdp::fsdp2::InitMetaParameters, FSDP1's param_init_fn): each
// module's own parameters and buffers, drawn from one generator in the order modules are
// visited (a generator of its own: threaded ranks share the global one).
inline std::function<void(torch::nn::Module&)> SeededModuleInit(uint64_t seed, double stddev = 0.5) {
  auto gen = std::make_shared<at::Generator>(at::make_generator<at::CPUGeneratorImpl>(seed));
  return [gen, stddev](torch::nn::Module& m) {
    at::NoGradGuard no_grad;
    for (auto& p : m.parameters(/*recurse=*/false)) p.normal_(0.0, stddev, *gen);
    for (auto& b : m.buffers(/*recurse=*/false)) b.uniform_(0.5, 1.5, *gen);
  };
}

// The single-rank reference of that init: `init` on every module of a materialized model in
// modules() order (a module without tensors of its own draws nothing).
inline void InitEveryModule(torch::nn::Module& model, const std::function<void(torch::nn::Module&)>& init) {
  for (const auto& m : model.modules(/*include_self=*/true)) init(*m);
}

// module.parameters() without repeats: LibTorch lists a tied tensor under each name, and an
// optimizer given it twice would step it twice (Python's parameters() de-duplicates).
inline std::vector<at::Tensor> UniqueParameters(const torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) {
    bool seen = false;
    for (const auto& q : out) seen = seen || q.is_same(p);
    if (!seen) out.push_back(p);
  }
  return out;
}

inline at::Tensor Batch(int step, int64_t rows, int64_t cols, uint64_t salt) {
  return at::randn({rows, cols}, at::make_generator<at::CPUGeneratorImpl>(1000 * step + salt));
}

// `steps` optimizer steps of MSE regression from step `first`: rank `rank` of `world`
// data-parallel ranks takes its rows of a 12-row batch (world must divide 12).
template <class Model>
void TrainSteps(Model& model, torch::optim::Optimizer& opt, int first, int steps, int world, int rank) {
  const int64_t local = 12 / world;
  for (int step = first; step < first + steps; ++step) {
    const at::Tensor x = Batch(step, 12, 3, 1), y = Batch(step, 12, 1, 2);
    torch::nn::functional::mse_loss(model(x.narrow(0, rank * local, local)), y.narrow(0, rank * local, local))
        .backward();
    opt.step();
    opt.zero_grad();
  }
}

}  // namespace fsdp::test_models

#endif  // FSDP_FSDP_COMMON_TEST_MODELS_H_
