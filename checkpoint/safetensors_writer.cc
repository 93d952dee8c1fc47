// The safetensors writer (safetensors.h): the bytes of Python's safetensors.torch.save_file.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/file_io.h"
#include "checkpoint/json.h"
#include "checkpoint/safetensors.h"

namespace fsdp::checkpoint {
namespace {

// Tensor bytes go to the file as they are in memory, and the format is little-endian.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors files are little-endian");

// The position of a dtype in the Rust crate's Dtype enum (safetensors 0.8, src/tensor.rs),
// which Python's writer sorts tensors by, largest first, before their names: tensors with
// larger elements come first, so every tensor starts aligned to its element size.
int DtypeOrder(at::ScalarType type) {
  switch (type) {
    case at::ScalarType::Bool: return 0;
    // 1-3: F4, F6_E2M3, F6_E3M2
    case at::ScalarType::Byte: return 4;
    case at::ScalarType::Char: return 5;
    case at::ScalarType::Float8_e5m2: return 6;
    case at::ScalarType::Float8_e4m3fn: return 7;
    case at::ScalarType::Float8_e8m0fnu: return 8;
    case at::ScalarType::Float8_e4m3fnuz: return 9;
    case at::ScalarType::Float8_e5m2fnuz: return 10;
    case at::ScalarType::Short: return 11;
    case at::ScalarType::UInt16: return 12;
    case at::ScalarType::Half: return 13;
    case at::ScalarType::BFloat16: return 14;
    case at::ScalarType::Int: return 15;
    case at::ScalarType::UInt32: return 16;
    case at::ScalarType::Float: return 17;
    case at::ScalarType::ComplexFloat: return 18;
    case at::ScalarType::Double: return 19;
    case at::ScalarType::Long: return 20;
    case at::ScalarType::UInt64: return 21;
    default: return -1;
  }
}

// The header's strings are UTF-8 (readers, ours included, reject anything else).
void CheckWritableString(const std::string& s, const std::string& caller, const std::string& what) {
  const size_t bad = internal::InvalidUtf8Offset(s);
  TORCH_CHECK(bad == std::string::npos, caller, ": ", what, " '", s.substr(0, 200), "' is not valid UTF-8 (at byte ",
              bad, ")");
}

}  // namespace

int64_t SafetensorsLayout::DataBytes() const { return entries.empty() ? 0 : entries.back().end; }

SafetensorsLayout LayOutSafetensors(std::vector<SafetensorsEntry> tensors,
                                    const std::optional<SafetensorsMetadata>& metadata, const std::string& caller) {
  for (const SafetensorsEntry& e : tensors) {
    TORCH_CHECK(e.name != "__metadata__", caller,
                ": a tensor may not be named '__metadata__' (the header's key for the metadata)");
    CheckWritableString(e.name, caller, "the tensor name");
    TORCH_CHECK(SafetensorsDtypeName(e.dtype) != nullptr, caller, ": tensor '", e.name.substr(0, 200), "' has dtype ",
                e.dtype, ", which safetensors has no dtype for");
  }
  std::stable_sort(tensors.begin(), tensors.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    const int oa = DtypeOrder(a.dtype), ob = DtypeOrder(b.dtype);
    return oa != ob ? oa > ob : a.name < b.name;
  });

