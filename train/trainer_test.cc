// The trainer (train/trainer.h) on threaded ranks against itself on one rank: the same global
// batch split over FSDP (dp_shard 4), HSDP (2 x 2), FSDP + TP (2 x 2, with and without
// sequence parallel), gradient accumulation and full activation checkpointing must train the
// same model step for step (resuming from checkpoints: trainer_resume_test.cc). And the errors
// a job meets before and while it trains.
// Against torchtitan's own components: tests/peer (the torchtitan parity test).
#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "comm/comm_trace.h"
#include "comm/process_group.h"
#include "float8/float8_linear.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "fsdp/fsdp2/state_dict.h"
#include "models/llama/flavors.h"
#include "testing/allocation_counter.h"
#include "testing/expect_error.h"
#include "testing/golden_file.h"
#include "testing/multi_rank.h"
#include "testing/test_dir.h"
#include "train/config.h"
#include "train/metrics_log.h"
#include "train/parallelize.h"
#include "train/trainer.h"
#include "train/trainer_test_support.h"

namespace fsdp::train {
namespace {

using test_support::kSteps;
using test_support::MaxRelDiff;
using test_support::MeshTolerances;
using test_support::SmallJob;
using test_support::Train;

class TrainerMeshes : public ::testing::TestWithParam<std::pair<int, std::vector<std::string>>> {};

std::string MeshName(const ::testing::TestParamInfo<TrainerMeshes::ParamType>& info) {
  static const char* const kNames[] = {"fsdp4",
                                       "hsdp2x2",
                                       "fsdp2_tp2",
                                       "fsdp2_tp2_no_sp",
                                       "fsdp4_accum2",
                                       "fsdp2_full_ac",
                                       "fsdp2_selective_ac",
                                       "fsdp2_tp2_selective_ac",
                                       "fsdp2_tp2_no_sp_selective_ac",
                                       "fsdp2_no_reshard",
                                       "pp2_dp2_1f1b",
                                       "pp2_dp2_gpipe",
                                       "pp2_dp2_interleaved1f1b",
                                       "pp2_dp2_zbv",
                                       "pp4_1f1b",
                                       "pp2_dp2_selective_ac",
                                       "pp2_dp2_zbv_full_ac",
                                       "pp2_tp2_1f1b",
                                       "pp2_tp2_no_sp_interleaved1f1b",
                                       "pp2_tp2_zbv",
                                       "pp2_dp2_tp2_1f1b",
                                       "cp2",
                                       "cp2_dp2_alltoall",
                                       "cp2_tp2",
                                       "cp4_contiguous",
                                       "hsdp2_cp2",
                                       "pp2_cp2_1f1b"};
  return kNames[info.index];
}

void ExpectTrainsAsOneRank(int world, const std::vector<std::string>& overrides) {
  const std::vector<StepResult>& reference = MeshTolerances().reference;
  const double spread = MeshTolerances().spread;
  const double loss_tolerance = MeshTolerances().loss;
  const double norm_tolerance = MeshTolerances().norm;
  const std::vector<StepResult> got = Train(world, overrides);
  for (int64_t s = 0; s < kSteps; ++s) {
    EXPECT_EQ(got[s].lr, reference[s].lr) << "step " << s + 1;
    EXPECT_EQ(got[s].global_tokens, reference[s].global_tokens) << "step " << s + 1;
  }
  EXPECT_LE(MaxRelDiff(got, reference, &StepResult::loss), loss_tolerance) << "spread of one rank's orders: " << spread;
  EXPECT_LE(MaxRelDiff(got, reference, &StepResult::grad_norm), norm_tolerance);
}

TEST_P(TrainerMeshes, TrainsAsOneRank) { ExpectTrainsAsOneRank(GetParam().first, GetParam().second); }

// parallelism.pipeline_parallel_schedule_csv: a compute-only schedule from a file (PyTorch's
// _load_csv format) replaces the named one; here rank 1 runs each backward right after its
// forward, rank 0 three forwards ahead.
TEST(Trainer, ACustomCsvPipelineScheduleTrainsAsOneRank) {
  const std::string csv = fsdp::testing::NewTestPath("schedule") + ".csv";
  {
    std::ofstream out(csv);
    out << "0F0,0F1,0F2,0B0,0F3,0B1,0B2,0B3\r\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\r\n";
  }
  ExpectTrainsAsOneRank(4, {"--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=4",
                            "--parallelism.pipeline_parallel_schedule_csv=" + csv});
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, TrainerMeshes,
    ::testing::Values(
        std::make_pair(4, std::vector<std::string>{}),
        std::make_pair(4, std::vector<std::string>{"--parallelism.data_parallel_replicate_degree=2"}),
        std::make_pair(4, std::vector<std::string>{"--parallelism.tensor_parallel_degree=2",
                                                   "--training.local_batch_size=4"}),
        std::make_pair(4, std::vector<std::string>{"--parallelism.tensor_parallel_degree=2",
                                                   "--parallelism.enable_sequence_parallel=false"}),
        std::make_pair(4, std::vector<std::string>{"--training.local_batch_size=1"}),
        std::make_pair(2, std::vector<std::string>{"--activation_checkpoint.mode=full"}),
        std::make_pair(2, std::vector<std::string>{"--activation_checkpoint.mode=selective"}),
        std::make_pair(4, std::vector<std::string>{"--activation_checkpoint.mode=selective",
                                                   "--parallelism.tensor_parallel_degree=2"}),
        // Without sequence parallelism the colwise layers' inputs are Replicate, their gradients
        // Partial: an alias made for autograd in the recomputation only.
        std::make_pair(4, std::vector<std::string>{"--activation_checkpoint.mode=selective",
                                                   "--parallelism.tensor_parallel_degree=2",
                                                   "--parallelism.enable_sequence_parallel=false"}),
        std::make_pair(2, std::vector<std::string>{"--parallelism.fsdp_reshard_after_forward=never"}),
        // Pipeline parallelism (train/pipeline_llama.h): pp 2 x dp 2 with 1F1B and
        // GPipe (stages: embedding + layer 0, layer 1 + head), Interleaved1F1B and
        // ZBVZeroBubble (four stages: the embedding alone, a layer each, the head
        // alone; V placement), pp 4 with 1F1B.
        std::make_pair(4, std::vector<std::string>{"--parallelism.pipeline_parallel_degree=2",
                                                   "--training.local_batch_size=4",
                                                   "--parallelism.pipeline_parallel_microbatch_size=2"}),
        std::make_pair(4, std::vector<std::string>{"--parallelism.pipeline_parallel_degree=2",
                                                   "--parallelism.pipeline_parallel_schedule=GPipe",
                                                   "--training.local_batch_size=4"}),
        std::make_pair(4, std::vector<std::string>{"--parallelism.pipeline_parallel_degree=2",
                                                   "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                                                   "--training.local_batch_size=4"}),
        std::make_pair(4, std::vector<std::string>{"--parallelism.pipeline_parallel_degree=2",
                                                   "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble",
                                                   "--training.local_batch_size=4"}),
        std::make_pair(4, std::vector<std::string>{"--parallelism.pipeline_parallel_degree=4",
                                                   "--training.local_batch_size=8"}),
        std::make_pair(4, std::vector<std::string>{"--parallelism.pipeline_parallel_degree=2",
                                                   "--training.local_batch_size=4",
                                                   "--activation_checkpoint.mode=selective"}),
        // A zero-bubble schedule over checkpointed layers: each input half runs the whole
        // backward (PipelineStageOptions::whole_backward_in_input).
        std::make_pair(4,
                       std::vector<std::string>{"--parallelism.pipeline_parallel_degree=2",
                                                "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble",
                                                "--training.local_batch_size=4", "--activation_checkpoint.mode=full"}),
        std::make_pair(4, std::vector<std::string>{"--parallelism.pipeline_parallel_degree=2",
                                                   "--parallelism.tensor_parallel_degree=2",
                                                   "--training.local_batch_size=8",
                                                   "--parallelism.pipeline_parallel_microbatch_size=4"}),
        std::make_pair(4, std::vector<std::string>{"--parallelism.pipeline_parallel_degree=2",
                                                   "--parallelism.tensor_parallel_degree=2",
                                                   "--parallelism.enable_sequence_parallel=false",
                                                   "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
                                                   "--training.local_batch_size=8",
                                                   "--parallelism.pipeline_parallel_microbatch_size=4"}),
        std::make_pair(4, std::vector<std::string>{"--parallelism.pipeline_parallel_degree=2",
                                                   "--parallelism.tensor_parallel_degree=2",
                                                   "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble",
                                                   "--training.local_batch_size=8",
                                                   "--parallelism.pipeline_parallel_microbatch_size=4"}),
        // 3-D: pp 2 x dp 2 x tp 2 on 8 ranks.
        std::make_pair(8, std::vector<std::string>{"--parallelism.pipeline_parallel_degree=2",
                                                   "--parallelism.tensor_parallel_degree=2",
                                                   "--training.local_batch_size=4",
                                                   "--parallelism.pipeline_parallel_microbatch_size=2"}),
        // Context parallelism: cp 2 (head-tail, all-gather ring), cp 2 x dp 2 (the all-to-all
        // ring), cp 2 x tp 2, cp 4 without load balancing.
        std::make_pair(2, std::vector<std::string>{"--parallelism.context_parallel_degree=2",
                                                   "--training.local_batch_size=8"}),
        std::make_pair(4, std::vector<std::string>{"--parallelism.context_parallel_degree=2",
                                                   "--parallelism.context_parallel_rotate_method=alltoall",
                                                   "--training.local_batch_size=4"}),
        std::make_pair(4, std::vector<std::string>{"--parallelism.context_parallel_degree=2",
                                                   "--parallelism.tensor_parallel_degree=2",
                                                   "--training.local_batch_size=8"}),
        std::make_pair(4, std::vector<std::string>{"--parallelism.context_parallel_degree=4",
                                                   "--parallelism.context_parallel_load_balancer=None",
                                                   "--training.local_batch_size=8"}),
        std::make_pair(4, std::vector<std::string>{"--parallelism.context_parallel_degree=2",
                                                   "--parallelism.data_parallel_replicate_degree=2",
                                                   "--training.local_batch_size=4"}),
        std::make_pair(4, std::vector<std::string>{"--parallelism.context_parallel_degree=2",
                                                   "--parallelism.pipeline_parallel_degree=2",
                                                   "--training.local_batch_size=8",
                                                   "--parallelism.pipeline_parallel_microbatch_size=4"})),
    MeshName);

TEST(Trainer, ValidationIsTheMeanOverTheValidationSet) {
  const JobConfig config = SmallJob(
      {"--validator.enable=true", "--validator.dataset_path=train/testdata/corpus/validation", "--validator.steps=3"});
  std::vector<double> losses(4);
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainer trainer(config, pg);
    losses[pg->rank()] = trainer.Validate().loss;
    trainer.Step();
    losses[2 + pg->rank()] = trainer.Validate().loss;
  });
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_EQ(losses[2], losses[3]);
  // Untrained, the model predicts nearly uniformly over the vocabulary: about log(2048).
  EXPECT_NEAR(losses[0], std::log(2048.0), 0.5);
  EXPECT_NE(losses[2], losses[0]);
}

// Validation of a pipeline (the schedule's eval(): forwards only, the loss on the last stage),
// with one stage per rank (1F1B) and two (Interleaved1F1B): the FSDP 4 run's validation loss,
// untrained and after two steps, within two meshes' tolerances of the training losses.
TEST(Trainer, ValidatesAPipelineAsTheUnpipelinedModel) {
  const std::vector<std::string> validation = {
      "--validator.enable=true", "--validator.dataset_path=train/testdata/corpus/validation", "--validator.steps=2"};
  const auto run = [&](std::vector<std::string> overrides) {
    overrides.insert(overrides.end(), validation.begin(), validation.end());
    std::vector<double> losses(2);
    fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
      Trainer trainer(SmallJob(overrides), pg);
      const double untrained = trainer.Validate().loss;
      trainer.Step();
      trainer.Step();
      const double trained = trainer.Validate().loss;
      if (pg->rank() == 0) losses = {untrained, trained};
    });
    return losses;
  };
  const std::vector<double> want = run({});
  for (const char* schedule : {"1F1B", "Interleaved1F1B"}) {
    SCOPED_TRACE(schedule);
    const std::vector<double> got = run({"--parallelism.pipeline_parallel_degree=2", "--training.local_batch_size=4",
                                         absl::StrCat("--parallelism.pipeline_parallel_schedule=", schedule)});
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_LE(std::abs(got[i] - want[i]), 2 * MeshTolerances().loss * std::abs(want[i]))
          << (i ? "trained" : "untrained");
    }
  }
}

