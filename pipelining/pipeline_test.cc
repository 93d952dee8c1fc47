// PipelineStage and PipelineSchedule on Threaded ranks against one process running the same
// model on the same microbatches (the independent reference): every schedule's losses,
// merged outputs and per-stage gradients, and eval(); custom CSV schedules; metadata given or
// inferred; kwargs; non-differentiable inputs (token ids); bad arguments and a failing stage.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/comm_trace.h"
#include "pipelining/action.h"
#include "pipelining/microbatch.h"
#include "pipelining/pipeline_schedule.h"
#include "pipelining/schedule_orders.h"
#include "pipelining/stage.h"
#include "testing/expect_error.h"
#include "testing/float_tolerance.h"
#include "testing/multi_rank.h"

namespace fsdp::pipelining {
namespace {

using ::fsdp::testing::Backend;
using ::fsdp::testing::RunOnRanks;

constexpr int64_t kDim = 6;
constexpr int64_t kBatch = 24;  // divisible by every microbatch count below

// One stage's module: x -> tanh(x W^T + b), float64 so that the only difference from the
// reference is summation order.
std::shared_ptr<torch::nn::LinearImpl> MakeLayer(int index) {
  auto layer = std::make_shared<torch::nn::LinearImpl>(kDim, kDim);
  layer->to(at::kDouble);
  at::NoGradGuard no_grad;
  // Deterministic and distinct per layer, without the (process-wide) generator.
  layer->weight.copy_(at::sin(at::arange(kDim * kDim, at::kDouble).reshape({kDim, kDim}) * 0.37 + index) * 0.6);
  layer->bias.copy_(at::cos(at::arange(kDim, at::kDouble) * 0.5 + index) * 0.1);
  return layer;
}

StageForward LayerForward(const std::shared_ptr<torch::nn::LinearImpl>& layer) {
  return
      [layer](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{at::tanh(layer->forward(in[0]))}; };
}

at::Tensor Input() { return at::cos(at::arange(kBatch * kDim, at::kDouble).reshape({kBatch, kDim}) * 0.21); }
at::Tensor Target() { return at::sin(at::arange(kBatch * kDim, at::kDouble).reshape({kBatch, kDim}) * 0.13) * 0.5; }

at::Tensor Mse(const std::vector<at::Tensor>& out, const at::Tensor& target) { return at::mse_loss(out[0], target); }

struct Reference {
  std::vector<at::Tensor> losses;                    // per microbatch
  at::Tensor output;                                 // merged
  std::vector<at::Tensor> weight_grads, bias_grads;  // per layer, mean over microbatches
};

// The model run on one process, microbatch by microbatch, gradients averaged.
Reference RunReference(int num_layers, int n_mb) {
  std::vector<std::shared_ptr<torch::nn::LinearImpl>> layers;
  for (int i = 0; i < num_layers; ++i) layers.push_back(MakeLayer(i));
  Reference ref;
  std::vector<at::Tensor> outs;
  auto xs = SplitTensorIntoMicrobatches(Input(), n_mb);
  auto ts = SplitTensorIntoMicrobatches(Target(), n_mb);
  for (int m = 0; m < n_mb; ++m) {
    at::Tensor h = xs[m];
    for (auto& l : layers) h = at::tanh(l->forward(h));
    at::Tensor loss = at::mse_loss(h, ts[m]);
    loss.backward();
    ref.losses.push_back(loss.detach());
    outs.push_back(h.detach());
  }
  ref.output = at::cat(outs);
  for (auto& l : layers) {
    ref.weight_grads.push_back(l->weight.grad() / n_mb);
    ref.bias_grads.push_back(l->bias.grad() / n_mb);
  }
  return ref;
}

// The two may sum each gradient's terms (n_mb microbatches x the rows of one) in other orders.
double Tolerance(int n_mb) { return testing::SummationOrderTolerance(at::kDouble, kBatch * kDim * n_mb); }

void ExpectClose(const at::Tensor& got, const at::Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = std::max(1.0, want.abs().max().item<double>());
  EXPECT_LE((got - want).abs().max().item<double>(), tol * scale) << what << "\ngot\n" << got << "\nwant\n" << want;
}

// Each of this rank's stages' weight and bias gradients against the unpipelined run's.
void ExpectReferenceGrads(const std::vector<std::shared_ptr<PipelineStage>>& stages,
                          const std::vector<std::shared_ptr<torch::nn::LinearImpl>>& layers, const Reference& ref,
                          double tol) {
  for (size_t k = 0; k < stages.size(); ++k) {
    const int s = stages[k]->stage_index();
    ExpectClose(layers[k]->weight.grad(), ref.weight_grads[s], tol, "stage " + std::to_string(s) + " weight grad");
    ExpectClose(layers[k]->bias.grad(), ref.bias_grads[s], tol, "stage " + std::to_string(s) + " bias grad");
  }
}

struct Case {
  ScheduleKind kind;
  int ranks;
  int stages_per_rank;
  int n_mb;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return "S" + std::string(ScheduleName(c.kind)) + "_ranks" + std::to_string(c.ranks) + "_spr" +
         std::to_string(c.stages_per_rank) + "_mb" + std::to_string(c.n_mb);
}

class EverySchedule : public ::testing::TestWithParam<Case> {};

// Runs `c` on Threaded ranks; `static_meta` gives every stage its shapes instead of inferring them.
void RunAgainstReference(const Case& c, bool static_meta) {
  const int num_stages = c.ranks * c.stages_per_rank;
  const Reference ref = RunReference(num_stages, c.n_mb);
  RunOnRanks(Backend::kThreaded, c.ranks, [&](const comm::ProcessGroupPtr& group) {
    std::vector<std::shared_ptr<PipelineStage>> stages;
    std::vector<std::shared_ptr<torch::nn::LinearImpl>> layers;
    for (int s = 0; s < num_stages; ++s) {
      if (StageRank(c.kind, s, c.ranks) != group->rank()) continue;
      layers.push_back(MakeLayer(s));
      PipelineStageOptions options;
      if (static_meta) {
        const TensorMeta act{{kBatch / c.n_mb, kDim}, at::kDouble};
        options.inputs = {act};
        options.outputs = {act};
      }
      stages.push_back(
          std::make_shared<PipelineStage>(layers.back(), LayerForward(layers.back()), s, num_stages, group, options));
    }
    PipelineSchedule schedule(c.kind, stages, {.n_microbatches = c.n_mb, .loss_fn = Mse});
    for (int step = 0; step < 2; ++step) {  // a second step: nothing of the first one leaks
      for (auto& l : layers) l->zero_grad();
      std::vector<at::Tensor> losses;
      std::vector<at::Tensor> out = schedule.step({Input()}, Target(), &losses);
      const double tol = Tolerance(c.n_mb);
      ExpectReferenceGrads(stages, layers, ref, tol);
      for (size_t k = 0; k < stages.size(); ++k) {
        if (stages[k]->is_last()) {
          ASSERT_EQ(losses.size(), static_cast<size_t>(c.n_mb));
          for (int m = 0; m < c.n_mb; ++m) ExpectClose(losses[m], ref.losses[m], tol, "loss " + std::to_string(m));
          ASSERT_EQ(out.size(), 1u);
          ExpectClose(out[0], ref.output, tol, "merged output");
          // What step() hands back keeps no autograd graph of the pipeline alive.
          EXPECT_FALSE(out[0].requires_grad());
          for (const at::Tensor& loss : losses) EXPECT_FALSE(loss.requires_grad());
        }
      }
      if (std::none_of(stages.begin(), stages.end(), [](auto& s) { return s->is_last(); })) {
        EXPECT_TRUE(out.empty());
        EXPECT_TRUE(losses.empty());
      }
    }
    // eval(): the same losses and output from the forwards alone; no gradient appears.
    for (auto& l : layers) l->zero_grad();
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> losses;
    const std::vector<at::Tensor> out = schedule.eval({Input()}, Target(), &losses);
    for (size_t k = 0; k < stages.size(); ++k) {
      EXPECT_FALSE(layers[k]->weight.grad().defined()) << "stage " << stages[k]->stage_index();
      if (!stages[k]->is_last()) continue;
      ASSERT_EQ(losses.size(), static_cast<size_t>(c.n_mb));
      for (int m = 0; m < c.n_mb; ++m) ExpectClose(losses[m], ref.losses[m], Tolerance(c.n_mb), "eval loss");
      ExpectClose(out.at(0), ref.output, Tolerance(c.n_mb), "eval output");
    }
  });
}

TEST_P(EverySchedule, MatchesOneProcessTraining) { RunAgainstReference(GetParam(), /*static_meta=*/false); }
TEST_P(EverySchedule, MatchesOneProcessTrainingWithGivenShapes) {
  RunAgainstReference(GetParam(), /*static_meta=*/true);
}

INSTANTIATE_TEST_SUITE_P(
    Pipelining, EverySchedule,
    ::testing::Values(Case{ScheduleKind::kGPipe, 2, 1, 4}, Case{ScheduleKind::kGPipe, 4, 1, 3},
                      Case{ScheduleKind::k1F1B, 2, 1, 4}, Case{ScheduleKind::k1F1B, 4, 1, 8},
                      Case{ScheduleKind::kInterleaved1F1B, 2, 2, 4}, Case{ScheduleKind::kInterleaved1F1B, 4, 2, 8},
                      Case{ScheduleKind::kLoopedBFS, 2, 2, 4}, Case{ScheduleKind::kInterleavedZeroBubble, 2, 2, 4},
                      Case{ScheduleKind::kInterleavedZeroBubble, 4, 2, 8}, Case{ScheduleKind::kZBVZeroBubble, 2, 2, 4},
                      Case{ScheduleKind::kZBVZeroBubble, 4, 2, 8}, Case{ScheduleKind::kDualPipeV, 2, 2, 4},
                      Case{ScheduleKind::kDualPipeV, 4, 2, 8}),
    CaseName);

// A custom compute-only schedule from a CSV file (PyTorch's _load_csv), run with loop
// placement: rank 1 runs its backward of microbatch 0 before its second forward.
// Backward calls of the operation between a stage's Linear and its tanh, per stage.
std::array<std::atomic<int>, 8> counted_backwards{};

struct CountBackward : torch::autograd::Function<CountBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t stage) {
    ctx->saved_data["stage"] = stage;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    ++counted_backwards[ctx->saved_data["stage"].toInt()];
    return {grads[0], at::Tensor()};
  }
};

