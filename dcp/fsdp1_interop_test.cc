// //dcp's FSDP1 (flat-parameter) checkpoints with PyTorch's own FSDP1
// (torch.distributed.fsdp.FullyShardedDataParallel; the peer PyTorch 2.15, FSDP_PEER_PYTHON;
// skipped with the reason without it), through dcp/testdata/fsdp1_interop.py:
//  * our wrap_fsdp at W=3 (FULL_SHARD, one unit per Block, AdamW on the flat parameters)
//    saves model + optimizer after 3 steps: each rank's chunks are the boxes of its flat-shard
//    piece of each parameter, cut mid-row. PyTorch's FSDP1 at W=2 (use_orig_params False and
//    True) dcp.loads it through get/set_model_state_dict and get/set_optimizer_state_dict
//    (sharded: dim-0 ShardedTensor chunks), and every full parameter, moment and step equals
//    what we wrote with GetFullStateDict / GetFullOptimStateDict; the .metadata keys and
//    shapes equal Python's own;
//  * PyTorch's FSDP1 trains 5 steps at W=2 and dcp.saves, then 5 more; we load into our FSDP1
//    at W=3 and into our FSDP2 at W=4, train the same 5 steps and match Python's losses and
//    parameters.
// Weights, data and the training loop are dcp/interop_common.h's (the scripts' formulas).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "dcp/dcp.h"
#include "dcp/interop_common.h"
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"
#include "fsdp/fsdp1/state_dict.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "optim_state/fsdp1_optim_state.h"
#include "testing/multi_rank.h"
#include "testing/peer_python.h"

