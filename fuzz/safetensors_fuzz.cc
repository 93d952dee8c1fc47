// Fuzz target: a safetensors file (Hugging Face checkpoints; whoever wrote it controls every
// byte). SafetensorsReader must accept it or throw a c10::Error; of what it accepts, every
// tensor must read (or fail with a c10::Error: a BOOL byte that is not 0 or 1), its rows and
// bytes must be the same bytes as the whole tensor, a converted read must not crash, and our
// writer's file of what was read must read back the same. A crash, a sanitizer report or a
// mismatch (an abort) is a failure.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_dict_file.h"

namespace {

using fsdp::checkpoint::SafetensorsReader;

void Require(bool ok) {
  if (!ok) std::abort();
}

bool SameBytes(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         (a.nbytes() == 0 || std::memcmp(a.const_data_ptr(), b.const_data_ptr(), a.nbytes()) == 0);
}

void Run(const char* data, size_t size) {
  const SafetensorsReader reader(data, size, "fuzz.safetensors");
  fsdp::checkpoint::TensorDict read;
  for (const auto& e : reader.entries()) {
    at::Tensor t;
    try {
      t = reader.Read(e.name);
    } catch (const c10::Error&) {
      Require(e.dtype == at::kBool);  // the only error once the header is accepted
      continue;
    }
    Require(t.sizes() == e.shape && t.scalar_type() == e.dtype);
    if (!e.shape.empty() && e.shape[0] > 0) {
      const int64_t half = e.shape[0] / 2;
      Require(SameBytes(reader.ReadRows(e.name, half, e.shape[0]), t.narrow(0, half, e.shape[0] - half)));
    }
    std::vector<char> bytes(static_cast<size_t>(e.end - e.begin));
    reader.ReadBytes(e.name, 0, e.end - e.begin, bytes.data());
    Require(bytes.empty() || std::memcmp(bytes.data(), t.const_data_ptr(), bytes.size()) == 0);
    const at::Tensor converted = at::empty(t.sizes(), at::isComplexType(e.dtype) ? at::kComplexDouble : at::kDouble);
    reader.ReadInto(e.name, converted);
    read.insert(e.name, t);
  }
  if (read.size() != reader.entries().size()) return;
  const std::vector<char> again = fsdp::checkpoint::SerializeSafetensors(read, reader.metadata());
  const SafetensorsReader reread(again.data(), again.size(), "fuzz.safetensors (rewritten)");
  Require(reread.entries().size() == read.size() && reread.metadata() == reader.metadata());
  for (const auto& item : read) Require(SameBytes(reread.Read(item.key()), item.value()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    Run(reinterpret_cast<const char*>(data), size);
  } catch (const c10::Error&) {
  }
  return 0;
}
