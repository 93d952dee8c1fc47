// The job config (train/config.h): torchtitan's defaults and key names (read from torchtitan
// itself: testdata/golden_config_defaults.toml, testing/golden/gen_train.py), TOML round trips,
// torchtitan's dotted overrides, and one error naming the key and value for each bad input.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "testing/expect_error.h"
#include "train/config.h"

namespace fsdp::train {
namespace {

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

JobConfig Parse(std::string_view toml, const std::vector<std::string>& args = {}) {
  return ParseConfig(toml, "test.toml", ParseCommandLine(args).overrides);
}

// Every key torchtitan has, with torchtitan's default: parsing torchtitan's values over our
// defaults changes nothing (and an unknown name in the golden file, a key torchtitan spells
// differently, is an error).
TEST(JobConfig, DefaultsAndKeyNamesAreTorchtitans) {
  const std::string golden = ReadText("train/testdata/golden_config_defaults.toml");
  ASSERT_TRUE(absl::StrContains(golden, "[training]"));
  EXPECT_EQ(PrintConfig(ParseConfig(golden, "golden_config_defaults.toml")), PrintConfig(JobConfig{}));
}

TEST(JobConfig, PrintedConfigReadsBackToTheSameConfig) {
  JobConfig config;
  config.hf_assets_path = "assets/\"quoted\"\\dir";
  config.model.flavor = "8B";
  config.model.n_layers = 3;
  config.model.norm_eps = 1e-6;
  config.model.enable_weight_tying = true;
  config.optimizer.lr = 3e-4;
  config.optimizer.betas = {0.8, 0.999};
  config.lr_scheduler.decay_ratio = 0.25;
  config.lr_scheduler.decay_type = LRDecayType::kCosine;
  config.training.max_norm = 0.1 + 0.2;  // not a short decimal: the shortest round trip
  config.training.mixed_precision_param = DType::kFloat32;
  config.parallelism.fsdp_reshard_after_forward = ReshardAfterForward::kNever;
  config.activation_checkpoint.mode = ActivationCheckpointMode::kFull;
  config.checkpoint.exclude_from_loading = {"optimizer", "lr_scheduler"};
  config.checkpoint.async_mode = AsyncMode::kAsyncWithPinnedMem;
  config.debug.seed = 7;
  const std::string printed = PrintConfig(config);
  const JobConfig read = Parse(printed);
  EXPECT_EQ(PrintConfig(read), printed);
  EXPECT_EQ(read.training.max_norm, 0.1 + 0.2);
  EXPECT_EQ(read.hf_assets_path, config.hf_assets_path);
  EXPECT_EQ(read.model.n_layers, 3);
  EXPECT_FALSE(read.model.dim.has_value());
  EXPECT_TRUE(absl::StrContains(printed, "# dim = (unset)")) << printed;
}

TEST(JobConfig, TomlValuesSetTheirFields) {
  const JobConfig c = Parse(R"(
dump_folder = "/tmp/run"
[training]
steps = 20
max_norm = 2          # an integer where a float is expected
[parallelism]
tensor_parallel_degree = 2
enable_sequence_parallel = false
[lr_scheduler]
decay_type = "sqrt"
)");
  EXPECT_EQ(c.dump_folder, "/tmp/run");
  EXPECT_EQ(c.training.steps, 20);
  EXPECT_EQ(c.training.max_norm, 2.0);
  EXPECT_EQ(c.parallelism.tensor_parallel_degree, 2);
  EXPECT_FALSE(c.parallelism.enable_sequence_parallel);
  EXPECT_EQ(c.lr_scheduler.decay_type, LRDecayType::kSqrt);
  EXPECT_EQ(c.training.seq_len, 2048);  // untouched: the default
}

// torchtitan's (tyro's) forms: --a.b=v, --a.b v, a bare boolean flag, None for an optional.
TEST(JobConfig, DottedOverridesApplyInOrderAfterTheFile) {
  const JobConfig c =
      Parse("[training]\nsteps = 5\n[debug]\nseed = 3\n",
            {"--training.steps=20", "--training.seq_len", "512", "--debug.deterministic", "--debug.seed", "None",
             "--optimizer.betas", "[0.5, 0.6]", "--lr_scheduler.decay_ratio=0.5", "--dump_folder=out",
             "--checkpoint.exclude_from_loading=a,b", "--training.global_batch_size", "-1", "--training.steps=21"});
  EXPECT_EQ(c.training.steps, 21);
  EXPECT_EQ(c.training.seq_len, 512);
  EXPECT_TRUE(c.debug.deterministic);
  EXPECT_FALSE(c.debug.seed.has_value());
  EXPECT_EQ(c.optimizer.betas[0], 0.5);
  EXPECT_EQ(c.optimizer.betas[1], 0.6);
  EXPECT_EQ(c.lr_scheduler.decay_ratio, 0.5);
  EXPECT_EQ(c.dump_folder, "out");
  EXPECT_EQ(c.checkpoint.exclude_from_loading, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(c.training.global_batch_size, -1);
}

TEST(JobConfig, CommandLineNamesTheFileAndPrintConfig) {
  const CommandLine a = ParseCommandLine({"--config", "f.toml", "--print-config", "--training.steps=3"});
  EXPECT_EQ(a.config_file, "f.toml");
  EXPECT_TRUE(a.print_config);
  ASSERT_EQ(a.overrides.size(), 1u);
  EXPECT_EQ(a.overrides[0].key, "training.steps");
  EXPECT_EQ(ParseCommandLine({"--config=g.toml"}).config_file, "g.toml");
  EXPECT_EQ(ParseCommandLine({"--nproc", "4"}).nproc, 4);
  EXPECT_EQ(ParseCommandLine({"--nproc=2"}).nproc, 2);
  EXPECT_ERROR_CONTAINS(ParseCommandLine({"--nproc", "two"}), "--nproc needs a number of processes");
  EXPECT_ERROR_CONTAINS(ParseCommandLine({"stray"}), "unexpected argument \"stray\"");
  EXPECT_ERROR_CONTAINS(ParseCommandLine({"--config"}), "--config needs a file");
  EXPECT_ERROR_CONTAINS(LoadConfig(ParseCommandLine({"--config=/nonexistent/x.toml"})),
                        "--config /nonexistent/x.toml: cannot be read");
}

TEST(JobConfig, EachBadInputIsOneErrorNamingTheKeyAndValue) {
  EXPECT_ERROR_CONTAINS(Parse("[training]\nstepz = 3\n"), "test.toml:2:9: unknown key training.stepz");
  EXPECT_ERROR_CONTAINS(Parse("[training]\nstepz = 3\n"), "the keys of [training]: local_batch_size");
  EXPECT_ERROR_CONTAINS(Parse("[trainnig]\nsteps = 3\n"), "unknown table [trainnig]");
  EXPECT_ERROR_CONTAINS(Parse("stray = 1\n"), "unknown key stray (top-level keys");
  EXPECT_ERROR_CONTAINS(Parse("[training]\n[training.inner]\nx = 1\n"), "unknown key training.inner");
  EXPECT_ERROR_CONTAINS(Parse("[training]\nsteps = \"20\"\n"),
                        "training.steps = \"20\" must be an integer, not a string");
  EXPECT_ERROR_CONTAINS(Parse("[training]\nsteps = 2.5\n"), "training.steps = 2.5 must be an integer, not a float");
  EXPECT_ERROR_CONTAINS(Parse("[optimizer]\nbetas = [0.9]\n"), "optimizer.betas = [0.9] must have two numbers");
  EXPECT_ERROR_CONTAINS(Parse("[optimizer]\nbetas = [0.9, \"x\"]\n"), "must be an array of two numbers");
  EXPECT_ERROR_CONTAINS(Parse("[optimizer]\nname = \"SGD\"\n"), "optimizer.name = \"SGD\" is not one of AdamW");
  EXPECT_ERROR_CONTAINS(ValidateConfig(Parse("[parallelism]\ncontext_parallel_degree = 3\n"), 4),
                        "the world size 4 is not a multiple of data_parallel_replicate_degree * "
                        "context_parallel_degree * tensor_parallel_degree * pipeline_parallel_degree = 3");
  EXPECT_ERROR_CONTAINS(
      ValidateConfig(Parse("[parallelism]\ncontext_parallel_degree = 4\n[training]\nseq_len = 20\n"), 4),
      "training.seq_len = 20 is not divisible by 8 (2 x parallelism.context_parallel_degree");
  EXPECT_ERROR_CONTAINS(ValidateConfig(Parse("[parallelism]\ncontext_parallel_load_balancer = \"ptrr\"\n"), 1),
                        "parallelism.context_parallel_load_balancer = \"ptrr\": \"headtail\" or None");
  EXPECT_ERROR_CONTAINS(ValidateConfig(Parse("[parallelism]\ncontext_parallel_rotate_method = \"ring\"\n"), 1),
                        "context_parallel_rotate_method = \"ring\" is not one of allgather, alltoall");
  EXPECT_ERROR_CONTAINS(ValidateConfig(Parse("[model]\nconverters = [\"mx\"]\n"), 1),
                        "model.converters: unknown converter \"mx\"");
  EXPECT_ERROR_CONTAINS(Parse("[float8]\nrecipe_name = \"colwise\"\n"),
                        "float8.recipe_name = \"colwise\" is not one of");
  EXPECT_ERROR_CONTAINS(
      ValidateConfig(Parse("[float8]\nenable_fsdp_float8_all_gather = true\n"), 1),
      "float8.enable_fsdp_float8_all_gather = true needs float8.recipe_name = \"tensorwise\" (torchao "
      "all-gathers float8 weights with tensorwise scales only), got \"rowwise\"");
  EXPECT_ERROR_CONTAINS(
      ValidateConfig(Parse("[float8]\nrecipe_name = \"tensorwise\"\nprecompute_float8_dynamic_scale_for_fsdp = true\n"),
                     1),
      "float8.precompute_float8_dynamic_scale_for_fsdp = true needs "
      "float8.enable_fsdp_float8_all_gather = true");
  EXPECT_ERROR_CONTAINS(Parse("[lr_scheduler]\ndecay_type = \"exp\"\n"),
                        "lr_scheduler.decay_type = \"exp\" is not one of linear, sqrt, cosine");
  EXPECT_ERROR_CONTAINS(Parse("[training]\nmixed_precision_reduce = \"bfloat16\"\n"), "is not one of float32");
  EXPECT_ERROR_CONTAINS(Parse("[training\nsteps = 1\n"), "test.toml:1:10: not TOML");
  EXPECT_ERROR_CONTAINS(Parse("", {"--training.stepz=3"}), "--training.stepz: unknown key training.stepz");
  EXPECT_ERROR_CONTAINS(Parse("", {"--training.steps=ten"}), "--training.steps: \"ten\" is not an integer");
  EXPECT_ERROR_CONTAINS(Parse("", {"--training.steps=3x"}), "\"3x\" is not an integer");
  EXPECT_ERROR_CONTAINS(Parse("", {"--training.max_norm=1.0.0"}), "\"1.0.0\" is not a number");
  EXPECT_ERROR_CONTAINS(Parse("", {"--training.steps"}), "--training.steps: needs a value");
  EXPECT_ERROR_CONTAINS(Parse("", {"--debug.deterministic=yes"}), "\"yes\" is not a boolean");
  EXPECT_ERROR_CONTAINS(Parse("", {"--training.seq_len=None"}), "\"None\" is not an integer");
  EXPECT_ERROR_CONTAINS(Parse("", {"--parallelism.fsdp_reshard_after_forward=sometimes"}),
                        "is not one of default, always, never");
}

TEST(ValidateConfig, PipelineDegreesSchedulesAndMicrobatches) {
  JobConfig c;
  c.training.local_batch_size = 4;
  c.parallelism.pipeline_parallel_degree = 2;
  const ResolvedDegrees d = ValidateConfig(c, 8);
  EXPECT_EQ(d.pp, 2);
  EXPECT_EQ(d.dp_shard, 4);
  EXPECT_ERROR_CONTAINS(ValidateConfig(c, 7),
                        "is not a multiple of data_parallel_replicate_degree * context_parallel_degree * "
                        "tensor_parallel_degree * pipeline_parallel_degree = 2");
  JobConfig bad = c;
  bad.parallelism.data_parallel_shard_degree = 2;
  EXPECT_ERROR_CONTAINS(
      ValidateConfig(bad, 8),
      "pipeline_parallel_degree (2) * data_parallel_replicate_degree (1) * data_parallel_shard_degree "
      "(2) * context_parallel_degree (1) * tensor_parallel_degree (1) = 4, not the world size 8");
  bad = c;
  bad.parallelism.pipeline_parallel_schedule = "Zigzag";
  EXPECT_ERROR_CONTAINS(ValidateConfig(bad, 8), "parallelism.pipeline_parallel_schedule = \"Zigzag\"");
  bad = c;
  bad.parallelism.pipeline_parallel_microbatch_size = 3;
  EXPECT_ERROR_CONTAINS(ValidateConfig(bad, 8), "parallelism.pipeline_parallel_microbatch_size = 3");
  bad = c;
  bad.parallelism.pipeline_parallel_schedule_csv = "/nonexistent/schedule.csv";
  EXPECT_ERROR_CONTAINS(ValidateConfig(bad, 8), "\"/nonexistent/schedule.csv\" does not exist");
  bad = c;
  bad.parallelism.pipeline_parallel_degree = 0;
  EXPECT_ERROR_CONTAINS(ValidateConfig(bad, 8), "parallelism.pipeline_parallel_degree = 0 must be at least 1");
}

TEST(ValidateConfig, ResolvesTheShardDegreeAndGradientAccumulation) {
  JobConfig c;
  c.training.local_batch_size = 2;
  c.parallelism.data_parallel_replicate_degree = 2;
  c.parallelism.tensor_parallel_degree = 2;
  ResolvedDegrees d = ValidateConfig(c, 8);
  EXPECT_EQ(d.dp_shard, 2);
  EXPECT_EQ(d.dp(), 4);
  EXPECT_EQ(d.global_batch_size, 8);
  EXPECT_EQ(d.gradient_accumulation_steps, 1);
  c.training.global_batch_size = 24;
  d = ValidateConfig(c, 8);
  EXPECT_EQ(d.gradient_accumulation_steps, 3);
}

TEST(ValidateConfig, BadValuesNameTheirKey) {
  const auto with = [](auto change) {
    JobConfig c;
    change(c);
    return c;
  };
  EXPECT_ERROR_CONTAINS(ValidateConfig(with([](JobConfig& c) { c.parallelism.data_parallel_shard_degree = 3; }), 4),
                        "data_parallel_replicate_degree (1) * data_parallel_shard_degree (3) * context_parallel_degree "
                        "(1) * tensor_parallel_degree (1) = 3, not the world size 4");
  EXPECT_ERROR_CONTAINS(ValidateConfig(with([](JobConfig& c) { c.parallelism.tensor_parallel_degree = 3; }), 4),
                        "data_parallel_shard_degree = -1: the world size 4 is not a multiple of");
  EXPECT_ERROR_CONTAINS(ValidateConfig(with([](JobConfig& c) { c.parallelism.data_parallel_shard_degree = 0; }), 4),
                        "parallelism.data_parallel_shard_degree = 0 must be -1 or at least 1");
  EXPECT_ERROR_CONTAINS(ValidateConfig(with([](JobConfig& c) { c.training.global_batch_size = 20; }), 4),
                        "training.global_batch_size = 20 is not a multiple of local_batch_size * data-parallel "
                        "degree = 8 * 4 = 32");
  EXPECT_ERROR_CONTAINS(ValidateConfig(with([](JobConfig& c) { c.training.seq_len = 0; }), 1),
                        "training.seq_len = 0 must be at least 1");
  EXPECT_ERROR_CONTAINS(ValidateConfig(with([](JobConfig& c) { c.training.max_norm = 0; }), 1),
                        "training.max_norm = 0 must be finite and greater than 0");
  EXPECT_ERROR_CONTAINS(ValidateConfig(with([](JobConfig& c) {
                                         c.optimizer.betas = {0.9, 1.0};
                                       }),
                                       1),
                        "optimizer.betas = [0.9, 1]: each must be in [0, 1)");
  EXPECT_ERROR_CONTAINS(ValidateConfig(with([](JobConfig& c) { c.optimizer.lr = -1; }), 1),
                        "optimizer.lr = -1 must be finite and at least 0");
  EXPECT_ERROR_CONTAINS(ValidateConfig(with([](JobConfig& c) { c.lr_scheduler.warmup_steps = -2; }), 1),
                        "warmup_steps");
  EXPECT_ERROR_CONTAINS(ValidateConfig(with([](JobConfig& c) { c.metrics.log_freq = 0; }), 1),
                        "metrics.log_freq = 0 must be at least 1");
  EXPECT_ERROR_CONTAINS(ValidateConfig(with([](JobConfig& c) { c.comm.train_timeout_seconds = 0; }), 1),
                        "comm.train_timeout_seconds = 0 must be at least 1");
  EXPECT_ERROR_CONTAINS(ValidateConfig(with([](JobConfig& c) { c.checkpoint.keep_latest_k = 1; }), 1),
                        "checkpoint.keep_latest_k = 1 must be 0 (keep every checkpoint) or at least 2");
}

TEST(JobConfig, ShippedConfigsReadAndValidate) {
  for (const std::string path : {"train/configs/debugmodel.toml", "train/configs/demo.toml"}) {
    SCOPED_TRACE(path);
    const JobConfig c = LoadConfig(ParseCommandLine({"--config", path}));
    const ResolvedDegrees d = ValidateConfig(c, 4);
    EXPECT_EQ(d.dp() * d.tp, 4);
  }
}

}  // namespace
}  // namespace fsdp::train