namespace fsdp::dcp {
namespace {

using fsdp::testing::Backend;
using fsdp::testing::PeerPython;
using interop::DcpKeyedReference;
using interop::ExpectMatchesPython;
using interop::InitWeights;
using interop::NewDir;
using interop::RunScript;
using interop::Train;

// The script's Block and Fsdp1Net, with the same FQNs and parameter order. Flat parameters
// of 82 (a Block) and 37 (inp + head) elements: uneven shards at W=2, 3 and 4.
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t h)
      : fc1(register_module("fc1", torch::nn::Linear(d, h))), fc2(register_module("fc2", torch::nn::Linear(h, d))) {}
  at::Tensor forward(const at::Tensor& x) { return x + fc2(at::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
using Block = Hooked<BlockImpl>;

struct Fsdp1NetImpl : torch::nn::Module {
  Fsdp1NetImpl()
      : inp(register_module("inp", torch::nn::Linear(4, 5))),
        block0(register_module("block0", Block(5, 7))),
        block1(register_module("block1", Block(5, 7))),
        head(register_module("head", torch::nn::Linear(5, 2))),
        scale(register_buffer("scale", at::tensor({1.0f, 0.5f}))) {}
  at::Tensor forward(const at::Tensor& x) { return head(at::relu(block1(block0(inp(x))))) * scale; }
  torch::nn::Linear inp;
  Block block0, block1;
  torch::nn::Linear head;
  at::Tensor scale;
};
using Fsdp1Net = Hooked<Fsdp1NetImpl>;

enum class Fsdp { kFlat, kPerParam };

struct Fsdp1Trainee {
  Fsdp1Net model;
  std::unique_ptr<torch::optim::AdamW> opt;
  fsdp1::FullyShardedDataParallel root;  // FSDP1 only
};

// FSDP1 as the script's (FULL_SHARD, ModuleWrapPolicy({Block}), use_orig_params false: the
// optimizer holds the flat parameters), or FSDP2 with fully_shard per Block and the root.
Fsdp1Trainee BuildFsdp1(const comm::ProcessGroupPtr& pg, Fsdp fsdp, double lr) {
  Fsdp1Trainee t{Fsdp1Net(), nullptr, {}};
  InitWeights(*t.model);
  std::vector<at::Tensor> params;
  if (fsdp == Fsdp::kFlat) {
    fsdp1::FSDPOptions options;
    options.process_group = pg;
    options.sharding_strategy = fsdp1::ShardingStrategy::FULL_SHARD;
    options.auto_wrap_policy = fsdp1::ModuleTypeWrapPolicy<BlockImpl>();
    t.root = fsdp1::wrap_fsdp(t.model.ptr(), options);
    params = t.root.parameters();
  } else {
    auto mesh = mesh::DeviceMesh::Create(pg, {pg->size()});
    fsdp2::fully_shard(t.model->block0.ptr(), {.mesh = mesh});
    fsdp2::fully_shard(t.model->block1.ptr(), {.mesh = mesh});
    fsdp2::fully_shard(t.model.ptr(), {.mesh = mesh});
    params = t.model->parameters();
  }
  t.opt = std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(lr));
  return t;
}

constexpr char kFsdp1Script[] = "dcp/testdata/fsdp1_interop.py";
constexpr double kFsdp1Lr = 1e-2;

TEST(DcpFsdp1Interop, SavedByOurFsdp1AtThreeLoadsIntoPytorchFsdp1AtTwo) {
  std::string why_not;
  const std::string python = PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << why_not;
  const std::string dir = NewDir("cpp_fsdp1_w3"), ref = dir + "_ref.pt";
  fsdp::testing::RunOnRanks(Backend::kThreaded, 3, [&](const comm::ProcessGroupPtr& pg) {
    Fsdp1Trainee t = BuildFsdp1(pg, Fsdp::kFlat, kFsdp1Lr);
    Train(t.model, *t.opt, pg, 0, 3);
    Save(*t.model, t.opt.get(), dir);
    // The reference: the full values (FSDP1's own gather and unflattening, not DCP's boxes).
    const fsdp1::FullStateDict model = fsdp1::GetFullStateDict(t.root);
    const optim_state::OptimStateDict optim = optim_state::GetFullOptimStateDict(t.root, *t.opt);
    if (pg->rank() == 0) fsdp1::SaveFullStateDict(DcpKeyedReference(model, optim, kFsdp1Lr), ref);
  });
  std::string output;
  const int status = RunScript(absl::StrCat(python, " ", kFsdp1Script, " load ", dir, " ", ref), &output);
  EXPECT_EQ(status, 0) << output;
  EXPECT_TRUE(absl::StrContains(output, "OK")) << output;
}

TEST(DcpFsdp1Interop, SavedByPytorchFsdp1AtTwoContinuesHereUnderFsdp1AndFsdp2) {
  std::string why_not;
  const std::string python = PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << why_not;
  const std::string dir = NewDir("py_fsdp1_w2"), out = dir + "_after.pt";
  std::string output;
  const int status = RunScript(absl::StrCat(python, " ", kFsdp1Script, " train ", dir, " ", out), &output);
  ASSERT_EQ(status, 0) << output;
  ASSERT_TRUE(absl::StrContains(output, "SAVED")) << output;
  const fsdp1::FullStateDict expected = fsdp1::LoadFullStateDictFile(out);
  for (const auto& [fsdp, world] : {std::pair{Fsdp::kFlat, 3}, std::pair{Fsdp::kPerParam, 4}}) {
    SCOPED_TRACE(fsdp == Fsdp::kFlat ? "our FSDP1 at W=3" : "our FSDP2 at W=4");
    fsdp::testing::RunOnRanks(Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
      Fsdp1Trainee t = BuildFsdp1(pg, fsdp, /*lr=*/0.5);  // the checkpoint's lr (1e-2) must replace it
      {
        at::NoGradGuard no_grad;
        for (auto& group : t.opt->param_groups()) {  // FSDP1: the flat parameters
          for (auto& p : group.params()) p.zero_();
        }
      }
      Load(*t.model, t.opt.get(), dir);
      const std::vector<double> losses = Train(t.model, *t.opt, pg, 5, 5);
      const fsdp1::FullStateDict full =
          fsdp == Fsdp::kFlat ? fsdp1::GetFullStateDict(t.root) : fsdp2::GetFullStateDict(*t.model);
      // f32 rounding of another row split and AdamW's formulas (lerp vs mul + add) over 5 steps: a
      // few float32 ulps (2^-23) of a step per step; 1e-5 (~80 ulps at scale 1) is 1000x below a step (lr 1e-2).
      ExpectMatchesPython(losses, full, expected, /*num_params=*/12, /*tol=*/1e-5);
    });
  }
}

}  // namespace
}  // namespace fsdp::dcp