// model.converters = ["float8"]: every Linear but those float8.filter_fqns names, by our FQN
// ("lm_head") or torchtitan 0.3.0's ("qkv_linear.wq" is each q_proj).
TEST(Trainer, Float8ConvertsTheLinearsTorchtitansFilterKeeps) {
  const JobConfig config = SmallJob({"--model.converters=float8", "--float8.filter_fqns=lm_head,qkv_linear.wq"});
  models::llama::LlamaForCausalLM model(ResolveModelConfig(config, 1), c10::Device(c10::kMeta));
  EXPECT_EQ(ConvertFloat8(model, config), 2 * 6);  // 2 layers x (k, v, o, gate, up, down)
  EXPECT_EQ(float8::AsFloat8Linear(*model->lm_head), nullptr);
  EXPECT_EQ(float8::AsFloat8Linear(*model->model->decoder_layers[0]->self_attn->q_proj), nullptr);
  EXPECT_NE(float8::AsFloat8Linear(*model->model->decoder_layers[0]->self_attn->k_proj), nullptr);
  models::llama::LlamaForCausalLM plain(ResolveModelConfig(SmallJob({}), 1), c10::Device(c10::kMeta));
  EXPECT_EQ(ConvertFloat8(plain, SmallJob({})), 0);  // no converter named
}

