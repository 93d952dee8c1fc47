// Fuzz target: FSDP2's full-state-dict file loader (DeserializeFullStateDict, the bytes of
// LoadFullStateDictFile), then LoadFullStateDict into a fully_shard'ed model. Each input
// runs as it is and, if its zip records' CRC-32s do not match, once more with them fixed
// (so mutations reach the unpickler). A c10::Error is a valid outcome; a crash, an abort,
// a sanitizer report or another exception is not.
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "fsdp/per_param/state_dict.h"
#include "fuzz/fuzz_models.h"

namespace {
void Run(const std::vector<char>& bytes) {
  try {
    const fsdp::per_param::FullStateDict sd = fsdp::per_param::DeserializeFullStateDict(bytes, "fuzz input");
    for (const auto& item : sd) fsdp::fuzz::TouchTensor(item.value());
    fsdp::per_param::LoadFullStateDict(*fsdp::fuzz::SharedTarget().model, sd);
  } catch (const c10::Error&) {
  }
}
}  // namespace

FSDP_CHECKPOINT_FUZZ_TARGET(Run)