// A backward that cannot run inside a backward restricted to some inputs, as a reentrant
// checkpoint's nested backward (fsdp/activation_checkpointing): it throws there.
struct NeedsWholeBackward : torch::autograd::Function<NeedsWholeBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
                "NeedsWholeBackward: inside a partial backward");
    return {grads[0]};
  }
};

// PyTorch's split backward: W computes the parameters' gradients from where their paths
// join the inputs' (the Linear), with what I left there, so the operations above it run once
// per microbatch, in I; walking the graph again from the outputs would run them twice. The
// first stage, whose input needs no gradient, runs its whole backward in W.
// PipelineStageOptions::whole_backward_in_input: I runs the whole backward (once per
// microbatch, never inside a partial one: a NeedsWholeBackward in each stage) and W nothing.
// Either way the gradients are the unpipelined run's.
TEST(PipelineSchedule, WeightBackwardStartsWhereTheInputBackwardStopped) {
  constexpr int kRanks = 2, kStages = 4, kMicrobatches = 4;
  for (const bool whole : {false, true}) {
    for (ScheduleKind kind : {ScheduleKind::kInterleavedZeroBubble, ScheduleKind::kZBVZeroBubble}) {
      SCOPED_TRACE(std::string(ScheduleName(kind)) + (whole ? " whole_backward_in_input" : ""));
      for (auto& c : counted_backwards) c = 0;
      const Reference ref = RunReference(kStages, kMicrobatches);
      RunOnRanks(Backend::kThreaded, kRanks, [&](const comm::ProcessGroupPtr& group) {
        std::vector<std::shared_ptr<PipelineStage>> stages;
        std::vector<std::shared_ptr<torch::nn::LinearImpl>> layers;
        for (int s = 0; s < kStages; ++s) {
          if (StageRank(kind, s, kRanks) != group->rank()) continue;
          auto l = MakeLayer(s);
          layers.push_back(l);
          StageForward forward = [l, s, whole](const std::vector<at::Tensor>& in) {
            at::Tensor h = l->forward(in[0]);
            if (whole) h = NeedsWholeBackward::apply(h);
            return std::vector<at::Tensor>{at::tanh(CountBackward::apply(h, s))};
          };
          stages.push_back(std::make_shared<PipelineStage>(l, forward, s, kStages, group,
                                                           PipelineStageOptions{.whole_backward_in_input = whole}));
        }
        PipelineSchedule schedule(kind, stages, {.n_microbatches = kMicrobatches, .loss_fn = Mse});
        schedule.step({Input()}, Target());
        ExpectReferenceGrads(stages, layers, ref, Tolerance(kMicrobatches));
      });
      for (int s = 0; s < kStages; ++s) EXPECT_EQ(counted_backwards[s].load(), kMicrobatches) << "stage " << s;
    }
  }
}