// float8.emulate = true is torchtitan 0.3.0's Float8LinearConfig(emulate=True): torchao's
// default recipe (tensorwise: e5m2 gradients, no power-of-2 scales), whatever recipe_name says.
TEST(Trainer, Float8EmulateIsTorchaosDefaultRecipeEmulated) {
  for (const bool emulate : {false, true}) {
    SCOPED_TRACE(emulate);
    const JobConfig config = SmallJob({"--model.converters=float8", "--float8.recipe_name=rowwise",
                                       absl::StrCat("--float8.emulate=", emulate ? "true" : "false")});
    models::llama::LlamaForCausalLM model(ResolveModelConfig(config, 1), c10::Device(c10::kMeta));
    ASSERT_GT(ConvertFloat8(model, config), 0);
    const auto f8 = float8::AsFloat8Linear(*model->model->decoder_layers[0]->mlp->down_proj);
    ASSERT_NE(f8, nullptr);
    EXPECT_EQ(f8->config().emulate, emulate);
    EXPECT_EQ(f8->config().input.scaling_granularity,
              emulate ? float8::ScalingGranularity::kTensorwise : float8::ScalingGranularity::kAxiswise);
    EXPECT_EQ(*f8->config().grad_output.target_dtype, emulate ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn);
    EXPECT_EQ(f8->config().round_scales_to_power_of_2, !emulate);
  }
}

