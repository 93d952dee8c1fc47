// Activation checkpointing with FSDP2 (fully_shard) on 2 threaded ranks: AdamW training equals
// the single-rank reference without checkpointing and without FSDP, and the all-gathers are
// counted against the same FSDP2 run without checkpointing.
//   kInner: fully_shard(Checkpointed<Block>): FSDP's hooks outside the checkpoint (PyTorch's
//           checkpoint_wrapper then fully_shard): the recomputation runs on the parameters
//           the pre-backward all-gathered, no extra collective.
//   kUnit:  Checkpointed blocks inside the root's FSDP unit (only the root is fully_shard'ed).
//   kOuter: checkpoint() around a stack of fully_shard'ed blocks: the recomputation runs
//           FSDP's pre/post-forward again (see the expectations below).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <string>

#include "comm/comm_trace.h"
#include "fsdp/activation_checkpoint/checkpoint.h"
#include "fsdp/activation_checkpoint/checkpoint_wrapper.h"
#include "fsdp/common/test_models.h"
#include "fsdp/per_param/fully_shard.h"
#include "fsdp/per_param/state_dict.h"
#include "mesh/device_mesh.h"
#include "testing/multi_rank.h"

namespace fsdp::activation_checkpoint {
namespace {

using fsdp::testing::Backend;
using test_models::Batch;
using test_models::BlockImpl;
using test_models::InitDeterministic;
using test_models::UniqueParameters;

enum class Mode { kInner, kUnit, kOuter };

struct CkNetImpl : torch::nn::Module {
  explicit CkNetImpl(Mode mode, int64_t blocks = 3)
      : in(register_module("in", torch::nn::Linear(3, 5))),
        head(register_module("head", torch::nn::Linear(5, 1))),
        mode(mode) {
    for (int64_t i = 0; i < blocks; ++i)
      layers.push_back(register_module("block" + std::to_string(i), Checkpointed<BlockImpl>(5, 7)));
    if (mode == Mode::kOuter) apply_activation_checkpointing(*this, nullptr, false);  // the outer one only
  }
  at::Tensor Stack(at::Tensor h) {
    for (auto& b : layers) h = b(h);
    return h;
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = in(x);
    if (mode == Mode::kOuter && outer_checkpoint) {
      h = checkpoint([this](const std::vector<at::Tensor>& i) { return Stack(i[0]); }, {h});
    } else {
      h = Stack(h);
    }
    return head(h);
  }
  torch::nn::Linear in, head;
  std::vector<Checkpointed<BlockImpl>> layers;
  Mode mode;
  bool outer_checkpoint = true;
};
using CkNet = Hooked<CkNetImpl>;

void SetCheckpointing(CkNet& net, bool enabled) {
  if (net->mode == Mode::kOuter) {
    net->outer_checkpoint = enabled;
  } else {
    apply_activation_checkpointing(*net, nullptr, enabled);
  }
}

constexpr int64_t kBatch = 12;
constexpr int kSteps = 3;

// Trains `kSteps` AdamW steps with FSDP2 (and checkpointing if `checkpointing`), checks the
// parameters against the reference, returns the all-gathers of the run.
int Train(Mode mode, bool checkpointing, bool reshard, const comm::ProcessGroupPtr& pg) {
  const int w = pg->size(), me = pg->rank();
  auto trace = std::make_shared<comm::CommTrace>(pg);
  auto mesh = mesh::DeviceMesh::Create(trace, {w});
  CkNet ref(mode), model(mode);
  InitDeterministic(*ref);
  InitDeterministic(*model);
  SetCheckpointing(ref, false);
  SetCheckpointing(model, checkpointing);
  per_param::FullyShardOptions opts{.mesh = mesh, .reshard_after_forward = reshard};
  if (mode != Mode::kUnit) {
    for (auto& b : model->layers) per_param::fully_shard(b.ptr(), opts);
  }
  per_param::fully_shard(model.ptr(), opts);
  torch::optim::AdamW ref_opt(UniqueParameters(*ref), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(UniqueParameters(*model), torch::optim::AdamWOptions(1e-2));
  const int64_t local = kBatch / w;
  for (int step = 0; step < kSteps; ++step) {
    const at::Tensor x = Batch(step, kBatch, 3, 1), y = Batch(step, kBatch, 1, 2);
    torch::nn::functional::mse_loss(ref(x), y).backward();
    torch::nn::functional::mse_loss(model(x.narrow(0, me * local, local)), y.narrow(0, me * local, local)).backward();
    ref_opt.step();
    ref_opt.zero_grad();
    opt.step();
    opt.zero_grad();
  }
  int all_gathers = 0;
  for (const auto& r : trace->records()) all_gathers += r.op == "all_gather_into_tensor";
  const auto full = per_param::GetFullStateDict(*model);
  auto ref_params = ref->named_parameters();
  EXPECT_EQ(full.size(), ref_params.size());
  for (const auto& item : full) {
    const at::Tensor expected = ref_params[item.key()];
    const double diff = (item.value() - expected).abs().max().item<double>();
    EXPECT_LE(diff, 1e-6 * std::max(1.0, expected.abs().max().item<double>()))
        << item.key() << " rank " << me << " checkpointing " << checkpointing << " reshard " << reshard;
  }
  return all_gathers;
}

struct Case {
  std::string name;
  Mode mode;
  bool reshard;
};

class Fsdp2CheckpointTest : public ::testing::TestWithParam<Case> {};

TEST_P(Fsdp2CheckpointTest, TrainingEqualsSingleRankWithoutCheckpointing) {
  const Case c = GetParam();
  fsdp::testing::RunOnRanks(Backend::kThreaded, 2, [c](const comm::ProcessGroupPtr& pg) {
    const int plain = Train(c.mode, false, c.reshard, pg);
    const int ckpt = Train(c.mode, true, c.reshard, pg);
    if (c.mode == Mode::kOuter && c.reshard) {
      // The recomputation's pre-forward finds its block resharded and idle: it all-gathers
      // again, and its post-forward reshards, so the pre-backward gathers a third time.
      EXPECT_EQ(ckpt, plain + 3 * kSteps) << "plain " << plain;
    } else {
      // The recomputation reuses what the pre-backward (or the unit's forward) all-gathered.
      EXPECT_EQ(ckpt, plain);
    }
    if (pg->rank() == 0) std::cout << c.name << ": all-gathers plain " << plain << ", checkpointed " << ckpt << "\n";
  });
}

INSTANTIATE_TEST_SUITE_P(Modes, Fsdp2CheckpointTest,
                         ::testing::Values(Case{"inner_reshard", Mode::kInner, true},
                                           Case{"inner_no_reshard", Mode::kInner, false},
                                           Case{"unit", Mode::kUnit, true}, Case{"outer_reshard", Mode::kOuter, true},
                                           Case{"outer_no_reshard", Mode::kOuter, false}),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
}  // namespace fsdp::activation_checkpoint
