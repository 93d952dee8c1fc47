#include "env/environment.h"

#include <c10/util/Exception.h>

#include <cstdlib>

namespace fsdp::env {

const std::vector<Variable>& All() {
  static const auto* all = new std::vector<Variable>{kRank,
                                                     kWorldSize,
                                                     kLocalRank,
                                                     kMasterAddr,
                                                     kMasterPort,
                                                     kTorchelasticUseAgentStore,
                                                     kTorchelasticRestartCount,
                                                     kGlooSocketIfname,
                                                     kTorchFrBufferSize,
                                                     kTorchFrDumpTempFile,
                                                     kTorchNcclDumpOnTimeout,
                                                     kPeakBlocks,
                                                     kCpuStreams,
                                                     kUseFullPrecInEval,
                                                     kSkipWritebackCheck};
  return *all;
}

std::optional<std::string> Get(const Variable& variable) {
  const char* value = std::getenv(variable.name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

std::optional<std::string> Get(std::string_view name) {
  for (const Variable& v : All()) {
    if (name == v.name) return Get(v);
  }
  TORCH_CHECK(false, "env::Get: '", name, "' is not one of the library's variables (env/environment.h)");
}

bool IsOne(const Variable& variable) { return Get(variable) == std::optional<std::string>("1"); }

}  // namespace fsdp::env
