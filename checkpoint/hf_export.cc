// The write side of hf_checkpoint.h: the files of a consolidated export and writes of any
// box of a tensor into its place.
#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "checkpoint/file_io.h"
#include "checkpoint/hf_checkpoint.h"
#include "checkpoint/json.h"

namespace fsdp::checkpoint {
namespace {

int64_t TensorBytes(const HfExportTensor& t) {
  int64_t n = static_cast<int64_t>(c10::elementSize(t.dtype));
  for (int64_t s : t.shape) {
    TORCH_CHECK(s >= 0 && !__builtin_mul_overflow(n, s, &n), "HfExportLayout: tensor '", t.name,
                "' has a size that is negative or overflows: ", c10::IntArrayRef(t.shape));
  }
  return n;
}

void PwriteFully(int fd, int64_t offset, const char* data, int64_t size, const std::string& path,
                 const std::string& caller) {
  while (size > 0) {
    const ssize_t n = ::pwrite(fd, data, static_cast<size_t>(size), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, caller, ": writing bytes [", offset, ", ", offset + size, ") of '", path, "' failed (",
                n < 0 ? std::strerror(errno) : "no progress", ")");
    data += n;
    offset += n;
    size -= n;
  }
}

}  // namespace

HfExportLayout::HfExportLayout(const std::vector<HfExportTensor>& tensors, int64_t max_shard_size) {
  // huggingface_hub/serialization/_base.py split_state_dict_into_shards_factory.
  std::vector<std::vector<SafetensorsEntry>> shards;
  std::vector<SafetensorsEntry> current;
  int64_t current_size = 0;
  absl::flat_hash_map<std::string, bool> seen;
  for (const HfExportTensor& t : tensors) {
    TORCH_CHECK(seen.emplace(t.name, true).second, "HfExportLayout: tensor '", t.name, "' is given twice");
    order_.push_back(t.name);
    const int64_t size = TensorBytes(t);
    total_size_ += size;
    SafetensorsEntry e{t.name, t.dtype, t.shape, 0, 0};
    if (max_shard_size > 0 && size > max_shard_size) {
      shards.push_back({std::move(e)});
      continue;
    }
    if (max_shard_size > 0 && current_size + size > max_shard_size && !current.empty()) {
      shards.push_back(std::move(current));
      current.clear();
      current_size = 0;
    }
    current.push_back(std::move(e));
    current_size += size;
  }
  if (!current.empty() || shards.empty()) shards.push_back(std::move(current));
  const int64_t count = static_cast<int64_t>(shards.size());
  for (size_t i = 0; i < shards.size(); ++i) {
    names_.push_back(HfFileName(static_cast<int64_t>(i) + 1, count));
    files_.push_back(LayOutSafetensors(std::move(shards[i]), SafetensorsMetadata{{"format", "pt"}}, "HfExportLayout"));
    for (size_t j = 0; j < files_.back().entries.size(); ++j) index_[files_.back().entries[j].name] = {i, j};
  }
}

const SafetensorsEntry* HfExportLayout::Find(const std::string& key, size_t* file) const {
  const auto it = index_.find(key);
  if (it == index_.end()) return nullptr;
  *file = it->second.first;
  return &files_[it->second.first].entries[it->second.second];
}

std::string HfExportLayout::IndexJson() const {
  // json.dump(..., indent=2) of PyTorch's _write_overall_metadata_file: keys in the order
  // given (its dict follows the fqn mapping's order).
  std::string out =
      absl::StrCat("{\n  \"metadata\": {\n    \"total_size\": ", total_size_, "\n  },\n  \"weight_map\": {");
  for (size_t i = 0; i < order_.size(); ++i) {
    out += i == 0 ? "\n    " : ",\n    ";
    internal::AppendJsonString(order_[i], &out);
    out += ": ";
    internal::AppendJsonString(names_[index_.at(order_[i]).first], &out);
  }
  out += order_.empty() ? "}\n}" : "\n  }\n}";
  return out;
}

void HfExportLayout::CreateFile(const std::string& dir, size_t file, const char* caller) const {
  const std::string path = JoinPath(dir, names_[file]);
  ScopedFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  TORCH_CHECK(fd.get() >= 0, caller, ": cannot create '", path, "' (", std::strerror(errno), ")");
  const SafetensorsLayout& l = files_[file];
  PwriteFully(fd.get(), 0, l.head.data(), static_cast<int64_t>(l.head.size()), path, caller);
  TORCH_CHECK(::ftruncate(fd.get(), static_cast<off_t>(l.file_size())) == 0, caller, ": cannot size '", path, "' to ",
              l.file_size(), " bytes (", std::strerror(errno), ")");
}

HfExportWriter::HfExportWriter(const HfExportLayout& layout, std::string dir, std::string caller)
    : layout_(layout), dir_(std::move(dir)), caller_(std::move(caller)), fds_(layout.file_count(), -1) {}

HfExportWriter::~HfExportWriter() {
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
}

int HfExportWriter::FileFd(size_t file) {
  if (fds_[file] < 0) {
    const std::string path = JoinPath(dir_, layout_.file_name(file));
    fds_[file] = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    TORCH_CHECK(fds_[file] >= 0, caller_, ": cannot open '", path, "' for writing (", std::strerror(errno), ")");
  }
  return fds_[file];
}

template <class Fn>
void HfExportWriter::ForEachRun(const std::vector<int64_t>& global, const std::vector<int64_t>& offsets,
                                const std::vector<int64_t>& shape, Fn&& fn) {
  const int64_t dims = static_cast<int64_t>(global.size());
  if (dims == 0) return fn(int64_t{0}, int64_t{0}, int64_t{1});
  std::vector<int64_t> gstride(dims, 1), bstride(dims, 1);
  for (int64_t d = dims - 2; d >= 0; --d) {
    gstride[d] = gstride[d + 1] * global[d + 1];
    bstride[d] = bstride[d + 1] * shape[d + 1];
  }
  int64_t k = dims - 1;  // dims after k are whole in the box: a run covers dim k's part and them
  while (k > 0 && shape[k] == global[k]) --k;
  const int64_t run = shape[k] * bstride[k];
  if (run == 0) return;
  int64_t runs = 1;
  for (int64_t d = 0; d < k; ++d) runs *= shape[d];
  std::vector<int64_t> idx(k, 0);
  for (int64_t r = 0; r < runs; ++r) {
    int64_t src = 0, dst = offsets[k] * gstride[k];
    for (int64_t d = 0; d < k; ++d) {
      src += idx[d] * bstride[d];
      dst += (offsets[d] + idx[d]) * gstride[d];
    }
    fn(src, dst, run);
    for (int64_t d = k - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

void HfExportWriter::Write(const std::string& key, const std::vector<int64_t>& offsets, const at::Tensor& src) {
  size_t file = 0;
  const SafetensorsEntry* e = layout_.Find(key, &file);
  TORCH_CHECK(e != nullptr, caller_, ": the export has no tensor '", key, "'");
  TORCH_CHECK(src.dim() == static_cast<int64_t>(e->shape.size()) && offsets.size() == e->shape.size(), caller_,
              ": the box of '", key, "' at offsets ", c10::IntArrayRef(offsets), " of size ", src.sizes(),
              " does not have the dimensions of its shape ", c10::IntArrayRef(e->shape));
  for (size_t d = 0; d < offsets.size(); ++d) {
    TORCH_CHECK(offsets[d] >= 0 && offsets[d] + src.size(static_cast<int64_t>(d)) <= e->shape[d], caller_,
                ": the box of '", key, "' at offsets ", c10::IntArrayRef(offsets), " of size ", src.sizes(),
                " lies outside its shape ", c10::IntArrayRef(e->shape));
  }
  const int fd = FileFd(file);
  const std::string path = JoinPath(dir_, layout_.file_name(file));
  const int64_t item = static_cast<int64_t>(c10::elementSize(e->dtype));
  const int64_t base = static_cast<int64_t>(layout_.file(file).head.size()) + e->begin;
  // Runs are ranges of src's row-major order: a src with other strides is copied once.
  const at::Tensor flat = src.detach().is_contiguous() ? src.detach().view({-1}) : src.detach().reshape({-1});
  const std::vector<int64_t> shape = src.sizes().vec();
  const int64_t per_block = std::max<int64_t>(1, HfCheckpointReader::kBlockBytes / item);
  at::Tensor block;
  ForEachRun(e->shape, offsets, shape, [&](int64_t from, int64_t to, int64_t n) {
    for (int64_t at = 0; at < n; at += per_block) {
      const int64_t m = std::min(per_block, n - at);
      at::Tensor part = flat.narrow(0, from + at, m);
      if (!part.is_cpu() || part.scalar_type() != e->dtype || !part.is_contiguous() || part.is_conj() ||
          part.is_neg()) {
        if (!block.defined() || block.numel() < m) block = at::empty({std::min(per_block, n)}, e->dtype);
        at::Tensor b = block.narrow(0, 0, m);
        b.copy_(part);
        part = b;
      }
      PwriteFully(fd, base + (to + at) * item, static_cast<const char*>(part.const_data_ptr()), m * item, path,
                  caller_);
    }
  });
}

void HfExportWriter::Copy(const HfCheckpointReader& reader, const HfTensor& t, const HfChunk& c) {
  // Reads the chunk a block of rows at a time (bounded memory) and writes each block's box.
  const SafetensorsEntry& e = *c.entry;
  if (e.shape.empty() || e.shape[0] == 0) {
    const at::Tensor v = at::empty(e.shape, e.dtype);
    if (v.numel() > 0) reader.ReadInto(t.name, c.offsets, v);
    if (v.numel() > 0) Write(t.name, c.offsets, v);
    return;
  }
  int64_t row = static_cast<int64_t>(c10::elementSize(e.dtype));
  for (size_t d = 1; d < e.shape.size(); ++d) row *= e.shape[d];
  const int64_t per_block = std::max<int64_t>(1, HfCheckpointReader::kBlockBytes / std::max<int64_t>(row, 1));
  std::vector<int64_t> shape = e.shape;
  shape[0] = std::min(per_block, e.shape[0]);
  const at::Tensor block = at::empty(shape, e.dtype);
  std::vector<int64_t> offsets = c.offsets;
  for (int64_t r = 0; r < e.shape[0]; r += per_block) {
    const int64_t n = std::min(per_block, e.shape[0] - r);
    const at::Tensor part = block.narrow(0, 0, n);
    offsets[0] = c.offsets[0] + r;
    reader.ReadInto(t.name, offsets, part);
    Write(t.name, offsets, part);
  }
}

void HfExportWriter::Sync() {
  for (size_t f = 0; f < fds_.size(); ++f) {
    if (fds_[f] < 0) continue;
    TORCH_CHECK(::fsync(fds_[f]) == 0, caller_, ": fsync of '", JoinPath(dir_, layout_.file_name(f)), "' failed (",
                std::strerror(errno), ")");
  }
}

}  // namespace fsdp::checkpoint
