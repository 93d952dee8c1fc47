// Safetensors files (https://github.com/huggingface/safetensors, what Hugging Face checkpoints
// are): a validating reader that reads any tensor, or rows or bytes of one, without reading
// the rest of the file, and a streaming writer whose files are byte for byte what Python's
// safetensors.torch.save_file (safetensors 0.8) writes for the same tensors and metadata.
//
// The format: an 8-byte little-endian unsigned header length N; N bytes of a UTF-8 JSON
// object, padded with trailing spaces (0x20), mapping each tensor name to
// {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]} (a byte range of the data
// section, which follows the header) plus an optional "__metadata__" object of strings; then
// the data section: each tensor's elements, row-major, little-endian.
//
// Files are untrusted input. The constructor reads only the length and the header, and checks
// before any read of tensor data: the header length (at most kMaxHeaderBytes and inside the
// file); that the header is strict JSON (json.h: limits on nesting, values, members and string
// bytes; valid UTF-8 and escapes; no duplicate keys) starting with '{' and padded only with
// spaces; every tensor's dtype (below), shape (at most 64 non-negative dimensions) and
// data_offsets (begin <= end, inside the data section, end - begin = elements x element size,
// computed without overflow); that the tensors tile the data section exactly, as Python's
// reader requires (no overlap, no byte belonging to no tensor); that __metadata__ maps strings
// to strings; and that a field of a tensor is one of the three. BOOL bytes are checked to be 0
// or 1 as they are read. Errors are c10::Errors: "SafetensorsReader: '<source>' is not a valid
// safetensors file: <what>", naming the tensor ("tensor 'w' ...") or metadata key involved and
// the bad value; a JSON error says where ("at byte 17 of the JSON (inside 'w' > 'shape')").
//
// Dtypes (safetensors name -> at::ScalarType): F64 Double, F32 Float, F16 Half, BF16 BFloat16,
// I64 Long, I32 Int, I16 Short, I8 Char, U8 Byte, BOOL Bool, U64 UInt64, U32 UInt32,
// U16 UInt16, F8_E4M3 Float8_e4m3fn, F8_E5M2 Float8_e5m2, F8_E4M3FNUZ Float8_e4m3fnuz,
// F8_E5M2FNUZ Float8_e5m2fnuz, F8_E8M0 Float8_e8m0fnu, C64 ComplexFloat. F4, F6_E2M3 and
// F6_E3M2 (sub-byte elements) have no LibTorch type: an error naming the tensor and the dtype.
//
// Reads (SafetensorsReader): a whole tensor, rows [row_begin, row_end) of its dim 0 (what a
// sharded loader needs), or a byte range of its data; into a fresh CPU tensor of the file's
// dtype, or into the caller's tensor of the right size, of any dtype (converted: a BF16
// tensor into an F32 destination), layout or device. Only the bytes asked for are read
// (pread): into the destination itself when it is a contiguous CPU tensor of the file's dtype,
// otherwise through a block of at most kBlockBytes (or one row, when larger). Reads are
// const and may run concurrently on one reader.
//
// Writing (WriteSafetensors, SaveSafetensors): tensors are ordered as Python orders them (by
// dtype, larger elements first in the Rust crate's Dtype order, then by name, bytewise), the
// header is compact JSON escaped as serde_json escapes it and padded with spaces to a multiple
// of 8 bytes, and each tensor's bytes are written straight from its memory (a tensor that is
// not a contiguous CPU tensor is copied, one at a time). SaveSafetensors writes a temporary
// file, fsyncs it and renames it over `path` (file_io.h AtomicFile): a crash leaves the old
// file or the whole new one. Python writes a multi-key __metadata__ in its hash map's order,
// which varies from run to run; ours is sorted by key (the same JSON, not the same bytes).
// Errors: "<caller>: ..." naming the tensor: a dtype safetensors has none for, a sparse or
// meta tensor, the name "__metadata__", names or metadata that are not valid UTF-8.
#ifndef FSDP_CHECKPOINT_SAFETENSORS_H_
#define FSDP_CHECKPOINT_SAFETENSORS_H_

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "checkpoint/file_io.h"
#include "checkpoint/tensor_dict_file.h"

namespace fsdp::checkpoint {

// The LibTorch dtype of a safetensors dtype name, or nullopt (not a name, or F4 / F6_*).
std::optional<at::ScalarType> SafetensorsScalarType(std::string_view dtype);
// The safetensors name of a LibTorch dtype, or nullptr when the format has none.
const char* SafetensorsDtypeName(at::ScalarType dtype);

// One tensor as the header describes it: its bytes are [begin, end) of the data section.
struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;
};

using SafetensorsMetadata = std::map<std::string, std::string>;

class SafetensorsReader {
 public:
  // The largest header read (the Rust crate's limit): a header is parsed in memory.
  static constexpr int64_t kMaxHeaderBytes = 100'000'000;
  // The most bytes read per pread when a read goes through a block (see above).
  static constexpr int64_t kBlockBytes = int64_t{1} << 22;

