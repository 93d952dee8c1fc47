// FSDP2 inside pipeline stages (train/pipeline_fsdp.h): pp 2 x dp 2 on Threaded ranks, each
// stage's blocks and root fully_shard'ed over its dp group, against one process running the
// whole model on every dp rank's microbatches (the independent reference): the gradients
// each rank holds are its dim-0 shard of the reference's, reduce-scattered once per step, and
// clipping across the pipeline uses the whole model's norm.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm_trace.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/hooked_module/hooked_module.h"
#include "mesh/device_mesh.h"
#include "pipelining/microbatch.h"
#include "pipelining/pipeline_schedule.h"
#include "pipelining/stage.h"
#include "testing/float_tolerance.h"
#include "testing/multi_rank.h"
#include "train/pipeline_fsdp.h"

namespace fsdp::train {
namespace {

constexpr int64_t kDim = 6;     // divisible by dp: every shard the same size
constexpr int64_t kBatch = 16;  // the global batch, split over dp, then into microbatches
constexpr int kLayersPerStage = 2;

using HLinear = Hooked<torch::nn::LinearImpl>;

void InitLayer(torch::nn::LinearImpl& layer, int index) {
  at::NoGradGuard no_grad;
  layer.weight.copy_(at::sin(at::arange(kDim * kDim, at::kDouble).reshape({kDim, kDim}) * 0.37 + index) * 0.6);
  layer.bias.copy_(at::cos(at::arange(kDim, at::kDouble) * 0.5 + index) * 0.1);
}

// A stage's chunk: kLayersPerStage blocks x -> tanh(x W^T + b).
struct ChunkImpl : torch::nn::Module {
  explicit ChunkImpl(int first_layer) {
    for (int i = 0; i < kLayersPerStage; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), HLinear(kDim, kDim)));
      blocks.back()->to(at::kDouble);
      InitLayer(*blocks.back(), first_layer + i);
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& b : blocks) h = at::tanh(b(h));
    return h;
  }
  std::vector<HLinear> blocks;
};
using Chunk = Hooked<ChunkImpl>;

at::Tensor Input() { return at::cos(at::arange(kBatch * kDim, at::kDouble).reshape({kBatch, kDim}) * 0.21); }
at::Tensor Target() { return at::sin(at::arange(kBatch * kDim, at::kDouble).reshape({kBatch, kDim}) * 0.13) * 0.5; }

struct Case {
  pipelining::ScheduleKind kind;
  int stages_per_rank;
  int n_mb;
};

class FsdpInsidePipelineStages : public ::testing::TestWithParam<Case> {};