// A Linear whose backward counts its calls per stage: under a split backward it is where the
// parameters' path joins the input's, so I and W each run it.
struct CountedLinear : torch::autograd::Function<CountedLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& b, int64_t stage) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["stage"] = stage;
    return at::linear(x, w, b);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    ++counted_backwards[ctx->saved_data["stage"].toInt()];
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& g = grads[0];
    return {g.mm(saved[1]), g.t().mm(saved[0]), g.sum(0), at::Tensor()};
  }
};

// An I whose next action in the rank's list, past waits for sends, is its own W runs the whole
// backward in one autograd pass (the joining Linear's backward once) and W nothing; any other I
// splits (twice).
// ZBV's list has both kinds at 2 ranks, InterleavedZeroBubble's last rank only split ones;
// the gradients are the unpipelined run's either way.
TEST(PipelineSchedule, AnInputBackwardFollowedByItsWeightBackwardIsOnePass) {
  constexpr int kRanks = 2, kStages = 4, kMicrobatches = 4;
  for (ScheduleKind kind : {ScheduleKind::kInterleavedZeroBubble, ScheduleKind::kZBVZeroBubble}) {
    SCOPED_TRACE(std::string(ScheduleName(kind)));
    for (auto& c : counted_backwards) c = 0;
    std::array<std::atomic<int>, kStages> expected{};
    std::atomic<int> one_pass{0}, two_passes{0};
    const Reference ref = RunReference(kStages, kMicrobatches);
    RunOnRanks(Backend::kThreaded, kRanks, [&](const comm::ProcessGroupPtr& group) {
      std::vector<std::shared_ptr<PipelineStage>> stages;
      std::vector<std::shared_ptr<torch::nn::LinearImpl>> layers;
      for (int s = 0; s < kStages; ++s) {
        if (StageRank(kind, s, kRanks) != group->rank()) continue;
        auto l = MakeLayer(s);
        layers.push_back(l);
        StageForward forward = [l, s](const std::vector<at::Tensor>& in) {
          return std::vector<at::Tensor>{at::tanh(CountedLinear::apply(in[0], l->weight, l->bias, s))};
        };
        stages.push_back(std::make_shared<PipelineStage>(l, forward, s, kStages, group));
      }
      PipelineSchedule schedule(kind, stages, {.n_microbatches = kMicrobatches, .loss_fn = Mse});
      const std::vector<Action>& list = schedule.actions();
      for (size_t i = 0; i < list.size(); ++i) {
        if (list[i].type != ActionType::kBackwardInput) continue;
        size_t j = i + 1;
        while (j < list.size() && (list[j].type == ActionType::kWaitSendF || list[j].type == ActionType::kWaitSendB)) {
          ++j;
        }
        const bool adjacent = j < list.size() && list[j].type == ActionType::kBackwardWeight &&
                              list[j].stage == list[i].stage && list[j].microbatch == list[i].microbatch;
        // The first stage's input needs no gradient: its backward is one pass either way.
        const bool one = adjacent || list[i].stage == 0;
        expected[list[i].stage] += one ? 1 : 2;
        ++(one && list[i].stage != 0 ? one_pass : two_passes);
      }
      schedule.step({Input()}, Target());
      ExpectReferenceGrads(stages, layers, ref, Tolerance(kMicrobatches));
    });
    for (int s = 0; s < kStages; ++s) EXPECT_EQ(counted_backwards[s].load(), expected[s].load()) << "stage " << s;
    EXPECT_GT(two_passes.load(), 0);
    if (kind == ScheduleKind::kZBVZeroBubble) {
      EXPECT_GT(one_pass.load(), 0);
    }
  }
}