  // serde_json's compact output of the crate's Metadata: __metadata__ first, then the tensors
  // in file order, each {"dtype","shape","data_offsets"}.
  std::string header = "{";
  if (metadata.has_value()) {
    internal::AppendJsonString("__metadata__", &header);
    header += ":{";
    for (const auto& [key, value] : *metadata) {
      CheckWritableString(key, caller, "the metadata key");
      CheckWritableString(value, caller, absl::StrCat("the value of metadata key '", key.substr(0, 200), "'"));
      if (header.back() != '{') header += ',';
      internal::AppendJsonString(key, &header);
      header += ':';
      internal::AppendJsonString(value, &header);
    }
    header += '}';
  }
  int64_t offset = 0;
  for (SafetensorsEntry& e : tensors) {
    int64_t nbytes = static_cast<int64_t>(c10::elementSize(e.dtype));
    for (int64_t s : e.shape) {
      TORCH_CHECK(s >= 0, caller, ": tensor '", e.name.substr(0, 200), "' has a negative size ", s);
      TORCH_CHECK(!__builtin_mul_overflow(nbytes, s, &nbytes), caller, ": tensor '", e.name.substr(0, 200),
                  "' has more bytes than fit in 64 bits");
    }
    TORCH_CHECK(!__builtin_add_overflow(offset, nbytes, &e.end), caller, ": the tensors' bytes overflow 64 bits");
    e.begin = offset;
    if (header.size() > 1) header += ',';
    internal::AppendJsonString(e.name, &header);
    absl::StrAppend(&header, ":{\"dtype\":\"", SafetensorsDtypeName(e.dtype), "\",\"shape\":[");
    for (size_t d = 0; d < e.shape.size(); ++d) absl::StrAppend(&header, d == 0 ? "" : ",", e.shape[d]);
    absl::StrAppend(&header, "],\"data_offsets\":[", e.begin, ",", e.end, "]}");
    offset = e.end;
  }
  header += '}';
  header.append((8 - header.size() % 8) % 8, ' ');  // the data section starts 8-aligned

  SafetensorsLayout layout;
  layout.head.resize(8 + header.size());
  for (int i = 0; i < 8; ++i) {
    layout.head[i] = static_cast<char>((static_cast<uint64_t>(header.size()) >> (8 * i)) & 0xFF);
  }
  std::memcpy(layout.head.data() + 8, header.data(), header.size());
  layout.entries = std::move(tensors);
  return layout;
}

void WriteSafetensors(const TensorDict& tensors, const std::optional<SafetensorsMetadata>& metadata,
                      const SafetensorsSink& sink, const std::string& caller, std::optional<at::ScalarType> dtype) {
  std::vector<SafetensorsEntry> specs;
  absl::flat_hash_map<std::string, const at::Tensor*> by_name;
  specs.reserve(tensors.size());
  for (const auto& item : tensors) {
    const std::string& name = item.key();
    const at::Tensor& t = item.value();
    const std::string what = absl::StrCat(caller, ": tensor '", name.substr(0, 200), "'");
    TORCH_CHECK(t.defined(), what, " is an undefined tensor");
    TORCH_CHECK(t.layout() == at::kStrided, what, " has layout ", t.layout(), " (only dense tensors are written)");
    TORCH_CHECK(!t.is_meta(), what, " is on the meta device: it has no data to write");
    const at::ScalarType type = dtype.has_value() && at::isFloatingType(t.scalar_type()) ? *dtype : t.scalar_type();
    specs.push_back({name, type, t.sizes().vec(), 0, 0});
    by_name.emplace(name, &t);
  }
  const SafetensorsLayout layout = LayOutSafetensors(std::move(specs), metadata, caller);
  sink(layout.head.data(), layout.head.size());
  for (const SafetensorsEntry& e : layout.entries) {
    if (e.end == e.begin) continue;
    // One copy at a time, only for a tensor not already contiguous CPU memory of its dtype.
    at::Tensor t = by_name.at(e.name)->detach();
    if (!t.device().is_cpu()) t = t.to(at::kCPU);
    if (t.scalar_type() != e.dtype) t = t.to(e.dtype);
    t = t.resolve_conj().resolve_neg().contiguous();
    sink(static_cast<const char*>(t.const_data_ptr()), static_cast<size_t>(e.end - e.begin));
  }
}

std::vector<char> SerializeSafetensors(const TensorDict& tensors, const std::optional<SafetensorsMetadata>& metadata) {
  std::vector<char> out;
  WriteSafetensors(
      tensors, metadata, [&](const char* data, size_t size) { out.insert(out.end(), data, data + size); },
      "SerializeSafetensors");
  return out;
}

void SaveSafetensors(const std::string& path, const TensorDict& tensors,
                     const std::optional<SafetensorsMetadata>& metadata, std::optional<at::ScalarType> dtype) {
  AtomicFile file(path, "SaveSafetensors");
  WriteSafetensors(
      tensors, metadata, [&](const char* data, size_t size) { file.Write(data, size); }, "SaveSafetensors", dtype);
  file.Commit();
}

}  // namespace fsdp::checkpoint
