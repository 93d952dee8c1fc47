#include "comm/torchrun_env.h"

#include <c10/util/Exception.h>

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "env/environment.h"

namespace fsdp::comm {
namespace {

std::optional<std::string> ProcessEnv(const std::string& name) { return env::Get(name); }

std::string Required(const std::function<std::optional<std::string>(const std::string&)>& getenv,
                     const std::string& name) {
  std::optional<std::string> value = getenv(name);
  TORCH_CHECK(value.has_value(), "torchrun environment: ", name,
              " is not set (launch with torchrun or `./x run -n N`, which set RANK, "
              "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)");
  TORCH_CHECK(!value->empty(), "torchrun environment: ", name, " is set but empty");
  return *value;
}

int ParseInt(const std::string& name, const std::string& text, int min, int max) {
  int value = 0;
  TORCH_CHECK(absl::SimpleAtoi(text, &value), "torchrun environment: ", name, " must be an integer, got '", text, "'");
  TORCH_CHECK(value >= min && value <= max, "torchrun environment: ", name, " must be in [", min, ", ", max, "], got ",
              value);
  return value;
}

}  // namespace

TorchrunEnv ReadTorchrunEnv(const std::function<std::optional<std::string>(const std::string&)>& getenv_in) {
  const auto getenv = getenv_in ? getenv_in : ProcessEnv;
  TorchrunEnv env;
  env.world_size = ParseInt("WORLD_SIZE", Required(getenv, "WORLD_SIZE"), 1, 1 << 20);
  env.rank = ParseInt("RANK", Required(getenv, "RANK"), 0, 1 << 20);
  TORCH_CHECK(env.rank < env.world_size, "torchrun environment: RANK (", env.rank, ") must be < WORLD_SIZE (",
              env.world_size, ")");
  std::optional<std::string> local = getenv("LOCAL_RANK");
  env.local_rank = local ? ParseInt("LOCAL_RANK", *local, 0, env.world_size - 1) : env.rank;
  env.master_addr = Required(getenv, "MASTER_ADDR");
  env.master_port = ParseInt("MASTER_PORT", Required(getenv, "MASTER_PORT"), 1, 65535);
  env.use_agent_store = getenv("TORCHELASTIC_USE_AGENT_STORE") == std::optional<std::string>("True");
  if (std::optional<std::string> restarts = getenv("TORCHELASTIC_RESTART_COUNT")) {
    env.restart_count = ParseInt("TORCHELASTIC_RESTART_COUNT", *restarts, 0, 1 << 30);
  }
  return env;
}

}  // namespace fsdp::comm
