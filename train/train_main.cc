// The `train` program: torchtitan's `torchtitan/train.py` for the Llama-3 job of a TOML config.
//
//   ./x run -n 4 bazel-bin/train/train --config train/configs/debugmodel.toml [--training.steps=20]
//   bazel run //train -- --config train/configs/debugmodel.toml --nproc 4
//   bazel run //train -- --config train/configs/debugmodel.toml --print-config
//
// Launched by torchrun or `./x run` (the torchrun environment: RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT) it trains over every rank; without that environment, on one process, or with
// `--nproc N` on N processes it starts itself (torchrun --standalone's job: each child gets the
// torchrun environment on 127.0.0.1; when one fails, the others are stopped and the exit status
// is 1). As torchtitan, on a CUDA device where one is visible (a --config=cuda build: rank r on
// cuda:LOCAL_RANK over NCCL; CUDA_VISIBLE_DEVICES="" hides them), else on the CPU over Gloo.
// The config is read and validated on every rank before any process group or tensor exists,
// so a bad key or value is one error line per rank (comm::RunMain) and exit status 1.
// Relative paths are the caller's: under `bazel run` the program first changes to
// BUILD_WORKING_DIRECTORY. docs/guide/train.md.
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

extern char** environ;

#include <ATen/Context.h>

#include "comm/gloo_process_group.h"
#include "comm/main_guard.h"
#include "comm/nccl_process_group.h"
#include "comm/torchrun_env.h"
#include "train/config.h"
#include "train/trainer.h"

namespace {

constexpr char kUsage[] =
    "usage: train --config FILE [--section.key=VALUE ...] [--print-config] [--nproc N]\n"
    "  Trains the Llama-3 job of a TOML config (docs/guide/train.md); --section.key=VALUE\n"
    "  overrides a key of the file (torchtitan's dotted form); --print-config prints the\n"
    "  resolved config as TOML and exits; --nproc N runs N processes on this machine.\n";

bool HasTorchrunEnv() { return std::getenv("RANK") != nullptr || std::getenv("WORLD_SIZE") != nullptr; }

// A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT).
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, "train --nproc: socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  TORCH_CHECK(ok, "train --nproc: no free port on 127.0.0.1");
  return ntohs(addr.sin_port);
}

// `nproc` copies of this program with the torchrun environment and `args` (without --nproc);
// waits for all. The first to fail stops the others.
int Launch(int nproc, const std::vector<std::string>& args) {
  const std::string port = std::to_string(FreePort());
  std::vector<pid_t> children;
  for (int rank = 0; rank < nproc; ++rank) {
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
    for (const auto& [name, value] :
         std::vector<std::pair<std::string, std::string>>{{"RANK", std::to_string(rank)},
                                                          {"LOCAL_RANK", std::to_string(rank)},
                                                          {"WORLD_SIZE", std::to_string(nproc)},
                                                          {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
                                                          {"MASTER_ADDR", "127.0.0.1"},
                                                          {"MASTER_PORT", port}}) {
      env_strings.push_back(name + "=" + value);
    }
    std::vector<char*> envp, argv = {const_cast<char*>("train")};
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<std::string> arg_copies(args);
    for (auto& a : arg_copies) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    const int rc = ::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), envp.data());
    TORCH_CHECK(rc == 0, "train --nproc: starting rank ", rank, " failed: ", std::strerror(rc));
    children.push_back(pid);
  }
  int status = 0, exit_code = 0;
  for (size_t running = children.size(); running > 0; --running) {
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) break;
    const bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    if (failed && exit_code == 0) {
      exit_code = 1;
      std::fprintf(stderr, "train --nproc: a rank failed; stopping the others\n");
      for (const pid_t child : children) {
        if (child != pid) ::kill(child, SIGTERM);
      }
    }
  }
  return exit_code;
}

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
  if (command_line.nproc > 0) {
    TORCH_CHECK(!distributed, "--nproc starts the ranks itself: not under torchrun or ./x run (RANK / WORLD_SIZE set)");
    fsdp::train::ValidateConfig(config, command_line.nproc);  // one error, before any rank starts
    std::vector<std::string> child_args;
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i] == "--nproc") {
        ++i;  // and its value
      } else if (args[i].rfind("--nproc=", 0) != 0) {
        child_args.push_back(args[i]);
      }
    }
    return Launch(command_line.nproc, child_args);
  }
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

  const std::chrono::seconds timeout(std::max(config.comm.init_timeout_seconds, config.comm.train_timeout_seconds));
  // torchtitan's device (torchtitan/tools/utils.py: device_type is cuda where it is available).
  const bool cuda = at::hasCUDA();
  c10::Device device(c10::kCPU);
  fsdp::comm::ProcessGroupPtr world;
  if (cuda) {
    fsdp::comm::TorchrunEnv nccl_env = env;
    if (!distributed) {  // one rank of its own: a TCPStore on a free local port
      nccl_env.master_addr = "127.0.0.1";
      nccl_env.master_port = FreePort();
    }
    world = fsdp::comm::CreateNcclProcessGroupWithTcpStore(nccl_env, {.timeout = timeout});
    device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(nccl_env.local_rank));
  } else if (distributed) {
    world = fsdp::comm::CreateGlooProcessGroupWithTcpStore(env, {.timeout = timeout});
  } else {
    const std::filesystem::path store =
        std::filesystem::temp_directory_path() / ("fsdp_train_store_" + std::to_string(getpid()));
    std::filesystem::remove(store);
    world = fsdp::comm::CreateGlooProcessGroupWithFileStore(store.string(), 0, 1, {.timeout = timeout});
  }
  fsdp::train::Trainer trainer(config, world, device);
  if (world->rank() == 0) {
    const auto& d = trainer.degrees();
    const auto& m = trainer.model_config();
    std::printf(
        "train: llama3 %s (dim %ld, %ld layers, %ld heads / %ld kv heads, vocab %ld, ffn %ld) on %d ranks: "
        "dp_replicate %ld x dp_shard %ld x tp %ld; global batch %ld (local %ld, accumulation %ld) x seq_len %ld; "
        "%ld steps; on %s\n",
        config.model.flavor.empty() ? ("from " + config.hf_assets_path).c_str() : config.model.flavor.c_str(),
        long(m.hidden_size), long(m.num_hidden_layers), long(m.num_attention_heads), long(m.num_key_value_heads),
        long(m.vocab_size), long(m.intermediate_size), world->size(), long(d.dp_replicate), long(d.dp_shard),
        long(d.tp), long(d.global_batch_size), long(config.training.local_batch_size),
        long(d.gradient_accumulation_steps), long(config.training.seq_len), long(config.training.steps),
        cuda ? "cuda over NCCL" : "the CPU over Gloo");
    std::fflush(stdout);
  }
  trainer.Train(std::cout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::comm::RunMain([&] { return Run(argc, argv); });
}