TEST(PipelineSchedule, RunsACustomScheduleFromCsv) {
  const int n_mb = 4;
  const std::string path =
      (std::filesystem::temp_directory_path() / ("pipelining_custom_" + std::to_string(::getpid()) + ".csv")).string();
  {
    std::ofstream csv(path);
    csv << "0F0,0F1,0F2,0B0,0F3,0B1,0B2,0B3\r\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\r\n";
  }
  const PipelineOrder order = ReadScheduleCsv(path);
  std::remove(path.c_str());
  const Reference ref = RunReference(2, n_mb);
  RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& group) {
    auto layer = MakeLayer(group->rank());
    auto stage = std::make_shared<PipelineStage>(layer, LayerForward(layer), group->rank(), 2, group);
    PipelineSchedule schedule(order, [](int s) { return s; }, {stage}, {.n_microbatches = n_mb, .loss_fn = Mse});
    std::vector<at::Tensor> losses;
    schedule.step({Input()}, Target(), &losses);
    ExpectClose(layer->weight.grad(), ref.weight_grads[group->rank()], Tolerance(n_mb), "weight grad");
    if (group->rank() == 1) ExpectClose(at::stack(losses), at::stack(ref.losses), Tolerance(n_mb), "losses");
  });
}

// Forward only (no loss_fn): the merged outputs, and no backward traffic.
TEST(PipelineSchedule, WithoutALossFunctionRunsForwardsOnly) {
  const Reference ref = RunReference(2, 3);
  RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& group) {
    auto layer = MakeLayer(group->rank());
    auto stage = std::make_shared<PipelineStage>(layer, LayerForward(layer), group->rank(), 2, group);
    PipelineSchedule schedule(ScheduleKind::k1F1B, {stage}, {.n_microbatches = 3});
    std::vector<at::Tensor> out = schedule.step({Input()});
    EXPECT_FALSE(layer->weight.grad().defined());
    if (group->rank() == 1) ExpectClose(out.at(0), ref.output, Tolerance(3), "output");
  });
}

