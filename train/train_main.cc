// The `train` program: torchtitan's `torchtitan/train.py` for the Llama-3 job of a TOML config.
//
//   ./x run -n 4 bazel-bin/train/train --config train/configs/debugmodel.toml [--training.steps=20]
//   bazel run //train -- --config train/configs/debugmodel.toml --print-config
//
// Launched by torchrun or `./x run` (the torchrun environment: RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT) it trains on Gloo over every rank; without that environment, on one process.
// The config is read and validated on every rank before any process group or tensor exists,
// so a bad key or value is one error line per rank (comm::RunMain) and exit status 1.
// Relative paths are the caller's: under `bazel run` the program first changes to
// BUILD_WORKING_DIRECTORY. docs/guide/train.md.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "comm/gloo_process_group.h"
#include "comm/main_guard.h"
#include "comm/torchrun_env.h"
#include "train/config.h"
#include "train/trainer.h"

namespace {

constexpr char kUsage[] =
    "usage: train --config FILE [--section.key=VALUE ...] [--print-config]\n"
    "  Trains the Llama-3 job of a TOML config (docs/guide/train.md); --section.key=VALUE\n"
    "  overrides a key of the file (torchtitan's dotted form); --print-config prints the\n"
    "  resolved config as TOML and exits.\n";

bool HasTorchrunEnv() { return std::getenv("RANK") != nullptr || std::getenv("WORLD_SIZE") != nullptr; }

int Run(int argc, char** argv) {
  if (const char* dir = std::getenv("BUILD_WORKING_DIRECTORY")) std::filesystem::current_path(dir);
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() == 1 && (args[0] == "--help" || args[0] == "-h")) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  const fsdp::train::CommandLine command_line = fsdp::train::ParseCommandLine(args);
  const fsdp::train::JobConfig config = fsdp::train::LoadConfig(command_line);
  if (command_line.print_config) {
    std::cout << fsdp::train::PrintConfig(config);
    return 0;
  }
  const bool distributed = HasTorchrunEnv();
  const fsdp::comm::TorchrunEnv env = distributed ? fsdp::comm::ReadTorchrunEnv() : fsdp::comm::TorchrunEnv{};
  fsdp::train::ValidateConfig(config, env.world_size);  // before any process group
  // torchtitan's init_distributed: the flight recorder's size from comm.trace_buf_size, its
  // dumps under dump_folder/comm_traces/rank_<r> (comm/flight_recorder.h reads both once, at
  // the first process group).
  const auto set_env = [&](const char* name, const std::string& value) {
    if (const char* old = std::getenv(name); old != nullptr && value != old && env.rank == 0) {
      std::fprintf(stderr, "train: %s=%s is overridden to %s by the config\n", name, old, value.c_str());
    }
    ::setenv(name, value.c_str(), 1);
  };
  set_env("TORCH_FR_BUFFER_SIZE", std::to_string(config.comm.trace_buf_size));
  if (config.comm.trace_buf_size > 0) {
    const std::filesystem::path traces = std::filesystem::path(config.dump_folder) / "comm_traces";
    std::filesystem::create_directories(traces);
    set_env("TORCH_FR_DUMP_TEMP_FILE", (traces / "rank_").string());
  }

  const fsdp::comm::GlooOptions gloo{
      .timeout = std::chrono::seconds(std::max(config.comm.init_timeout_seconds, config.comm.train_timeout_seconds))};
  fsdp::comm::ProcessGroupPtr world;
  if (distributed) {
    world = fsdp::comm::CreateGlooProcessGroupWithTcpStore(env, gloo);
  } else {
    const std::filesystem::path store =
        std::filesystem::temp_directory_path() / ("fsdp_train_store_" + std::to_string(getpid()));
    std::filesystem::remove(store);
    world = fsdp::comm::CreateGlooProcessGroupWithFileStore(store.string(), 0, 1, gloo);
  }
  fsdp::train::Trainer trainer(config, world);
  if (world->rank() == 0) {
    const auto& d = trainer.degrees();
    const auto& m = trainer.model_config();
    std::printf(
        "train: llama3 %s (dim %ld, %ld layers, %ld heads / %ld kv heads, vocab %ld, ffn %ld) on %d ranks: "
        "dp_replicate %ld x dp_shard %ld x tp %ld; global batch %ld (local %ld, accumulation %ld) x seq_len %ld; "
        "%ld steps\n",
        config.model.flavor.empty() ? ("from " + config.hf_assets_path).c_str() : config.model.flavor.c_str(),
        long(m.hidden_size), long(m.num_hidden_layers), long(m.num_attention_heads), long(m.num_key_value_heads),
        long(m.vocab_size), long(m.intermediate_size), world->size(), long(d.dp_replicate), long(d.dp_shard),
        long(d.tp), long(d.global_batch_size), long(config.training.local_batch_size),
        long(d.gradient_accumulation_steps), long(config.training.seq_len), long(config.training.steps));
    std::fflush(stdout);
  }
  trainer.Train(std::cout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::comm::RunMain([&] { return Run(argc, argv); });
}