// Tensorwise float8 linears under tensor parallelism take torchao's float8 styles, as
// torchtitan's apply_tp did with enable_float8_tensorwise_tp: each layer's two
// sequence-parallel all-gathers of activations (self_attn's and mlp's inputs) and two of
// output gradients (o_proj's, down_proj's) move float8 bytes. The rowwise recipe keeps the
// generic styles (torchao's float8 styles assume tensorwise scales).
TEST(Trainer, TensorwiseFloat8UnderTensorParallelGathersFloat8) {
  for (const std::string recipe : {"tensorwise", "rowwise"}) {
    SCOPED_TRACE(recipe);
    const JobConfig config = SmallJob(
        {"--model.converters=float8", "--float8.recipe_name=" + recipe, "--parallelism.tensor_parallel_degree=2"});
    fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
      auto trace = std::make_shared<comm::CommTrace>(pg);
      Trainer trainer(config, trace);
      trace->clear();
      trainer.Step();
      int64_t float8_gathers = 0;
      for (const comm::CollectiveRecord& r : trace->all_records()) {
        // A whole micro-batch's activation: local_batch_size 2 x seq_len 32 x dim 64.
        float8_gathers += r.op == "all_gather_into_tensor" && r.dtype == at::kByte && r.output_numel == 2 * 32 * 64;
      }
      // 4 micro-batches (global batch 8, local 2, dp 1) x 2 layers x 4 all-gathers.
      EXPECT_EQ(float8_gathers, recipe == "tensorwise" ? 4 * 2 * 4 : 0);
    });
  }
}

