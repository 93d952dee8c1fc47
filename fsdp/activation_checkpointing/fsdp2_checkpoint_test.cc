// Activation checkpointing with FSDP2 (fully_shard), and with FSDP1 (wrap_fsdp) at the end, on
// 2 and 3 threaded ranks: AdamW training equals the single-rank reference without checkpointing
// and without FSDP, and the all-gathers are counted against the same FSDP run without
// checkpointing.
//   kInner: fully_shard(Checkpointed<Block>): FSDP's hooks outside the checkpoint (PyTorch's
//           checkpoint_wrapper then fully_shard): the recomputation runs on the parameters
//           the pre-backward all-gathered, no extra collective.
//   kUnit:  Checkpointed blocks inside the root's FSDP unit (only the root is fully_shard'ed).
//   kOuter: checkpoint() around a stack of fully_shard'ed blocks: the recomputation runs
//           FSDP's pre/post-forward again (see the expectations below).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <optional>
#include <set>
#include <string>

#include "comm/comm_trace.h"
#include "fsdp/activation_checkpointing/checkpoint.h"
#include "fsdp/activation_checkpointing/checkpoint_wrapper.h"
#include "fsdp/common/test_models.h"
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"
#include "fsdp/fsdp1/state_dict.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "mesh/device_mesh.h"
#include "testing/float_tolerance.h"
#include "testing/multi_rank.h"

namespace fsdp::activation_checkpointing {
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

// The CheckpointFunction nodes of `loss`'s autograd graph: proof the checkpoint ran.
int CheckpointNodes(const at::Tensor& loss) {
  std::vector<torch::autograd::Node*> todo{loss.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  int found = 0;
  while (!todo.empty()) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    found += node->name().find("CheckpointFunction") != std::string::npos;
    for (const auto& edge : node->next_edges()) todo.push_back(edge.function.get());
  }
  return found;
}

constexpr int64_t kBatch = 12;
constexpr int kSteps = 3;

// Which FSDP wraps the blocks (unless kUnit) and then the root.
enum class Fsdp { kFsdp2, kFsdp1FullShard, kFsdp1ShardGradOp };

// Trains `kSteps` AdamW steps with `fsdp` (and checkpointing if `checkpointing`), checks the
// parameters against the reference, returns the all-gathers of the run. `reshard`: FSDP2's
// reshard_after_forward (FSDP1: its strategy says).
int Train(Mode mode, bool checkpointing, bool reshard, const comm::ProcessGroupPtr& pg, Fsdp fsdp = Fsdp::kFsdp2) {
  const int w = pg->size(), me = pg->rank();
  auto trace = std::make_shared<comm::CommTrace>(pg);
  CkNet ref(mode), model(mode);
  InitDeterministic(*ref);
  InitDeterministic(*model);
  SetCheckpointing(ref, false);
  SetCheckpointing(model, checkpointing);
  std::optional<fsdp1::FullyShardedDataParallel> fsdp1_root;
  if (fsdp == Fsdp::kFsdp2) {
    fsdp2::FullyShardOptions opts{.mesh = mesh::DeviceMesh::Create(trace, {w}), .reshard_after_forward = reshard};
    if (mode != Mode::kUnit) {
      for (auto& b : model->layers) fsdp2::fully_shard(b.ptr(), opts);
    }
    fsdp2::fully_shard(model.ptr(), opts);
  } else {
    fsdp1::FSDPOptions opts{.process_group = trace,
                            .sharding_strategy = fsdp == Fsdp::kFsdp1FullShard
                                                     ? fsdp1::ShardingStrategy::FULL_SHARD
                                                     : fsdp1::ShardingStrategy::SHARD_GRAD_OP};
    if (mode != Mode::kUnit) {
      for (auto& b : model->layers) fsdp1::wrap_fsdp(b.ptr(), opts);
    }
    fsdp1_root = fsdp1::wrap_fsdp(model.ptr(), opts);
  }
  torch::optim::AdamW ref_opt(UniqueParameters(*ref), torch::optim::AdamWOptions(1e-2));
  // FSDP1 (use_orig_params false): the optimizer steps the flat parameters.
  torch::optim::AdamW opt(fsdp1_root ? fsdp1_root->parameters() : UniqueParameters(*model),
                          torch::optim::AdamWOptions(1e-2));
  const int64_t local = kBatch / w;
  for (int step = 0; step < kSteps; ++step) {
    const at::Tensor x = Batch(step, kBatch, 3, 1), y = Batch(step, kBatch, 1, 2);
    torch::nn::functional::mse_loss(ref(x), y).backward();
    const at::Tensor loss =
        torch::nn::functional::mse_loss(model(x.narrow(0, me * local, local)), y.narrow(0, me * local, local));
    const int expected_nodes = !checkpointing ? 0 : mode == Mode::kOuter ? 1 : static_cast<int>(model->layers.size());
    EXPECT_EQ(CheckpointNodes(loss), expected_nodes) << "checkpointing " << checkpointing;
    loss.backward();
    ref_opt.step();
    ref_opt.zero_grad();
    opt.step();
    opt.zero_grad();
  }
  int all_gathers = 0;
  for (const auto& r : trace->records()) all_gathers += r.op == "all_gather_into_tensor";
  const auto full = fsdp1_root ? fsdp1::GetFullStateDict(*fsdp1_root) : fsdp2::GetFullStateDict(*model);
  auto ref_params = ref->named_parameters();
  EXPECT_EQ(full.size(), ref_params.size());
  for (const auto& item : full) {
    const at::Tensor expected = ref_params[item.key()];
    const double diff = (item.value() - expected).abs().max().item<double>();
    // Sliced vs whole-batch gradient sums (and recomputed forwards) through kSteps AdamW steps at lr 1e-2.
    EXPECT_LE(diff, fsdp::testing::AdamWParityTolerance(kSteps, /*lr=*/1e-2) *
                        std::max(1.0, expected.abs().max().item<double>()))
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

// FSDP1 (wrap_fsdp) around Checkpointed blocks: the same parity, and the recomputation runs
// inside FSDP1's hooks on the parameters its pre-backward unsharded, so no extra all-gather.
TEST(Fsdp1Checkpoint, TrainingEqualsSingleRankWithoutCheckpointing) {
  for (const int world : {2, 3}) {
    fsdp::testing::RunOnRanks(Backend::kThreaded, world, [](const comm::ProcessGroupPtr& pg) {
      for (const Fsdp fsdp : {Fsdp::kFsdp1FullShard, Fsdp::kFsdp1ShardGradOp}) {
        for (const Mode mode : {Mode::kInner, Mode::kUnit}) {
          const int plain = Train(mode, false, true, pg, fsdp);
          const int ckpt = Train(mode, true, true, pg, fsdp);
          EXPECT_EQ(ckpt, plain) << "world " << pg->size() << " fsdp " << static_cast<int>(fsdp) << " mode "
                                 << static_cast<int>(mode);
        }
      }
    });
  }
}

}  // namespace
}  // namespace fsdp::activation_checkpointing
