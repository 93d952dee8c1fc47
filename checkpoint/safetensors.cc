// The safetensors reader (safetensors.h): the header's checks, then reads of byte ranges.
#include "checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/json.h"

namespace fsdp::checkpoint {
namespace {

using internal::JsonKindName;
using internal::JsonValue;
using Kind = internal::JsonValue::Kind;

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors files are little-endian");

struct SafetensorsDtype {
  const char* name;
  std::optional<at::ScalarType> type;
};

// The safetensors crate's Dtype names (safetensors 0.8) and LibTorch's type for each.
constexpr SafetensorsDtype kSafetensorsDtypes[] = {
    {"F64", at::ScalarType::Double},
    {"F32", at::ScalarType::Float},
    {"F16", at::ScalarType::Half},
    {"BF16", at::ScalarType::BFloat16},
    {"I64", at::ScalarType::Long},
    {"I32", at::ScalarType::Int},
    {"I16", at::ScalarType::Short},
    {"I8", at::ScalarType::Char},
    {"U8", at::ScalarType::Byte},
    {"BOOL", at::ScalarType::Bool},
    {"U64", at::ScalarType::UInt64},
    {"U32", at::ScalarType::UInt32},
    {"U16", at::ScalarType::UInt16},
    {"F8_E4M3", at::ScalarType::Float8_e4m3fn},
    {"F8_E5M2", at::ScalarType::Float8_e5m2},
    {"F8_E4M3FNUZ", at::ScalarType::Float8_e4m3fnuz},
    {"F8_E5M2FNUZ", at::ScalarType::Float8_e5m2fnuz},
    {"F8_E8M0", at::ScalarType::Float8_e8m0fnu},
    {"C64", at::ScalarType::ComplexFloat},
    // Sub-byte elements: a shape counts 4- or 6-bit values (LibTorch's float4_e2m1fn_x2
    // counts pairs), so there is no tensor to read them into.
    {"F4", std::nullopt},
    {"F6_E2M3", std::nullopt},
    {"F6_E3M2", std::nullopt},
};

constexpr int kMaxDims = 64;

// A name in an error message, quoted and cut short (a name may be megabytes long).
std::string StQuoted(const std::string& name) {
  constexpr size_t kMax = 200;
  if (name.size() <= kMax) return absl::StrCat("'", name, "'");
  size_t n = kMax;
  while (n > 0 && (static_cast<unsigned char>(name[n]) & 0xC0) == 0x80) --n;
  return absl::StrCat("'", name.substr(0, n), "...' (", name.size(), " bytes)");
}

std::string StHexByte(char c) {
  char buffer[8];
  std::snprintf(buffer, sizeof(buffer), "0x%02x", static_cast<unsigned char>(c));
  return buffer;
}

// A non-negative integer of the header; `what` names it for the error.
int64_t StInteger(const JsonValue& v, const std::string& what) {
  TORCH_CHECK(v.kind == Kind::kNumber, what, " is ", JsonKindName(v.kind), ", not an integer");
  const std::string& s = v.text;
  TORCH_CHECK(s[0] != '-', what, " is ", s, " (negative)");
  TORCH_CHECK(s.find_first_of(".eE") == std::string::npos, what, " is ", s, ", not an integer");
  int64_t value = 0;
  for (const char c : s) {
    TORCH_CHECK(!__builtin_mul_overflow(value, 10, &value) && !__builtin_add_overflow(value, c - '0', &value), what,
                " is ", s.size() > 40 ? s.substr(0, 40) + "..." : s, ", more than int64 holds");
  }
  return value;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

SafetensorsEntry ParseStEntry(const std::string& name, const JsonValue& v, int64_t data_size, const std::string& bad) {
  const std::string t = absl::StrCat(bad, ": tensor ", StQuoted(name));
  TORCH_CHECK(v.kind == Kind::kObject, t, " is described by ", JsonKindName(v.kind), ", not an object");
  const JsonValue *dtype = nullptr, *shape = nullptr, *offsets = nullptr;
  for (const auto& [field, value] : v.members) {
    if (field == "dtype") {
      dtype = &value;
    } else if (field == "shape") {
      shape = &value;
    } else if (field == "data_offsets") {
      offsets = &value;
    } else {
      TORCH_CHECK(false, t, " has an unknown field ", StQuoted(field), " (a tensor has dtype, shape and data_offsets)");
    }
  }
  TORCH_CHECK(dtype != nullptr && shape != nullptr && offsets != nullptr, t, " has no ",
              dtype == nullptr   ? "dtype"
              : shape == nullptr ? "shape"
                                 : "data_offsets");
  SafetensorsEntry e;
  e.name = name;
  TORCH_CHECK(dtype->kind == Kind::kString, t, " has a dtype that is ", JsonKindName(dtype->kind), ", not a string");
  const std::optional<at::ScalarType> type = SafetensorsScalarType(dtype->text);
  if (!type.has_value()) {
    const bool known = std::any_of(std::begin(kSafetensorsDtypes), std::end(kSafetensorsDtypes),
                                   [&](const SafetensorsDtype& d) { return dtype->text == d.name; });
    TORCH_CHECK(false, t, " has dtype ", StQuoted(dtype->text),
                known ? ", which LibTorch has no type for (sub-byte elements)" : ", which is not a safetensors dtype");
  }
  e.dtype = *type;
  TORCH_CHECK(shape->kind == Kind::kArray, t, " has a shape that is ", JsonKindName(shape->kind), ", not an array");
  TORCH_CHECK(shape->items.size() <= kMaxDims, t, " has ", shape->items.size(), " dimensions, more than the ", kMaxDims,
              " read");
  for (size_t d = 0; d < shape->items.size(); ++d) {
    e.shape.push_back(StInteger(shape->items[d], absl::StrCat(t, ": shape dimension ", d)));
  }
  TORCH_CHECK(offsets->kind == Kind::kArray && offsets->items.size() == 2, t, " has data_offsets ",
              offsets->kind == Kind::kArray ? absl::StrCat("of ", offsets->items.size(), " values")
                                            : absl::StrCat("that are ", JsonKindName(offsets->kind)),
              ", not [begin, end]");
  e.begin = StInteger(offsets->items[0], t + ": data_offsets[0]");
  e.end = StInteger(offsets->items[1], t + ": data_offsets[1]");
  const std::string range = absl::StrCat("data_offsets [", e.begin, ", ", e.end, "]");
  // The element count of the non-zero dimensions must fit too: LibTorch computes strides
  // from them even when another dimension is 0.
  int64_t numel = 1, nbytes = 0;
  bool empty = false;
  for (const int64_t d : e.shape) {
    empty = empty || d == 0;
    TORCH_CHECK(d == 0 || !__builtin_mul_overflow(numel, d, &numel), t, " has shape ", ShapeString(e.shape),
                ", more elements than int64 counts");
  }
  TORCH_CHECK(!__builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(e.dtype)), &nbytes), t,
              " has shape ", ShapeString(e.shape), ", more bytes than int64 counts");
  if (empty) nbytes = 0;
  TORCH_CHECK(e.begin <= e.end, t, " has ", range, ": the end is before the beginning");
  TORCH_CHECK(e.end - e.begin == nbytes, t, " of dtype ", dtype->text, " and shape ", ShapeString(e.shape), " has ",
              nbytes, " bytes, but its ", range, " span ", e.end - e.begin);
  TORCH_CHECK(e.end <= data_size, t, " has ", range, " but the data section has only ", data_size,
              " bytes (truncated?)");
  return e;
}

}  // namespace