// The float8 styles under selective activation checkpointing (the forward without grad, the
// recomputation with it) train as without checkpointing.
TEST(Trainer, TensorwiseFloat8StylesTrainUnderSelectiveCheckpointing) {
  const std::vector<std::string> float8_tp = {"--model.converters=float8", "--float8.recipe_name=tensorwise",
                                              "--parallelism.tensor_parallel_degree=2"};
  std::vector<std::string> selective = float8_tp;
  selective.push_back("--activation_checkpoint.mode=selective");
  const std::vector<StepResult> want = Train(2, float8_tp);
  const std::vector<StepResult> got = Train(2, selective);
  EXPECT_LE(MaxRelDiff(got, want, &StepResult::loss), MeshTolerances().loss);
  EXPECT_LE(MaxRelDiff(got, want, &StepResult::grad_norm), MeshTolerances().norm);
}

// Context parallelism is what lets a sequence longer than a rank's memory train: a step's peak
// on one rank at 8x the sequence exceeds the allowance one rank needs at 1x (its peak plus a
// quarter), and at cp 8 the 8x sequence trains with every rank within that allowance (each
// holds an eighth of the tokens' activations and, with FSDP over dp_shard x cp, an eighth of
// the parameters and optimizer state). Counted per rank thread (testing/allocation_counter.h),
// over the trainer's construction and two steps.
TEST(Trainer, ContextParallelTrainsEightTimesTheSequenceInOneRanksAllowance) {
  testing::ScopedAllocationCounter::Install();
  auto peaks = [](int world, const std::vector<std::string>& overrides) {
    const JobConfig config = SmallJob(overrides);
    std::vector<int64_t> peak(world, 0);
    fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, world, [&](const comm::ProcessGroupPtr& pg) {
      testing::ScopedAllocationCounter counter;
      Trainer trainer(config, pg);
      trainer.Step();
      trainer.Step();
      peak[pg->rank()] = counter.peak();
    });
    return peak;
  };
  const int64_t allowance = peaks(1, {"--training.local_batch_size=8"})[0] * 5 / 4;
  const int64_t long_one_rank = peaks(1, {"--training.local_batch_size=8", "--training.seq_len=256"})[0];
  EXPECT_GT(long_one_rank, allowance);
  const std::vector<int64_t> long_cp8 =
      peaks(8, {"--training.local_batch_size=8", "--training.seq_len=256", "--parallelism.context_parallel_degree=8"});
  for (int r = 0; r < 8; ++r) EXPECT_LE(long_cp8[r], allowance) << "rank " << r;
  std::printf("peak bytes: one rank at seq 32 %ld (allowance %ld), at seq 256 %ld; cp 8 at seq 256, rank 0 %ld\n",
              static_cast<long>(allowance * 4 / 5), static_cast<long>(allowance), static_cast<long>(long_one_rank),
              static_cast<long>(long_cp8[0]));
}

