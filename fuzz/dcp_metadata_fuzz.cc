// Fuzz target: a distributed checkpoint's `.metadata` (PyTorch's pickle of
// torch.distributed.checkpoint.metadata.Metadata; whoever wrote the directory controls it).
// ParseDcpMetadata must accept it or throw a c10::Error naming the problem; what it accepts
// must validate and survive our writer and reader again.
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "checkpoint/dcp_metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const fsdp::checkpoint::DcpMetadata metadata =
        fsdp::checkpoint::ParseDcpMetadata(reinterpret_cast<const char*>(data), size, "fuzz/.metadata");
    fsdp::checkpoint::ValidateDcpMetadata(metadata, "fuzz/.metadata");
    const std::vector<char> again = fsdp::checkpoint::SerializeDcpMetadata(metadata);
    fsdp::checkpoint::ParseDcpMetadata(again.data(), again.size(), "fuzz/.metadata (rewritten)");
  } catch (const c10::Error&) {
  }
  return 0;
}