std::optional<at::ScalarType> SafetensorsScalarType(std::string_view dtype) {
  for (const SafetensorsDtype& d : kSafetensorsDtypes) {
    if (dtype == d.name) return d.type;
  }
  return std::nullopt;
}

const char* SafetensorsDtypeName(at::ScalarType dtype) {
  for (const SafetensorsDtype& d : kSafetensorsDtypes) {
    if (d.type == dtype) return d.name;
  }
  return nullptr;
}

SafetensorsReader::SafetensorsReader(const std::string& path) : source_(path) {
  constexpr const char* kCaller = "SafetensorsReader";
  fd_ = ScopedFd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  TORCH_CHECK(fd_.get() >= 0, kCaller, ": cannot open '", path, "' for reading (", std::strerror(errno), ")");
  struct stat st {};
  TORCH_CHECK(::fstat(fd_.get(), &st) == 0, kCaller, ": cannot stat '", path, "' (", std::strerror(errno), ")");
  TORCH_CHECK(S_ISREG(st.st_mode), kCaller, ": '", path, "' is not a regular file");
  size_ = st.st_size;
  ParseHeader(kCaller);
}

SafetensorsReader::SafetensorsReader(const char* data, size_t size, const std::string& source)
    : source_(source), data_(data), size_(static_cast<int64_t>(size)) {
  ParseHeader("SafetensorsReader");
}