TEST(Trainer, BadJobsNameTheirKeyBeforeTraining) {
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 4, [](const comm::ProcessGroupPtr& pg) {
    EXPECT_ERROR_CONTAINS(Trainer(SmallJob({"--parallelism.tensor_parallel_degree=4", "--model.n_kv_heads=2"}), pg),
                          "model.n_kv_heads = 2 is not divisible by parallelism.tensor_parallel_degree = 4");
    EXPECT_ERROR_CONTAINS(
        Trainer(SmallJob({"--parallelism.tensor_parallel_degree=4", "--model.vocab_size=2050", "--model.n_kv_heads=4"}),
                pg),
        "model.vocab_size = 2050 is not divisible by parallelism.tensor_parallel_degree = 4");
    EXPECT_ERROR_CONTAINS(Trainer(SmallJob({"--model.vocab_size=1000"}), pg),
                          "the tokenizer's vocab_size 2048 exceeds the model's 1000");
    EXPECT_ERROR_CONTAINS(Trainer(SmallJob({"--dataloader.dataset_path=/nonexistent/data"}), pg), "/nonexistent/data");
    EXPECT_ERROR_CONTAINS(Trainer(SmallJob({"--activation_checkpoint.mode=selective",
                                            "--activation_checkpoint.force_recompute_mm_shapes_by_fqns=self_attn"}),
                                  pg),
                          "force_recompute_mm_shapes_by_fqns matches model.layers.0.self_attn, which is no Linear");
    EXPECT_ERROR_CONTAINS(Trainer(SmallJob({"--model.flavor=7B"}), pg), "model.flavor = \"7B\"");
    EXPECT_ERROR_CONTAINS(Trainer(SmallJob({"--model.n_heads=3"}), pg),
                          "model.dim = 64 is not divisible by model.n_heads = 3");
    EXPECT_ERROR_CONTAINS(Trainer(SmallJob({"--parallelism.data_parallel_shard_degree=2"}), pg),
                          "not the world size 4");
  });
}

TEST(Trainer, ANonFiniteGradientStopsTheStepNamingTheParameter) {
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 2, [](const comm::ProcessGroupPtr& pg) {
    Trainer trainer(SmallJob({}), pg);
    trainer.Step();
    {
      at::NoGradGuard no_grad;
      trainer.model()->named_parameters()["model.norm.weight"].fill_(std::numeric_limits<float>::infinity());
    }
    EXPECT_ERROR_CONTAINS(trainer.Step(), "NaN or Inf");
  });
}

}  // namespace
}  // namespace fsdp::train

namespace fsdp::train {
namespace {

// [model] flavor = "": the model of hf_assets_path's config.json (models/llama/hf_config.h),
// then [model]'s overrides and the tensor-parallel checks as for a flavor.
TEST(ResolveModelConfig, AHuggingFaceDirectoryGivesTheModel) {
  const std::string dir = fsdp::testing::NewTestPath("hf_model");
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json")
      << R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 160,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
             "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})";
  const auto job = [&](const std::vector<std::string>& more) {
    std::vector<std::string> args = {"--model.flavor=", "--hf_assets_path=" + dir};
    args.insert(args.end(), more.begin(), more.end());
    return ParseConfig("", "test", ParseCommandLine(args).overrides);
  };
  const models::llama::LlamaConfig c = ResolveModelConfig(job({"--model.n_layers=3"}), 1);
  EXPECT_EQ(c.vocab_size, 256);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.intermediate_size, 160);
  EXPECT_EQ(c.num_hidden_layers, 3);  // the override
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.rope_theta, 500000.0);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->factor, 8.0);
  EXPECT_EQ(c.attention, models::llama::AttentionKernel::kSdpa);
  EXPECT_ERROR_CONTAINS(ResolveModelConfig(job({}), 4),
                        "model.n_kv_heads = 2 is not divisible by parallelism.tensor_parallel_degree = 4");
  EXPECT_ERROR_CONTAINS(ResolveModelConfig(ParseConfig("", "test", ParseCommandLine({"--model.flavor="}).overrides), 1),
                        "model.flavor is empty and hf_assets_path is not set");
  EXPECT_ERROR_CONTAINS(
      ResolveModelConfig(
          ParseConfig("", "test", ParseCommandLine({"--model.flavor=", "--hf_assets_path=/nonexistent"}).overrides), 1),
      "/nonexistent/config.json");
}

}  // namespace
}  // namespace fsdp::train

