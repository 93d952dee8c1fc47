// Fuzz target: the full-state-dict file loader (checkpoint::DeserializeTensorDict, the bytes
// of LoadTensorDict / LoadFullStateDictFile), then LoadFullStateDict into a fully_shard'ed model. Each input
// runs as it is and, if its zip records' CRC-32s do not match, once more with them fixed
// (so mutations reach the unpickler). A c10::Error is a valid outcome; a crash, an abort,
// a sanitizer report or another exception is not.
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "checkpoint/tensor_dict_file.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fuzz/fuzz_models.h"

namespace {
void Run(const std::vector<char>& bytes) {
  try {
    const fsdp::fsdp2::FullStateDict sd = fsdp::checkpoint::DeserializeTensorDict(bytes, "fuzz input");
    for (const auto& item : sd) fsdp::fuzz::TouchTensor(item.value());
    fsdp::fsdp2::LoadFullStateDict(*fsdp::fuzz::SharedTarget().model, sd);
  } catch (const c10::Error&) {
  }
}
}  // namespace

FSDP_CHECKPOINT_FUZZ_TARGET(Run)