  // Opens `path` (kept open until the reader goes) and reads and checks its header.
  explicit SafetensorsReader(const std::string& path);
  // The file in data[0, size), named `source` in errors; the bytes must outlive the reader.
  SafetensorsReader(const char* data, size_t size, const std::string& source);
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& source() const { return source_; }
  // In the header's order.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  // nullopt when the header has no __metadata__.
  const std::optional<SafetensorsMetadata>& metadata() const { return metadata_; }
  // Where the data section starts in the file (8 + the header length).
  int64_t data_offset() const { return data_offset_; }

  // The tensor `name`: null / an error naming the file and listing some of its tensors.
  const SafetensorsEntry* Find(const std::string& name) const;
  const SafetensorsEntry& Entry(const std::string& name) const;

  // The tensor, a fresh contiguous CPU tensor of the file's dtype.
  at::Tensor Read(const std::string& name) const;
  // Rows [row_begin, row_end) of dim 0 (0 <= row_begin <= row_end <= rows; the tensor is not
  // 0-d), as a fresh tensor: tensor[row_begin:row_end].
  at::Tensor ReadRows(const std::string& name, int64_t row_begin, int64_t row_end) const;
  // The same into `dest`, which must have the size of what is read; its dtype, strides and
  // device may be any (values converted as Tensor::copy_ converts them).
  void ReadInto(const std::string& name, const at::Tensor& dest) const;
  void ReadRowsInto(const std::string& name, int64_t row_begin, int64_t row_end, const at::Tensor& dest) const;
  // Bytes [begin, end) of the tensor's data, raw (BOOL bytes unchecked), into out[0, end - begin).
  void ReadBytes(const std::string& name, int64_t begin, int64_t end, void* out) const;
  // The same for a tensor of this file (an entry of entries()), BOOL bytes checked (0 or 1):
  // what a reader of parts of tensors uses. Errors start with `caller`.
  void ReadDataBytes(const SafetensorsEntry& e, int64_t begin, int64_t end, void* out, const char* caller) const;

 private:
  void ParseHeader(const char* caller);
  void Fetch(int64_t offset, int64_t size, void* out, const char* caller) const;
  // Reads bytes [first, first + size) of `e`'s data into `out`, BOOL bytes checked.
  void FetchChecked(const SafetensorsEntry& e, int64_t first, int64_t size, void* out, const char* caller) const;
  void CheckRows(const SafetensorsEntry& e, int64_t row_begin, int64_t row_end, const char* caller) const;
  void ReadRowsIntoImpl(const SafetensorsEntry& e, int64_t row_begin, int64_t row_end, const at::Tensor& dest,
                        const char* caller) const;

  std::string source_;
  ScopedFd fd_;  // the file, or -1: the bytes are data_
  const char* data_ = nullptr;
  int64_t size_ = 0;  // of the file
  int64_t data_offset_ = 0;
  std::vector<SafetensorsEntry> entries_;
  absl::flat_hash_map<std::string, size_t> index_;  // name -> entries_ index
  std::optional<SafetensorsMetadata> metadata_;
};

// Every tensor of the file at `path`, in the header's order (errors: the reader's).
TensorDict LoadSafetensors(const std::string& path);

// Takes the file's bytes in order; it takes all of them or throws.
using SafetensorsSink = std::function<void(const char* data, size_t size)>;

// Where a file of tensors of these names, dtypes and shapes puts each, without the tensors:
// `head` is the file's first bytes (the length and the padded header), `entries` the tensors
// in file order with their data ranges (begin / end of the given entries are ignored). What
// WriteSafetensors writes, so a file can be written in pieces (a consolidated export).
struct SafetensorsLayout {
  std::vector<char> head;
  std::vector<SafetensorsEntry> entries;
  int64_t file_size() const { return static_cast<int64_t>(head.size()) + (entries.empty() ? 0 : DataBytes()); }
  int64_t DataBytes() const;
};
// Errors as WriteSafetensors' (names, metadata, element counts that overflow).
SafetensorsLayout LayOutSafetensors(std::vector<SafetensorsEntry> tensors,
                                    const std::optional<SafetensorsMetadata>& metadata,
                                    const std::string& caller = "LayOutSafetensors");

// Streams the file of `tensors` (names unique: a TensorDict's keys) and `metadata` (written as
// __metadata__ when given, even empty, as Python writes metadata={}) to `sink`. `dtype`: each
// floating-point tensor is written as this dtype (converted one tensor at a time, as
// tensor.to(dtype)); others as they are. Errors start with "<caller>: ".
void WriteSafetensors(const TensorDict& tensors, const std::optional<SafetensorsMetadata>& metadata,
                      const SafetensorsSink& sink, const std::string& caller = "WriteSafetensors",
                      std::optional<at::ScalarType> dtype = std::nullopt);
// The file's bytes in memory.
std::vector<char> SerializeSafetensors(const TensorDict& tensors,
                                       const std::optional<SafetensorsMetadata>& metadata = std::nullopt);
// The file at `path`, written atomically (a temporary file, fsynced, renamed over `path`).
void SaveSafetensors(const std::string& path, const TensorDict& tensors,
                     const std::optional<SafetensorsMetadata>& metadata = std::nullopt,
                     std::optional<at::ScalarType> dtype = std::nullopt);

}  // namespace fsdp::checkpoint

#endif  // FSDP_CHECKPOINT_SAFETENSORS_H_