namespace fsdp::train {
namespace {

// checkpoint.enable + last_save_in_hf: the trained model in Hugging Face's layout, with
// hf_assets_path's other files beside it; a new job that starts from the export has the
// trained model's validation loss.
TEST(Trainer, ExportsInHuggingFacesLayoutAndAJobStartsFromIt) {
  const std::string assets = fsdp::testing::NewTestPath("assets"), dump = fsdp::testing::NewTestPath("dump");
  std::filesystem::create_directories(assets);
  std::ofstream(assets + "/tokenizer_config.json") << "{}";
  const std::vector<std::string> validation = {
      "--validator.enable=true", "--validator.dataset_path=train/testdata/corpus/validation", "--validator.steps=2"};
  std::vector<std::string> first = {"--training.steps=2", "--checkpoint.enable=true",
                                    "--checkpoint.last_save_in_hf=true", "--hf_assets_path=" + assets,
                                    "--dump_folder=" + dump};
  first.insert(first.end(), validation.begin(), validation.end());
  double trained = 0, reloaded = 0;
  std::string exported;
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainer trainer(SmallJob(first), pg);
    std::ostringstream log;
    trainer.Train(log);
    if (pg->rank() == 0) {
      trained = trainer.Validate().loss;
      exported = trainer.ExportDirectory();
    } else {
      trainer.Validate();
    }
  });
  EXPECT_EQ(exported, dump + "/checkpoint/step-2");
  EXPECT_TRUE(std::filesystem::exists(exported + "/model.safetensors.index.json"));
  EXPECT_TRUE(std::filesystem::exists(exported + "/tokenizer_config.json"));  // copied from hf_assets_path
  std::vector<std::string> second = {"--checkpoint.initial_load_path=" + exported,
                                     "--checkpoint.initial_load_in_hf=true"};
  second.insert(second.end(), validation.begin(), validation.end());
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainer trainer(SmallJob(second), pg);
    const double loss = trainer.Validate().loss;
    if (pg->rank() == 0) reloaded = loss;
  });
  EXPECT_EQ(reloaded, trained);  // the same float32 weights, the same evaluation
}

}  // namespace
}  // namespace fsdp::train

namespace fsdp::train {
namespace {

// //metrics' FLOPs count, as the trainer feeds it, equals torchtitan's own for every flavor and
// sequence length (models/llama/testdata/golden_llama3_flavors.txt, from
// Llama3Model.Config.get_nparams_and_flops).
TEST(TorchtitanFlopsPerToken, IsTorchtitansCount) {
  int checked = 0;
  for (const auto& f : fsdp::testing::ReadGoldenFile("models/llama/testdata/golden_llama3_flavors.txt")) {
    if (f[0] != "flops") continue;
    SCOPED_TRACE(f[1] + " seq_len " + f[2]);
    EXPECT_EQ(TorchtitanFlopsPerToken(models::llama::Llama3Flavor(f[1]), fsdp::testing::GoldenInt(f[2])),
              static_cast<double>(fsdp::testing::GoldenInt(f[4])));
    ++checked;
  }
  EXPECT_EQ(checked, 18);
}

// The peak FLOP/s MFU divides by on a CUDA device equals torchtitan's get_peak_flops for each
// device name of train/testdata/golden_peak_flops.txt (testing/golden/gen_train.py).
TEST(TorchtitanPeakFlops, IsTorchtitansForEachDeviceName) {
  int checked = 0;
  for (const auto& f : fsdp::testing::ReadGoldenFile("train/testdata/golden_peak_flops.txt")) {
    if (f[0] != "peak_flops") continue;
    EXPECT_EQ(TorchtitanPeakFlops(f[1]), fsdp::testing::GoldenNum(f[2])) << f[1];
    ++checked;
  }
  EXPECT_EQ(checked, 21);
}

}  // namespace
}  // namespace fsdp::train