// kwargs (PyTorch's keyword arguments of step()): every rank passes the whole batch's; each
// stage's forward gets its microbatch's after its inputs, and none of them travels: one
// activation per microbatch crosses the boundary each way (CommTrace). Gradients and losses
// as one process computing tanh(l1(tanh(l0(x)) * scale)) * scale per microbatch.
TEST(PipelineSchedule, KwargsReachEveryStageWithoutBeingSent) {
  const int n_mb = 3;
  const at::Tensor scale = (at::arange(1, kBatch + 1, at::kDouble) / kBatch).unsqueeze(1);
  std::vector<std::shared_ptr<torch::nn::LinearImpl>> ref_layers = {MakeLayer(0), MakeLayer(1)};
  const auto xs = SplitTensorIntoMicrobatches(Input(), n_mb), ts = SplitTensorIntoMicrobatches(Target(), n_mb),
             ss = SplitTensorIntoMicrobatches(scale, n_mb);
  std::vector<at::Tensor> ref_losses;
  for (int m = 0; m < n_mb; ++m) {
    at::Tensor h = xs[m];
    for (auto& l : ref_layers) h = at::tanh(l->forward(h)) * ss[m];
    at::Tensor loss = at::mse_loss(h, ts[m]);
    loss.backward();
    ref_losses.push_back(loss.detach());
  }
  RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    auto trace = std::make_shared<comm::CommTrace>(pg);
    auto layer = MakeLayer(pg->rank());
    StageForward forward = [layer](const std::vector<at::Tensor>& in) {
      EXPECT_EQ(in.size(), 2u);  // the input, then the kwarg
      return std::vector<at::Tensor>{at::tanh(layer->forward(in[0])) * in[1]};
    };
    auto stage = std::make_shared<PipelineStage>(layer, forward, pg->rank(), 2, trace);
    PipelineSchedule schedule(ScheduleKind::k1F1B, {stage}, {.n_microbatches = n_mb, .loss_fn = Mse});
    schedule.step({Input()}, Target(), nullptr, {scale});  // infers the shapes
    layer->zero_grad();
    trace->clear();
    std::vector<at::Tensor> losses;
    schedule.step({Input()}, Target(), &losses, {scale});
    int64_t sends = 0, recvs = 0;
    for (const comm::CollectiveRecord& r : trace->records()) {
      sends += r.op == "send";
      recvs += r.op == "recv";
      EXPECT_EQ(r.input_numel + r.output_numel, kBatch / n_mb * kDim) << r.op;  // an activation, not a scale
    }
    EXPECT_EQ(sends, n_mb);
    EXPECT_EQ(recvs, n_mb);
    const double tol = Tolerance(n_mb);
    ExpectClose(layer->weight.grad(), ref_layers[pg->rank()]->weight.grad() / n_mb, tol, "weight grad");
    if (pg->rank() == 1) ExpectClose(at::stack(losses), at::stack(ref_losses), tol, "losses");
  });
}

