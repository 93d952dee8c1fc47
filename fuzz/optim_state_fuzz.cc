// Fuzz target: the optimizer-state loader (DeserializeOptimStateDict, the bytes of
// LoadOptimStateDict and of BroadcastOptimStateDict's receivers), then
// LoadFullOptimStateDict into the AdamW or SGD of a fully_shard'ed model. Each input runs
// as it is and, if its zip records' CRC-32s do not match, once more with them fixed. A
// c10::Error is a valid outcome; a crash, an abort, a sanitizer report or another
// exception is not.
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <variant>
#include <vector>

#include "fuzz/fuzz_models.h"
#include "optim_state/fsdp2_optim_state.h"
#include "optim_state/optim_state_dict.h"

namespace {
void Run(const std::vector<char>& bytes) {
  fsdp::fuzz::Target& target = fsdp::fuzz::SharedTarget();
  try {
    const fsdp::optim_state::OptimStateDict sd = fsdp::optim_state::DeserializeOptimStateDict(bytes, "fuzz input");
    for (const auto& [fqn, values] : sd.state) {
      for (const auto& [name, value] : values) {
        if (const auto* t = std::get_if<at::Tensor>(&value)) fsdp::fuzz::TouchTensor(*t);
      }
    }
    torch::optim::Optimizer& opt = sd.optimizer == "SGD" ? static_cast<torch::optim::Optimizer&>(*target.sgd)
                                                         : static_cast<torch::optim::Optimizer&>(*target.adamw);
    fsdp::optim_state::LoadFullOptimStateDict(*target.model, opt, sd);
  } catch (const c10::Error&) {
  }
}
}  // namespace

FSDP_CHECKPOINT_FUZZ_TARGET(Run)
