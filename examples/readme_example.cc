// The FSDP2 example of README.md, as a program that builds and runs: a model of fsdp::Hooked
// blocks built on the meta device, fully_shard'ed (each rank allocates only its shards),
// initialized, trained a few AdamW steps and saved as a distributed checkpoint.
//   bazel build //examples:readme_example
//   ./x run -n 2 bazel-bin/examples/readme_example [CHECKPOINT_DIR]
// (or torchrun --no-python --nproc-per-node 2 ...; any number of processes, 1 included).
// Keep the part between the markers identical to README.md's example.
#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include <cstdio>
#include <string>
#include <vector>

#include "comm/init_process_group.h"
#include "comm/main_guard.h"
#include "dcp/dcp.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/meta_init.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "fsdp/meta/meta.h"
#include "mesh/device_mesh.h"

// README example begins.
// fsdp::Hooked<Impl> is Impl whose forward runs the hooks fully_shard attaches.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t dim)
      : fc1(register_module("fc1", torch::nn::Linear(dim, 4 * dim))),
        fc2(register_module("fc2", torch::nn::Linear(4 * dim, dim))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2(at::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
using Block = fsdp::Hooked<BlockImpl>;

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t dim, int n_blocks) {  // each piece goes to the meta device as soon as it is built
    for (int i = 0; i < n_blocks; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), fsdp::MakeOnMeta<Block>(dim)));
    head = register_module("head", fsdp::MakeOnMeta<torch::nn::Linear>(dim, 1));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& block : blocks) x = block(x);
    return head(x);
  }
  std::vector<Block> blocks;
  torch::nn::Linear head{nullptr};
};
using Net = fsdp::Hooked<NetImpl>;

void Train(const std::string& checkpoint_dir) {
  // Gloo, ranks from the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).
  fsdp::comm::ProcessGroupPtr world = fsdp::comm::InitProcessGroupFromEnv("cpu").group;
  auto mesh = fsdp::mesh::DeviceMesh::Create(world, {world->size()});
  Net model(/*dim=*/64, /*n_blocks=*/4);  // shapes only: no parameter memory yet
  for (auto& block : model->blocks) fsdp::fsdp2::fully_shard(block.ptr(), {.mesh = mesh});
  fsdp::fsdp2::fully_shard(model.ptr(), {.mesh = mesh});  // the root last
  torch::manual_seed(0);  // the same init on every rank: each module whole, then each rank keeps its shard
  fsdp::fsdp2::InitMetaParameters(*model, [](torch::nn::Module& m) {
    if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(&m)) linear->reset_parameters();
  });
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));  // sees the shards
  torch::manual_seed(1 + world->rank());  // each rank its own slice of the batch
  const at::Tensor x = at::randn({8, 64}), y = x.sum(1, /*keepdim=*/true);
  for (int step = 0; step < 5; ++step) {
    at::Tensor loss = torch::nn::functional::mse_loss(model(x), y);
    loss.backward();  // blocks all-gather in forward and backward; gradients are reduce-scattered
    opt.step();
    opt.zero_grad();
    if (world->rank() == 0) std::printf("step %d: loss %.4f (rank 0's slice)\n", step, loss.item<double>());
  }
  fsdp::dcp::Save(*model, &opt, checkpoint_dir);  // collective: each rank writes its own shards
  if (world->rank() == 0) std::printf("saved %s\n", checkpoint_dir.c_str());
}
// README example ends.

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : "/tmp/readme_example_ckpt";
  // Any error: one line "[rank R] error: ..." and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain([&] {
    Train(dir);
    return 0;
  });
}