void SafetensorsReader::ParseHeader(const char* caller) {
  const std::string bad = absl::StrCat(caller, ": '", source_, "' is not a valid safetensors file");
  TORCH_CHECK(size_ >= 8, bad, ": it has ", size_, " bytes, fewer than the 8 of its header length (truncated?)");
  unsigned char length[8];
  Fetch(0, 8, length, caller);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | length[i];
  TORCH_CHECK(n <= static_cast<uint64_t>(kMaxHeaderBytes), bad, ": its header length is ", n, " bytes, more than the ",
              kMaxHeaderBytes, " read");
  TORCH_CHECK(n <= static_cast<uint64_t>(size_ - 8), bad, ": its header length is ", n, " bytes but only ", size_ - 8,
              " bytes follow the length (truncated?)");
  std::string header(n, '\0');
  Fetch(8, static_cast<int64_t>(n), header.data(), caller);
  data_offset_ = 8 + static_cast<int64_t>(n);
  const int64_t data_size = size_ - data_offset_;
  TORCH_CHECK(n > 0 && header[0] == '{', bad, ": its header does not start with '{' (",
              n == 0 ? "it is empty" : "byte " + StHexByte(header[0]), ")");

  // A header nests 3 deep (header, tensor, shape) and has about 8 values per tensor: these
  // limits pass 500,000 tensors and bound the parse tree to a few hundred MB at worst.
  internal::JsonLimits limits;
  limits.max_depth = 8;
  limits.max_values = int64_t{1} << 22;
  size_t end = 0;
  const JsonValue root = internal::ParseJson(header, limits, bad + ": its header is not valid JSON", &end);
  for (size_t i = end; i < header.size(); ++i) {
    TORCH_CHECK(header[i] == ' ', bad, ": its header has byte ", StHexByte(header[i]), " at byte ", i,
                ", after the JSON (only spaces may pad it)");
  }
  entries_.reserve(root.members.size());
  for (const auto& [key, value] : root.members) {
    if (key == "__metadata__") {
      TORCH_CHECK(value.kind == Kind::kObject, bad, ": its __metadata__ is ", JsonKindName(value.kind),
                  ", not an object of strings");
      metadata_.emplace();
      for (const auto& [k, v] : value.members) {
        TORCH_CHECK(v.kind == Kind::kString, bad, ": its __metadata__ ", StQuoted(k), " is ", JsonKindName(v.kind),
                    ", not a string");
        metadata_->emplace(k, v.text);
      }
      continue;
    }
    entries_.push_back(ParseStEntry(key, value, data_size, bad));
    index_.emplace(key, entries_.size() - 1);
  }

  // The tensors tile the data section, as the Rust crate requires: a byte of no tensor, or
  // of two, is a damaged or crafted file.
  std::vector<size_t> order(entries_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const SafetensorsEntry &x = entries_[a], &y = entries_[b];
    return std::tie(x.begin, x.end, a) < std::tie(y.begin, y.end, b);
  });
  int64_t covered = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const size_t i : order) {
    const SafetensorsEntry& e = entries_[i];
    TORCH_CHECK(e.begin >= covered, bad, ": tensor ", StQuoted(e.name), " at data_offsets [", e.begin, ", ", e.end,
                "] overlaps tensor ", StQuoted(previous->name), " at [", previous->begin, ", ", previous->end, "]");
    TORCH_CHECK(e.begin == covered, bad, ": bytes [", covered, ", ", e.begin,
                ") of the data section belong to no tensor (the gap before tensor ", StQuoted(e.name), ")");
    covered = e.end;
    previous = &e;
  }
  TORCH_CHECK(covered == data_size, bad, ": its data section has ", data_size, " bytes but its tensors end at byte ",
              covered, " (bytes [", covered, ", ", data_size, ") belong to no tensor)");
}