// Token ids into an embedding on stage 0: an integer input gets no gradient, the embedding's
// weight does; stage 1 gets the float activations.
TEST(PipelineSchedule, IntegerInputsOfTheFirstStageGetNoGradient) {
  const int n_mb = 2;
  const int64_t vocab = 11;
  auto make_embedding = [&] {
    auto e = std::make_shared<torch::nn::EmbeddingImpl>(vocab, kDim);
    e->to(at::kDouble);
    at::NoGradGuard no_grad;
    e->weight.copy_(at::sin(at::arange(vocab * kDim, at::kDouble).reshape({vocab, kDim})));
    return e;
  };
  const at::Tensor tokens = at::remainder(at::arange(kBatch, at::kLong) * 7, vocab);
  // Reference.
  auto emb = make_embedding();
  auto head = MakeLayer(1);
  auto xs = SplitTensorIntoMicrobatches(tokens, n_mb);
  auto ts = SplitTensorIntoMicrobatches(Target(), n_mb);
  for (int m = 0; m < n_mb; ++m) at::mse_loss(at::tanh(head->forward(emb->forward(xs[m]))), ts[m]).backward();
  const at::Tensor want_emb = emb->weight.grad() / n_mb;
  const at::Tensor want_head = head->weight.grad() / n_mb;
  RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& group) {
    std::shared_ptr<torch::nn::Module> module;
    StageForward forward;
    at::Tensor grad_of_interest;
    if (group->rank() == 0) {
      auto e = make_embedding();
      module = e;
      forward = [e](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{e->forward(in[0])}; };
    } else {
      auto l = MakeLayer(1);
      module = l;
      forward = LayerForward(l);
    }
    auto stage = std::make_shared<PipelineStage>(module, forward, group->rank(), 2, group);
    PipelineSchedule schedule(ScheduleKind::kGPipe, {stage}, {.n_microbatches = n_mb, .loss_fn = Mse});
    schedule.step({tokens}, Target());
    const at::Tensor got = module->parameters()[0].grad();
    ExpectClose(got, group->rank() == 0 ? want_emb : want_head, Tolerance(n_mb), "weight grad");
    EXPECT_EQ(stage->input_meta().at(0).dtype, group->rank() == 0 ? at::kLong : at::kDouble);
  });
}

