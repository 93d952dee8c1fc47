// Fuzz target: the torchrun environment parser (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
// MASTER_PORT come from the launcher, i.e. from outside). The input is split at '\n' into
// the five values in that order; a missing line is an unset variable. A c10::Error is a
// valid outcome.
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "comm/torchrun_env.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const char* kNames[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"};
  std::map<std::string, std::string> env;
  const std::string input(reinterpret_cast<const char*>(data), size);
  size_t begin = 0;
  for (const char* name : kNames) {
    if (begin > input.size()) break;
    size_t end = input.find('\n', begin);
    if (end == std::string::npos) end = input.size();
    env[name] = input.substr(begin, end - begin);
    begin = end + 1;
  }
  try {
    const fsdp::comm::TorchrunEnv parsed = fsdp::comm::ReadTorchrunEnv([&](const std::string& name) {
      auto it = env.find(name);
      return it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
    });
    if (parsed.rank < 0 || parsed.rank >= parsed.world_size || parsed.local_rank < 0 ||
        parsed.local_rank >= parsed.world_size || parsed.master_port < 1 || parsed.master_port > 65535 ||
        parsed.master_addr.empty()) {
      __builtin_trap();  // accepted an environment its contract rejects
    }
  } catch (const c10::Error&) {
  }
  return 0;
}