void SafetensorsReader::Fetch(int64_t offset, int64_t size, void* out, const char* caller) const {
  if (size == 0) return;
  if (data_ != nullptr) {
    std::memcpy(out, data_ + offset, static_cast<size_t>(size));
  } else {
    PreadFully(fd_.get(), static_cast<uint64_t>(offset), static_cast<size_t>(size), static_cast<char*>(out), source_,
               caller);
  }
}

void SafetensorsReader::FetchChecked(const SafetensorsEntry& e, int64_t first, int64_t size, void* out,
                                     const char* caller) const {
  try {
    Fetch(data_offset_ + e.begin + first, size, out, caller);
  } catch (const c10::Error& error) {  // the file changed since the header was read
    TORCH_CHECK(false, error.what_without_backtrace(), " (reading tensor ", StQuoted(e.name), ")");
  }
  if (e.dtype != at::kBool) return;
  const auto* bytes = static_cast<const unsigned char*>(out);
  const auto* bad = std::find_if(bytes, bytes + size, [](unsigned char b) { return b > 1; });
  TORCH_CHECK(bad == bytes + size, caller, ": '", source_, "' is not a valid safetensors file: BOOL tensor ",
              StQuoted(e.name), " holds byte ", static_cast<int>(*bad), " at element ", first + (bad - bytes),
              " (a bool is 0 or 1)");
}

const SafetensorsEntry* SafetensorsReader::Find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

const SafetensorsEntry& SafetensorsReader::Entry(const std::string& name) const {
  const SafetensorsEntry* e = Find(name);
  if (e == nullptr) {
    std::vector<std::string> names;
    for (size_t i = 0; i < entries_.size() && i < 8; ++i) names.push_back(StQuoted(entries_[i].name));
    if (entries_.size() > 8) names.push_back("...");
    TORCH_CHECK(false, "SafetensorsReader: '", source_, "' has no tensor ", StQuoted(name), " (it has ",
                entries_.size(), ": ", absl::StrJoin(names, ", "), ")");
  }
  return *e;
}

at::Tensor SafetensorsReader::Read(const std::string& name) const {
  const SafetensorsEntry& e = Entry(name);
  at::Tensor t = at::empty(e.shape, e.dtype);
  FetchChecked(e, 0, e.end - e.begin, t.data_ptr(), "SafetensorsReader::Read");
  return t;
}

void SafetensorsReader::CheckRows(const SafetensorsEntry& e, int64_t row_begin, int64_t row_end,
                                  const char* caller) const {
  TORCH_CHECK(!e.shape.empty(), caller, ": tensor ", StQuoted(e.name), " in '", source_, "' is 0-d: it has no rows");
  TORCH_CHECK(row_begin >= 0 && row_begin <= row_end && row_end <= e.shape[0], caller, ": rows [", row_begin, ", ",
              row_end, ") of tensor ", StQuoted(e.name), " in '", source_, "' are not rows of its ", e.shape[0]);
}

namespace {
int64_t StRowBytes(const SafetensorsEntry& e) { return e.shape[0] == 0 ? 0 : (e.end - e.begin) / e.shape[0]; }
}  // namespace

at::Tensor SafetensorsReader::ReadRows(const std::string& name, int64_t row_begin, int64_t row_end) const {
  constexpr const char* kCaller = "SafetensorsReader::ReadRows";
  const SafetensorsEntry& e = Entry(name);
  CheckRows(e, row_begin, row_end, kCaller);
  std::vector<int64_t> shape = e.shape;
  shape[0] = row_end - row_begin;
  at::Tensor t = at::empty(shape, e.dtype);
  const int64_t row = StRowBytes(e);
  FetchChecked(e, row_begin * row, (row_end - row_begin) * row, t.data_ptr(), kCaller);
  return t;
}