TEST(PipelineSchedule, RejectsBadArguments) {
  RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& group) {
    auto layer = MakeLayer(0);
    auto make = [&](int index, int num) {
      return std::make_shared<PipelineStage>(layer, LayerForward(layer), index, num, group);
    };
    EXPECT_ERROR_CONTAINS(make(2, 2), "stage_index 2 is outside [0, num_stages = 2)");
    EXPECT_ERROR_CONTAINS(std::make_shared<PipelineStage>(nullptr, LayerForward(layer), 0, 2, group), "module is null");
    EXPECT_ERROR_CONTAINS(PipelineSchedule(ScheduleKind::k1F1B, {make(1 - group->rank(), 2)}, {.n_microbatches = 2}),
                          "belongs on rank");
    EXPECT_ERROR_CONTAINS(PipelineSchedule(ScheduleKind::k1F1B, {make(group->rank(), 3)}, {.n_microbatches = 2}),
                          "needs num_stages = 2");
    EXPECT_ERROR_CONTAINS(PipelineSchedule(ScheduleKind::k1F1B, {make(group->rank(), 2)}, {.n_microbatches = 0}),
                          "n_microbatches");
    EXPECT_ERROR_CONTAINS(PipelineSchedule(ScheduleKind::kGPipe, {make(group->rank(), 4), make(group->rank() + 2, 4)},
                                           {.n_microbatches = 2}),
                          "one stage per rank");
    EXPECT_ERROR_CONTAINS(SplitIntoMicrobatches({at::zeros({3, 2})}, 4), "has 3 rows along dim 0, fewer than the 4");
  });
}

// Static shapes that the forward does not produce: an error naming the stage and both shapes
// on the rank that sees it; the peer's pending receive fails instead of hanging.
TEST(PipelineSchedule, ShapesThatDisagreeWithTheGivenOnesFailEveryRank) {
  auto outcomes = testing::RunOnRanksCollect(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& group) {
    auto layer = MakeLayer(group->rank());
    PipelineStageOptions options;
    options.inputs = {TensorMeta{{kBatch / 2, kDim}, at::kDouble}};
    options.outputs = {TensorMeta{{kBatch / 2, kDim + 1}, at::kDouble}};  // wrong
    auto stage = std::make_shared<PipelineStage>(layer, LayerForward(layer), group->rank(), 2, group, options);
    PipelineSchedule schedule(ScheduleKind::kGPipe, {stage}, {.n_microbatches = 2, .loss_fn = Mse});
    schedule.step({Input()}, Target());
  });
  ASSERT_EQ(outcomes.size(), 2u);
  EXPECT_FALSE(outcomes[0].ok);
  EXPECT_NE(outcomes[0].message.find("stage 0 microbatch 0: its outputs are (Double[12, 6])"), std::string::npos)
      << outcomes[0].message;
  EXPECT_NE(outcomes[0].message.find("Double[12, 7]"), std::string::npos) << outcomes[0].message;
  EXPECT_FALSE(outcomes[1].ok);
}

