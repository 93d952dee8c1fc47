// Fuzz target: a Hugging Face directory (whoever wrote it controls every byte): an index JSON
// and a safetensors file that may carry PyTorch's DCP_SHARDING_INFO. The input is a 4-byte
// little-endian length N, N bytes of model.safetensors.index.json (none when N is 0), then the
// bytes of the safetensors file (named a.safetensors). HfCheckpointReader must accept the
// directory or throw a c10::Error; of what it accepts, every tensor must read whole, and its
// top rows alone, as the same bytes (or fail with a c10::Error: a BOOL byte that is not 0 or
// 1). A crash, a sanitizer report or a mismatch (an abort) is a failure.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/hf_checkpoint.h"

namespace {

namespace fs = std::filesystem;

void Require(bool ok) {
  if (!ok) std::abort();
}

const std::string& Dir() {
  static const std::string dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string d = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/hf_checkpoint_fuzz_" +
                    std::to_string(::getpid());
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

void WriteFile(const std::string& path, const char* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data, static_cast<std::streamsize>(size));
}

void Run(const char* data, size_t size) {
  if (size < 4) return;
  uint32_t index_size = 0;
  std::memcpy(&index_size, data, 4);
  if (index_size > size - 4) return;
  const std::string dir = Dir();
  fs::remove(dir + "/" + fsdp::checkpoint::kHfIndexFile);
  if (index_size > 0) WriteFile(dir + "/" + fsdp::checkpoint::kHfIndexFile, data + 4, index_size);
  WriteFile(dir + "/a.safetensors", data + 4 + index_size, size - 4 - index_size);
  const fsdp::checkpoint::HfCheckpointReader reader(dir, "fuzz");
  for (const fsdp::checkpoint::HfTensor& t : reader.tensors()) {
    int64_t numel = 1;
    for (int64_t s : t.size) numel *= s;
    if (numel > (int64_t{1} << 24)) continue;  // bounded by the file's bytes, but not worth the time
    at::Tensor whole = at::empty(t.size, t.dtype);
    try {
      reader.ReadInto(t.name, std::vector<int64_t>(t.size.size(), 0), whole);
    } catch (const c10::Error&) {
      Require(t.dtype == at::kBool);  // the only error once the directory is accepted
      continue;
    }
    if (t.size.empty() || t.size[0] == 0) continue;
    std::vector<int64_t> rows = t.size;
    rows[0] = (t.size[0] + 1) / 2;
    at::Tensor top = at::empty(rows, t.dtype);
    reader.ReadInto(t.name, std::vector<int64_t>(t.size.size(), 0), top);
    const at::Tensor want = whole.narrow(0, 0, rows[0]).contiguous();
    Require(top.nbytes() == want.nbytes() &&
            (top.nbytes() == 0 || std::memcmp(top.const_data_ptr(), want.const_data_ptr(), top.nbytes()) == 0));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    Run(reinterpret_cast<const char*>(data), size);
  } catch (const c10::Error&) {
  }
  return 0;
}