void SafetensorsReader::ReadInto(const std::string& name, const at::Tensor& dest) const {
  constexpr const char* kCaller = "SafetensorsReader::ReadInto";
  const SafetensorsEntry& e = Entry(name);
  if (!e.shape.empty()) return ReadRowsIntoImpl(e, 0, e.shape[0], dest, kCaller);
  TORCH_CHECK(dest.defined(), kCaller, ": the destination of tensor ", StQuoted(e.name), " is an undefined tensor");
  TORCH_CHECK(dest.dim() == 0, kCaller, ": the destination of tensor ", StQuoted(e.name), " (0-d) in '", source_,
              "' has size ", dest.sizes());
  at::Tensor value = at::empty({}, e.dtype);
  FetchChecked(e, 0, e.end - e.begin, value.data_ptr(), kCaller);
  dest.copy_(value);
}

void SafetensorsReader::ReadRowsInto(const std::string& name, int64_t row_begin, int64_t row_end,
                                     const at::Tensor& dest) const {
  constexpr const char* kCaller = "SafetensorsReader::ReadRowsInto";
  const SafetensorsEntry& e = Entry(name);
  CheckRows(e, row_begin, row_end, kCaller);
  ReadRowsIntoImpl(e, row_begin, row_end, dest, kCaller);
}

void SafetensorsReader::ReadRowsIntoImpl(const SafetensorsEntry& e, int64_t row_begin, int64_t row_end,
                                         const at::Tensor& dest, const char* caller) const {
  TORCH_CHECK(dest.defined(), caller, ": the destination of tensor ", StQuoted(e.name), " is an undefined tensor");
  std::vector<int64_t> shape = e.shape;
  shape[0] = row_end - row_begin;
  TORCH_CHECK(dest.sizes() == shape, caller, ": the destination of rows [", row_begin, ", ", row_end, ") of tensor ",
              StQuoted(e.name), " in '", source_, "' has size ", dest.sizes(), ", not ", ShapeString(shape));
  const int64_t row = StRowBytes(e);
  if (row == 0 || row_end == row_begin) return;
  if (dest.device().is_cpu() && dest.layout() == at::kStrided && dest.scalar_type() == e.dtype &&
      dest.is_contiguous() && !dest.is_conj() && !dest.is_neg()) {
    FetchChecked(e, row_begin * row, (row_end - row_begin) * row, dest.data_ptr(), caller);
    return;
  }
  const int64_t rows_per_block = std::max<int64_t>(1, kBlockBytes / row);
  shape[0] = std::min(rows_per_block, row_end - row_begin);
  const at::Tensor block = at::empty(shape, e.dtype);
  for (int64_t r = row_begin; r < row_end; r += rows_per_block) {
    const int64_t n = std::min(rows_per_block, row_end - r);
    const at::Tensor part = block.narrow(0, 0, n);
    FetchChecked(e, r * row, n * row, part.data_ptr(), caller);
    dest.narrow(0, r - row_begin, n).copy_(part);
  }
}

void SafetensorsReader::ReadDataBytes(const SafetensorsEntry& e, int64_t begin, int64_t end, void* out,
                                      const char* caller) const {
  TORCH_CHECK(begin >= 0 && begin <= end && end <= e.end - e.begin, caller, ": bytes [", begin, ", ", end,
              ") of tensor ", StQuoted(e.name), " in '", source_, "' are not inside its ", e.end - e.begin, " bytes");
  FetchChecked(e, begin, end - begin, out, caller);
}

void SafetensorsReader::ReadBytes(const std::string& name, int64_t begin, int64_t end, void* out) const {
  const SafetensorsEntry& e = Entry(name);
  TORCH_CHECK(begin >= 0 && begin <= end && end <= e.end - e.begin, "SafetensorsReader::ReadBytes: bytes [", begin,
              ", ", end, ") of tensor ", StQuoted(e.name), " in '", source_, "' are not inside its ", e.end - e.begin,
              " bytes");
  Fetch(data_offset_ + e.begin + begin, end - begin, out, "SafetensorsReader::ReadBytes");
}

TensorDict LoadSafetensors(const std::string& path) {
  const SafetensorsReader reader(path);
  TensorDict dict;
  for (const SafetensorsEntry& e : reader.entries()) dict.insert(e.name, reader.Read(e.name));
  return dict;
}

}  // namespace fsdp::checkpoint