namespace fsdp::train {
namespace {

// The trainer builds on the meta device and initializes after sharding (FSDP 2 x TP 2 here):
// the gathered weights are bitwise those of models::llama::InitWeightsTorchtitan on one
// unsharded model with the same seed.
TEST(Trainer, MetaInitAfterShardingIsTheUnshardedInit) {
  const JobConfig config = SmallJob({"--parallelism.tensor_parallel_degree=2", "--debug.seed=11"});
  models::llama::LlamaForCausalLM reference(ResolveModelConfig(config, 1));
  models::llama::InitWeightsTorchtitan(*reference, 11);
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 4, [&](const comm::ProcessGroupPtr& pg) {
    Trainer trainer(config, pg);
    const auto full = fsdp2::GetFullStateDict(*trainer.model());
    if (pg->rank() != 0) return;
    const auto ref = reference->named_parameters();
    EXPECT_EQ(full.size(), ref.size());
    for (const auto& item : ref) {
      const at::Tensor* got = full.find(item.key());
      ASSERT_NE(got, nullptr) << item.key();
      EXPECT_TRUE(at::equal(*got, item.value())) << item.key();
    }
  });
}

// torchtitan's apply_fsdp groups: the embedding, each block, the final norm with the head (so
// their gradients are reduced and their unsharded weights freed right after their backward,
// not at the end of it with the root's), and the root with nothing of its own.
TEST(Trainer, FsdpGroupsAreTorchtitans) {
  const JobConfig config = SmallJob({});
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 2, [&](const comm::ProcessGroupPtr& pg) {
    Trainer trainer(config, pg);
    std::vector<std::vector<std::string>> groups;
    for (const fsdp2::FSDPGroupInfo& g : fsdp2::ListFSDPGroups(*trainer.model())) {
      if (!g.params.empty()) groups.push_back(g.module_fqns);
    }
    const std::vector<std::vector<std::string>> expected = {
        {"model.embed_tokens"}, {"model.layers.0"}, {"model.layers.1"}, {"model.norm", "lm_head"}};
    EXPECT_EQ(groups, expected);
  });
}

}  // namespace
}  // namespace fsdp::train

namespace fsdp::train {
namespace {

// dataloader.infinite = false: the job ends when one pass over the data cannot fill another
// global batch, as torchtitan's ends on DataloaderExhaustedError.
TEST(Trainer, AFinitePassEndsTheJobWhenTheDataRunsOut) {
  // The training split holds 110 windows of 512 tokens: 3 global batches of 32.
  const JobConfig config = SmallJob({"--dataloader.infinite=false", "--training.steps=1000", "--training.seq_len=512",
                                     "--training.local_batch_size=32", "--training.global_batch_size=32"});
  int64_t steps = 0, windows = 0;
  std::string log_text;
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 1, [&](const comm::ProcessGroupPtr& pg) {
    Trainer trainer(config, pg);
    windows = trainer.data_loader().stream().windows_per_epoch();
    std::ostringstream log;
    trainer.Train(log);
    steps = trainer.step();
    log_text = log.str();
  });
  EXPECT_EQ(steps, windows / 32);
  EXPECT_NE(log_text.find("the data ran out (dataloader.infinite = false) after step " + std::to_string(windows / 32)),
            std::string::npos)
      << log_text;
}

}  // namespace
}  // namespace fsdp::train

namespace fsdp::train {
namespace {

TEST(Trainer, DebugDeterministicTurnsOnDeterministicAlgorithms) {
  ASSERT_FALSE(at::globalContext().deterministicAlgorithms());
  fsdp::testing::RunOnRanks(fsdp::testing::Backend::kThreaded, 1, [&](const comm::ProcessGroupPtr& pg) {
    Trainer trainer(SmallJob({"--debug.deterministic"}), pg);
    EXPECT_TRUE(at::globalContext().deterministicAlgorithms());
    trainer.Step();  // the CPU kernels it runs have deterministic versions
  });
  at::globalContext().setDeterministicAlgorithms(false, false);
}

}  // namespace
}  // namespace fsdp::train