// A stage whose forward throws at microbatch 1: that rank's error names the action and shows
// the schedule; the other rank does not hang.
TEST(PipelineSchedule, AFailingStageFailsTheStepOnEveryRank) {
  auto outcomes = testing::RunOnRanksCollect(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& group) {
    auto layer = MakeLayer(group->rank());
    int calls = 0;
    StageForward forward = [&, layer](const std::vector<at::Tensor>& in) {
      if (group->rank() == 1 && ++calls == 3) TORCH_CHECK(false, "injected failure");  // meta inference is call 1
      return LayerForward(layer)(in);
    };
    auto stage = std::make_shared<PipelineStage>(layer, forward, group->rank(), 2, group);
    PipelineSchedule schedule(ScheduleKind::k1F1B, {stage}, {.n_microbatches = 4, .loss_fn = Mse});
    schedule.step({Input()}, Target());
  });
  ASSERT_EQ(outcomes.size(), 2u);
  EXPECT_FALSE(outcomes[0].ok);
  EXPECT_FALSE(outcomes[1].ok);
  EXPECT_NE(outcomes[1].message.find("action 1F1: "), std::string::npos) << outcomes[1].message;
  EXPECT_NE(outcomes[1].message.find("injected failure"), std::string::npos) << outcomes[1].message;
  EXPECT_NE(outcomes[1].message.find("<-- ERROR HERE"), std::string::npos) << outcomes[1].message;
}

// options.on_action: every action of the rank's lowered list, in order, with its times; a
// forward's interval starts after its receive: rank 1's forward of a microbatch starts only
// once rank 0's forward of it has ended (causality, not a time bound: rank 0's forwards sleep
// so that rank 1 is waiting for its input when an F that counted the wait would start).
TEST(PipelineSchedule, OnActionTimesEveryActionWithoutItsWaits) {
  using Clock = std::chrono::steady_clock;
  constexpr auto kRank0ForwardSleep = std::chrono::milliseconds(30);
  constexpr int kMicrobatches = 2;
  std::array<std::atomic<int64_t>, kMicrobatches> rank0_forward_end{};  // steady_clock ticks
  RunOnRanks(Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& group) {
    auto layer = MakeLayer(group->rank());
    StageForward forward = [&, layer](const std::vector<at::Tensor>& in) {
      if (group->rank() == 0 && at::GradMode::is_enabled()) std::this_thread::sleep_for(kRank0ForwardSleep);
      return LayerForward(layer)(in);
    };
    struct Timed {
      Action action;
      Clock::time_point start, end;
    };
    std::vector<Timed> timed;
    PipelineScheduleOptions options{.n_microbatches = kMicrobatches, .loss_fn = Mse};
    options.on_action = [&](const Action& a, Clock::time_point start, Clock::time_point end) {
      timed.push_back({a, start, end});
    };
    auto stage = std::make_shared<PipelineStage>(layer, forward, group->rank(), 2, group);
    PipelineSchedule schedule(ScheduleKind::kGPipe, {stage}, options);
    schedule.step({Input()}, Target());  // shapes inferred (no sleep under no-grad)
    timed.clear();
    const Clock::time_point step_start = Clock::now();
    schedule.step({Input()}, Target());
    const Clock::time_point step_end = Clock::now();
    ASSERT_EQ(timed.size(), schedule.actions().size());
    for (size_t i = 0; i < timed.size(); ++i) {
      EXPECT_EQ(timed[i].action, schedule.actions()[i]) << i;
      EXPECT_LE(step_start, timed[i].start) << i;
      EXPECT_LE(timed[i].start, timed[i].end) << i;
      EXPECT_LE(timed[i].end, step_end) << i;
      if (i > 0) {
        EXPECT_LE(timed[i - 1].end, timed[i].start) << i;
      }
    }
    for (const Timed& t : timed) {
      if (t.action.type == ActionType::kForward && group->rank() == 0) {
        EXPECT_GE(t.end - t.start, kRank0ForwardSleep) << t.action.ToString();
        rank0_forward_end[t.action.microbatch.value()] = t.end.time_since_epoch().count();
      }
    }
    group->barrier()->wait();  // rank 0's times are recorded
    for (const Timed& t : timed) {
      if (t.action.type == ActionType::kForward && group->rank() == 1) {
        EXPECT_GE(t.start.time_since_epoch().count(), rank0_forward_end[t.action.microbatch.value()].load())
            << t.action.ToString() << ": the receive's wait counted";
      }
    }
  });
}

}  // namespace
}  // namespace fsdp::pipelining