TEST_P(FsdpInsidePipelineStages, ShardsTheGradientsOfOneProcessTraining) {
  const Case c = GetParam();
  constexpr int kPp = 2;
  constexpr int kDp = 2;
  const int num_stages = kPp * c.stages_per_rank;
  // Reference: every layer, every dp rank's microbatches, gradients averaged over all of them.
  std::vector<std::shared_ptr<torch::nn::LinearImpl>> layers;
  for (int i = 0; i < num_stages * kLayersPerStage; ++i) {
    layers.push_back(std::make_shared<torch::nn::LinearImpl>(kDim, kDim));
    layers.back()->to(at::kDouble);
    InitLayer(*layers.back(), i);
  }
  const auto dp_inputs = Input().chunk(kDp);
  const auto dp_targets = Target().chunk(kDp);
  for (int d = 0; d < kDp; ++d) {
    auto xs = pipelining::SplitTensorIntoMicrobatches(dp_inputs[d], c.n_mb);
    auto ts = pipelining::SplitTensorIntoMicrobatches(dp_targets[d], c.n_mb);
    for (int m = 0; m < c.n_mb; ++m) {
      at::Tensor h = xs[m];
      for (auto& l : layers) h = at::tanh(l->forward(h));
      at::mse_loss(h, ts[m]).backward();
    }
  }
  const double divide = c.n_mb * kDp;
  double ref_norm_squared = 0;
  for (auto& l : layers) {
    ref_norm_squared += (l->weight.grad() / divide).pow(2).sum().item<double>();
    ref_norm_squared += (l->bias.grad() / divide).pow(2).sum().item<double>();
  }
  const double ref_norm = std::sqrt(ref_norm_squared);
  const double max_norm = ref_norm / 2;  // clips: every gradient scaled by about 1/2
  const double coef = max_norm / (ref_norm + 1e-6);
  const double tol = testing::SummationOrderTolerance(at::kDouble, kBatch * kDim * c.n_mb * kDp);

  testing::RunOnRanks(testing::Backend::kThreaded, kPp * kDp, [&](const comm::ProcessGroupPtr& group) {
    auto world = std::make_shared<comm::CommTrace>(group);
    auto mesh = mesh::DeviceMesh::Create(world, {kPp, kDp}, {"pp", "dp"});
    auto dp_trace = std::dynamic_pointer_cast<comm::CommTrace>(mesh->group("dp"));
    ASSERT_NE(dp_trace, nullptr);
    const comm::ProcessGroupPtr& pp = mesh->group("pp");
    const int dp_rank = mesh->local_rank(1);
    std::vector<std::shared_ptr<pipelining::PipelineStage>> stages;
    std::vector<Chunk> chunks;
    for (int s = 0; s < num_stages; ++s) {
      if (pipelining::StageRank(c.kind, s, kPp) != pp->rank()) continue;
      Chunk chunk(s * kLayersPerStage);
      const fsdp2::FullyShardOptions options{.mesh = (*mesh)["dp"]};
      std::vector<fsdp2::FSDPModule> blocks;
      for (auto& b : chunk->blocks) blocks.push_back(fsdp2::fully_shard(b.ptr(), options));
      fsdp2::FSDPModule root = fsdp2::fully_shard(chunk.ptr(), options);
      pipelining::PipelineStageOptions stage_options;
      stage_options.data_parallel = std::make_shared<FsdpStageDataParallel>(root, blocks);
      pipelining::StageForward forward = [chunk](const std::vector<at::Tensor>& in) mutable {
        return std::vector<at::Tensor>{chunk(in[0])};
      };
      stages.push_back(
          std::make_shared<pipelining::PipelineStage>(chunk.ptr(), forward, s, num_stages, pp, stage_options));
      chunks.push_back(chunk);
    }
    pipelining::PipelineSchedule schedule(
        c.kind, stages,
        {.n_microbatches = c.n_mb,
         .loss_fn = [](const std::vector<at::Tensor>& out, const at::Tensor& t) { return at::mse_loss(out[0], t); }});
    for (int step = 0; step < 2; ++step) {
      for (auto& chunk : chunks) chunk->zero_grad();
      dp_trace->clear();
      schedule.step({dp_inputs[dp_rank]}, dp_targets[dp_rank]);
      // One reduce-scatter per block per step, after the stage's last microbatch, not one per
      // microbatch.
      int reduce_scatters = 0;
      for (const comm::CollectiveRecord& r : dp_trace->records()) reduce_scatters += r.op == "reduce_scatter_tensor";
      EXPECT_EQ(reduce_scatters, static_cast<int>(stages.size()) * kLayersPerStage) << "step " << step;
      // clip_grad_norm_ across the pipeline: the norm of the whole model's gradients.
      std::vector<torch::nn::Module*> modules;
      for (auto& chunk : chunks) modules.push_back(chunk.ptr().get());
      const double norm = ClipGradNormAcrossStages(modules, pp, max_norm);
      EXPECT_NEAR(norm, ref_norm, tol * ref_norm) << "step " << step;
      for (size_t k = 0; k < stages.size(); ++k) {
        const int s = stages[k]->stage_index();
        for (int i = 0; i < kLayersPerStage; ++i) {
          const auto& ref = layers[s * kLayersPerStage + i];
          const auto& got = chunks[k]->blocks[i];
          for (auto [name, want, have] : {std::tuple{"weight", ref->weight.grad(), got->weight.grad()},
                                          std::tuple{"bias", ref->bias.grad(), got->bias.grad()}}) {
            const at::Tensor shard = (want / divide * coef).chunk(kDp)[dp_rank];
            ASSERT_TRUE(have.defined()) << "stage " << s << " block " << i << " " << name;
            ASSERT_EQ(have.sizes(), shard.sizes()) << "stage " << s << " block " << i << " " << name;
            EXPECT_LE((have - shard).abs().max().item<double>(), tol * std::max(1.0, shard.abs().max().item<double>()))
                << "step " << step << " stage " << s << " block " << i << " " << name << "\n"
                << have << "\n"
                << shard;
          }
        }
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Pipelining, FsdpInsidePipelineStages,
                         ::testing::Values(Case{pipelining::ScheduleKind::kGPipe, 1, 4},
                                           Case{pipelining::ScheduleKind::k1F1B, 1, 4},
                                           Case{pipelining::ScheduleKind::kInterleaved1F1B, 2, 4},
                                           Case{pipelining::ScheduleKind::kZBVZeroBubble, 2, 4},
                                           Case{pipelining::ScheduleKind::kInterleavedZeroBubble, 2, 4}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(pipelining::ScheduleName(info.param.kind)) == "1F1B"
                                      ? std::string("OneFOneB")
                                      : std::string(pipelining::ScheduleName(info.param.kind));
                         });

}  // namespace
}  // namespace fsdp::train
