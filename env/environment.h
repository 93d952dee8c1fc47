// Every environment variable the library reads, in one place: their documented names
// (docs/reference/environment.md, which tools/check_doc_links.py checks lists each), what each is for, and
// the one function that reads them. Programs, tests and scripts have their own variables;
// those are in the same page but not here.
//
// Contract:
//  * Get(variable) returns the value of the variable when it is set (possibly empty), else
//    nullopt; it reads the process environment at each call (nothing is cached), so a change
//    takes effect where the option is next resolved. Get(name) is the same for a variable
//    named by string and throws a c10::Error when the name is not one of All(): a new
//    variable is added here first.
//  * IsOne(variable): set to exactly "1" (PyTorch's convention for its FSDP switches).
//  * Thread-safety: as getenv: safe unless another thread changes the environment.
//  * Options first: a behaviour switch is an option in the API; a variable only overrides it
//    where the option is resolved (for debugging, or PyTorch's own FSDP1 variables).
#ifndef FSDP_ENV_ENVIRONMENT_H_
#define FSDP_ENV_ENVIRONMENT_H_

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp::env {

struct Variable {
  const char* name;
  // The one-line purpose (the docs page has the details).
  const char* purpose;
  // A knob for tests and debugging that a training run should not set.
  bool test_only = false;
};

// The torchrun contract (comm/torchrun_env.h; RANK also names the rank in comm/main_guard.h's
// error lines).
inline constexpr Variable kRank{"RANK", "this process's rank in the job"};
inline constexpr Variable kWorldSize{"WORLD_SIZE", "number of processes in the job"};
inline constexpr Variable kLocalRank{"LOCAL_RANK", "rank on this host (the CUDA device for NCCL)"};
inline constexpr Variable kMasterAddr{"MASTER_ADDR", "host of rank 0's TCPStore"};
inline constexpr Variable kMasterPort{"MASTER_PORT", "port of rank 0's TCPStore"};
inline constexpr Variable kTorchelasticUseAgentStore{"TORCHELASTIC_USE_AGENT_STORE",
                                                     "True: torchrun's agent serves the store"};
inline constexpr Variable kTorchelasticRestartCount{"TORCHELASTIC_RESTART_COUNT", "torchrun's restart attempt"};
// Communication (as PyTorch's ProcessGroupGloo reads it).
inline constexpr Variable kGlooSocketIfname{"GLOO_SOCKET_IFNAME", "network interfaces Gloo binds to"};
// The flight recorder (comm/flight_recorder.h), as PyTorch's ProcessGroupNCCL names them.
inline constexpr Variable kTorchFrBufferSize{"TORCH_FR_BUFFER_SIZE", "flight recorder entries kept per rank (0: off)"};
inline constexpr Variable kTorchFrDumpTempFile{"TORCH_FR_DUMP_TEMP_FILE",
                                               "flight recorder dump path prefix (the rank is appended)"};
inline constexpr Variable kTorchNcclDumpOnTimeout{"TORCH_NCCL_DUMP_ON_TIMEOUT",
                                                  "0: no flight recorder dump after a failed collective"};
// Debugging overrides.
inline constexpr Variable kPeakBlocks{"FSDP_PEAK_BLOCKS",
                                      "R: rank R lists the blocks live at its allocation peak (metrics)",
                                      /*test_only=*/true};
inline constexpr Variable kCpuStreams{
    "FSDP_CPU_STREAMS", "CPU stream mode: inline, async, async:<us> (async:<us> delays each task)", /*test_only=*/true};
// PyTorch's FSDP1 variables (torch/distributed/fsdp/_flat_param.py), overriding FSDPOptions.
inline constexpr Variable kUseFullPrecInEval{"FSDP_USE_FULL_PREC_IN_EVAL",
                                             "1: eval forwards in full precision (FSDP1)"};
inline constexpr Variable kSkipWritebackCheck{"FSDP_SKIP_WRITEBACK_CHECK",
                                              "1: skip use_orig_params' writeback check (FSDP1)"};

// Every variable above, in this order.
const std::vector<Variable>& All();

std::optional<std::string> Get(const Variable& variable);
std::optional<std::string> Get(std::string_view name);
bool IsOne(const Variable& variable);

}  // namespace fsdp::env

#endif  // FSDP_ENV_ENVIRONMENT_H_
