// The read side of hf_checkpoint.h: a Hugging Face directory's files and index, the chunks
// of each tensor, and reads of any box of a tensor.
#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/file_io.h"
#include "checkpoint/hf_checkpoint.h"
#include "checkpoint/json.h"

namespace fsdp::checkpoint {
namespace {

using internal::JsonValue;
using Kind = internal::JsonValue::Kind;

std::string Quoted(const std::string& s) { return absl::StrCat("'", s.substr(0, 200), s.size() > 200 ? "...'" : "'"); }

std::string Shape(const std::vector<int64_t>& s) { return c10::str(c10::IntArrayRef(s)); }

const JsonValue* Member(const JsonValue& object, const std::string& key) {
  for (const internal::JsonMember& m : object.members) {
    if (m.key == key) return &m.value;
  }
  return nullptr;
}

// A file name an index may give: a plain name inside the directory.
bool PlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

// The DCP_SHARDING_INFO of a file, parsed: key -> saved_offsets.
std::map<std::string, std::vector<int64_t>> ShardingInfo(const SafetensorsReader& file, const std::string& caller) {
  std::map<std::string, std::vector<int64_t>> out;
  if (!file.metadata().has_value()) return out;
  const auto it = file.metadata()->find(kHfShardingInfoKey);
  if (it == file.metadata()->end()) return out;
  const std::string what = absl::StrCat(caller, ": the ", kHfShardingInfoKey, " metadata of '", file.source(), "'");
  size_t end = 0;
  const JsonValue info = internal::ParseJson(it->second, internal::JsonLimits{}, what, &end);
  TORCH_CHECK(info.kind == Kind::kObject, what, " is ", internal::JsonKindName(info.kind), ", not an object");
  for (const internal::JsonMember& m : info.members) {
    const JsonValue* offsets = m.value.kind == Kind::kObject ? Member(m.value, kHfSavedOffsetsKey) : nullptr;
    TORCH_CHECK(offsets != nullptr && offsets->kind == Kind::kArray, what, ": the entry of ", Quoted(m.key),
                " is not {\"", kHfSavedOffsetsKey, "\": [...]}");
    std::vector<int64_t>& o = out[m.key];
    for (const JsonValue& v : offsets->items) {
      int64_t x = -1;
      TORCH_CHECK(v.kind == Kind::kNumber && absl::SimpleAtoi(v.text, &x) && x >= 0, what, ": ", Quoted(m.key),
                  " has saved offset ", v.kind == Kind::kNumber ? v.text : internal::JsonKindName(v.kind),
                  " (offsets are non-negative integers)");
      o.push_back(x);
    }
  }
  return out;
}

}  // namespace

std::string HfFileName(int64_t index, int64_t count, int64_t shard_index) {
  char buf[96];
  if (shard_index >= 0) {
    std::snprintf(buf, sizeof(buf), "shard-%05lld-model-%05lld-of-%05lld.safetensors",
                  static_cast<long long>(shard_index), static_cast<long long>(index), static_cast<long long>(count));
  } else {
    std::snprintf(buf, sizeof(buf), "model-%05lld-of-%05lld.safetensors", static_cast<long long>(index),
                  static_cast<long long>(count));
  }
  return buf;
}

SafetensorsMetadata HfShardingMetadata(const std::vector<std::pair<std::string, std::vector<int64_t>>>& offsets) {
  // json.dumps' default separators: ", " and ": ".
  std::string info = "{";
  for (const auto& [key, o] : offsets) {
    if (info.size() > 1) info += ", ";
    internal::AppendJsonString(key, &info);
    absl::StrAppend(&info, ": {\"", kHfSavedOffsetsKey, "\": [");
    for (size_t d = 0; d < o.size(); ++d) absl::StrAppend(&info, d == 0 ? "" : ", ", o[d]);
    info += "]}";
  }
  info += "}";
  return {{kHfShardingInfoKey, info}, {"DCP_VERSION", "1.0"}, {"format", "pt"}};
}

int64_t ParseHfSize(const std::string& text, const std::string& what) {
  const std::string s(absl::StripAsciiWhitespace(text));
  int64_t bytes = 0;
  if (absl::SimpleAtoi(s, &bytes)) {
    TORCH_CHECK(bytes > 0, what, ": '", text, "' is not a positive size");
    return bytes;
  }
  static const std::pair<const char*, double> kUnits[] = {{"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}};
  const std::string unit = s.size() >= 2 ? absl::AsciiStrToUpper(s.substr(s.size() - 2)) : "";
  for (const auto& [name, scale] : kUnits) {
    if (unit != name) continue;
    double value = 0;
    const bool ok = absl::SimpleAtod(absl::StripAsciiWhitespace(s.substr(0, s.size() - 2)), &value);
    TORCH_CHECK(ok && value > 0 && value * scale < 9.2e18, what, ": '", text,
                "' is not a size (a number and one of TB, GB, MB, KB, or a byte count)");
    return static_cast<int64_t>(value * scale);
  }
  TORCH_CHECK(false, what, ": '", text, "' is not a size (a number and one of TB, GB, MB, KB, or a byte count)");
  return 0;  // unreachable: TORCH_CHECK(false) throws
}

HfCheckpointReader::HfCheckpointReader(std::string dir, std::string caller)
    : dir_(std::move(dir)), caller_(std::move(caller)) {
  namespace fs = std::filesystem;
  std::error_code ec;
  TORCH_CHECK(fs::is_directory(dir_, ec), caller_, ": '", dir_, "' is not a directory");
  const std::string index_path = JoinPath(dir_, kHfIndexFile);
  // key -> the file the index names (checked below once the files are open).
  std::vector<std::pair<std::string, std::string>> weight_map;
  std::vector<std::string> names;
  if (fs::exists(index_path, ec)) {
    const std::vector<char> bytes = ReadFile(index_path, caller_);
    const std::string what = absl::StrCat(caller_, ": '", index_path, "'");
    size_t end = 0;
    const JsonValue index =
        internal::ParseJson(std::string_view(bytes.data(), bytes.size()), internal::JsonLimits{}, what, &end);
    TORCH_CHECK(index.kind == Kind::kObject, what, " is ", internal::JsonKindName(index.kind), ", not an object");
    const JsonValue* map = Member(index, "weight_map");
    TORCH_CHECK(map != nullptr && map->kind == Kind::kObject, what, " has no \"weight_map\" object");
    for (const internal::JsonMember& m : map->members) {
      TORCH_CHECK(m.value.kind == Kind::kString && PlainFileName(m.value.text), what, ": the file of ", Quoted(m.key),
                  " is ", m.value.kind == Kind::kString ? Quoted(m.value.text) : internal::JsonKindName(m.value.kind),
                  ", not a file name in the directory");
      weight_map.emplace_back(m.key, m.value.text);
      if (std::find(names.begin(), names.end(), m.value.text) == names.end()) names.push_back(m.value.text);
    }
    std::sort(names.begin(), names.end());
  } else {
    for (const fs::directory_entry& e : fs::directory_iterator(dir_, ec)) {
      const std::string name = e.path().filename().string();
      if (absl::EndsWith(name, ".safetensors") && e.is_regular_file(ec)) names.push_back(name);
    }
    TORCH_CHECK(!ec, caller_, ": cannot list '", dir_, "' (", ec.message(), ")");
    std::sort(names.begin(), names.end());
    TORCH_CHECK(!names.empty(), caller_, ": '", dir_, "' holds neither ", kHfIndexFile,
                " nor *.safetensors files: not a Hugging Face checkpoint");
  }

  absl::flat_hash_map<std::string, size_t> file_of;
  for (const std::string& name : names) {
    file_of.emplace(name, files_.size());
    files_.push_back(std::make_unique<SafetensorsReader>(JoinPath(dir_, name)));
  }
  for (const auto& [key, name] : weight_map) {
    const SafetensorsReader& f = *files_[file_of.at(name)];
    TORCH_CHECK(f.Find(key) != nullptr, caller_, ": '", index_path, "' puts ", Quoted(key), " in '", name,
                "', which has no such tensor");
  }

  for (size_t fi = 0; fi < files_.size(); ++fi) {
    const SafetensorsReader& f = *files_[fi];
    const std::map<std::string, std::vector<int64_t>> info = ShardingInfo(f, caller_);
    const bool sharded = f.metadata().has_value() && f.metadata()->count(kHfShardingInfoKey) > 0;
    for (const SafetensorsEntry& e : f.entries()) {
      HfChunk chunk{fi, &e, std::vector<int64_t>(e.shape.size(), 0)};
      if (sharded) {
        const auto it = info.find(e.name);
        TORCH_CHECK(it != info.end(), caller_, ": the ", kHfShardingInfoKey, " metadata of '", f.source(),
                    "' has no entry for its tensor ", Quoted(e.name));
        TORCH_CHECK(it->second.size() == e.shape.size(), caller_, ": the ", kHfShardingInfoKey, " metadata of '",
                    f.source(), "' gives ", Quoted(e.name), " of shape ", Shape(e.shape), " the offsets ",
                    Shape(it->second));
        chunk.offsets = it->second;
      }
      auto [pos, inserted] = index_.emplace(e.name, tensors_.size());
      if (inserted) tensors_.push_back(HfTensor{e.name, e.dtype, {}, {}});
      HfTensor& t = tensors_[pos->second];
      if (!t.chunks.empty()) {
        const SafetensorsEntry& first = *t.chunks.front().entry;
        TORCH_CHECK(sharded && first.dtype == e.dtype && first.shape.size() == e.shape.size(), caller_, ": ",
                    Quoted(e.name), " is in both '", files_[t.chunks.front().file]->source(), "' and '", f.source(),
                    "'",
                    sharded ? absl::StrCat(" with another dtype or rank (", c10::toString(first.dtype), " ",
                                           Shape(first.shape), " vs ", c10::toString(e.dtype), " ", Shape(e.shape), ")")
                            : std::string(" (only per-rank files with DCP_SHARDING_INFO may split a tensor)"));
      }
      t.chunks.push_back(std::move(chunk));
    }
  }

  // Global sizes, then the tiling: no two chunks overlap and their volumes sum to the size.
  for (HfTensor& t : tensors_) {
    const size_t dims = t.chunks.front().offsets.size();
    t.size.assign(dims, 0);
    for (const HfChunk& c : t.chunks) {
      for (size_t d = 0; d < dims; ++d) {
        int64_t extent = 0;
        TORCH_CHECK(!__builtin_add_overflow(c.offsets[d], c.entry->shape[d], &extent), caller_, ": ", Quoted(t.name),
                    " in '", files_[c.file]->source(), "' has offsets ", Shape(c.offsets), " that overflow");
        t.size[d] = std::max(t.size[d], extent);
      }
    }
    if (t.chunks.size() == 1 &&
        std::all_of(t.chunks[0].offsets.begin(), t.chunks[0].offsets.end(), [](int64_t o) { return o == 0; })) {
      continue;
    }
    int64_t volume = 0, numel = 1;
    bool overflow = false;
    for (int64_t s : t.size) overflow |= __builtin_mul_overflow(numel, s, &numel);
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      const HfChunk& a = t.chunks[i];
      int64_t v = 1;
      for (int64_t s : a.entry->shape) v *= s;  // bounded by the file's bytes
      volume += v;
      for (size_t j = 0; j < i; ++j) {
        const HfChunk& b = t.chunks[j];
        bool overlap = v > 0;
        for (size_t d = 0; d < dims && overlap; ++d) {
          overlap = a.offsets[d] < b.offsets[d] + b.entry->shape[d] && b.offsets[d] < a.offsets[d] + a.entry->shape[d];
        }
        TORCH_CHECK(!overlap, caller_, ": the chunks of ", Quoted(t.name), " in '", files_[a.file]->source(),
                    "' (offsets ", Shape(a.offsets), ") and '", files_[b.file]->source(), "' (offsets ",
                    Shape(b.offsets), ") overlap");
      }
    }
    TORCH_CHECK(!overflow && volume == numel, caller_, ": the chunks of ", Quoted(t.name), " in '", dir_, "' hold ",
                volume, " of the ", overflow ? std::string("too many") : std::to_string(numel),
                " elements of its size ", Shape(t.size), " (a rank's file is missing?)");
  }
}

const HfTensor* HfCheckpointReader::Find(const std::string& key) const {
  const auto it = index_.find(key);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void HfCheckpointReader::ReadInto(const std::string& key, const std::vector<int64_t>& dest_offsets,
                                  const at::Tensor& dest) const {
  const HfTensor* t = Find(key);
  TORCH_CHECK(t != nullptr, caller_, ": the checkpoint '", dir_, "' has no tensor ", Quoted(key));
  TORCH_CHECK(dest.defined(), caller_, ": the destination of ", Quoted(key), " is an undefined tensor");
  const size_t dims = t->size.size();
  const std::string box =
      absl::StrCat("the box at offsets ", Shape(dest_offsets), " of size ", Shape(dest.sizes().vec()));
  TORCH_CHECK(dest.dim() == static_cast<int64_t>(dims) && dest_offsets.size() == dims, caller_, ": ", box,
              " does not have the ", dims, " dimensions of ", Quoted(key), " (size ", Shape(t->size), ")");
  for (size_t d = 0; d < dims; ++d) {
    TORCH_CHECK(dest_offsets[d] >= 0 && dest_offsets[d] <= t->size[d] && dest.size(d) <= t->size[d] - dest_offsets[d],
                caller_, ": ", box, " lies outside ", Quoted(key), " of size ", Shape(t->size));
  }
  const at::Tensor out = dest.detach();
  for (const HfChunk& c : t->chunks) {
    std::vector<int64_t> lo(dims), len(dims);
    int64_t volume = 1;
    for (size_t d = 0; d < dims; ++d) {
      lo[d] = std::max(c.offsets[d], dest_offsets[d]);
      len[d] = std::min(c.offsets[d] + c.entry->shape[d], dest_offsets[d] + dest.size(d)) - lo[d];
      volume *= std::max<int64_t>(len[d], 0);
    }
    if (volume == 0) continue;
    at::Tensor dst = out;
    std::vector<int64_t> src_lo(dims);
    for (size_t d = 0; d < dims; ++d) {
      dst = dst.narrow(static_cast<int64_t>(d), lo[d] - dest_offsets[d], len[d]);
      src_lo[d] = lo[d] - c.offsets[d];
    }
    ReadChunk(c, src_lo, dst);
  }
}

// The overlap `dst` (sizes: the overlap's) starts at src_lo in the chunk. Dims after k are
// whole in the overlap, so for each index of dims [0, k) the overlap is one contiguous run of
// the chunk's bytes.
void HfCheckpointReader::ReadChunk(const HfChunk& c, const std::vector<int64_t>& src_lo, const at::Tensor& dst) const {
  const SafetensorsReader& f = *files_[c.file];
  const SafetensorsEntry& e = *c.entry;
  const int64_t item = static_cast<int64_t>(c10::elementSize(e.dtype));
  const int64_t dims = static_cast<int64_t>(e.shape.size());
  const auto cpu = at::TensorOptions().dtype(e.dtype);
  if (dims == 0) {
    at::Tensor v = at::empty({}, cpu);
    f.ReadDataBytes(e, 0, item, v.data_ptr(), caller_.c_str());
    dst.copy_(v);
    return;
  }
  std::vector<int64_t> stride(dims, 1);  // of the chunk, in elements
  for (int64_t d = dims - 2; d >= 0; --d) stride[d] = stride[d + 1] * e.shape[d + 1];
  int64_t k = dims - 1;
  while (k > 0 && dst.size(k) == e.shape[k]) --k;
  const bool direct = dst.is_cpu() && dst.layout() == at::kStrided && dst.scalar_type() == e.dtype &&
                      dst.is_contiguous() && !dst.is_conj() && !dst.is_neg();
  if (k == 0) {  // one byte range: whole rows of the chunk
    const int64_t row = stride[0] * item, first = src_lo[0] * row, rows = dst.size(0);
    if (direct) return f.ReadDataBytes(e, first, first + rows * row, dst.data_ptr(), caller_.c_str());
    const int64_t per_block = std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(row, 1));
    std::vector<int64_t> shape = e.shape;
    shape[0] = std::min(per_block, rows);
    const at::Tensor block = at::empty(shape, cpu);
    for (int64_t r = 0; r < rows; r += per_block) {
      const int64_t n = std::min(per_block, rows - r);
      const at::Tensor part = block.narrow(0, 0, n);
      f.ReadDataBytes(e, first + r * row, first + (r + n) * row, part.data_ptr(), caller_.c_str());
      dst.narrow(0, r, n).copy_(part);
    }
    return;
  }
  // One run per index of dims [0, k): the overlap's part of dim k, with everything after it.
  std::vector<int64_t> run_shape(e.shape.begin() + k, e.shape.end());
  run_shape[0] = dst.size(k);
  const int64_t run_bytes = run_shape[0] * stride[k] * item;
  const at::Tensor scratch = at::empty(run_shape, cpu);
  std::vector<int64_t> idx(k, 0);
  const int64_t runs = [&] {
    int64_t n = 1;
    for (int64_t d = 0; d < k; ++d) n *= dst.size(d);
    return n;
  }();
  for (int64_t r = 0; r < runs; ++r) {
    int64_t elem = src_lo[k] * stride[k];
    at::Tensor sub = dst;
    for (int64_t d = 0; d < k; ++d) {
      elem += (src_lo[d] + idx[d]) * stride[d];
      sub = sub.select(0, idx[d]);
    }
    f.ReadDataBytes(e, elem * item, elem * item + run_bytes, scratch.data_ptr(), caller_.c_str());
    sub.copy_(scratch);
    for (int64_t d = k - 1; d >= 0; --d) {  // the next index, row-major
      if (++idx[d] < dst.size(d)) break;
      idx[d] = 0;
    }
  }
}

}  // namespace fsdp::checkpoint
