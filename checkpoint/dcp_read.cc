// The read side of dcp_storage.h: ReadMetadata, DcpReader (ReadInto, ReadBytes).
//
// How a box is read (DcpReader::ReadInto), per stored chunk that overlaps it:
//  1. The chunk is a torch.save archive inside its data file. Only its zip directory, local
//     headers and pickle are read (LocateCheckpointTensor): they give the tensor's dtype,
//     sizes and strides and where its storage's bytes lie.
//  2. The storage's bytes are read once, front to back, in blocks of at most kBlockBytes, and
//     every block goes through the record's CRC-32 right after its pread, while it is still
//     in the cache. The part of the record the box needs is read straight into the
//     destination when that part is one byte range of the record and the destination's part
//     is contiguous (the usual case: Shard(0) chunks and shards, or a whole chunk); otherwise
//     (another sharding dim, a strided destination) rows of the chunk go through the scratch
//     block and their overlap is copied. The rest of the record is read through the scratch
//     block only for the CRC (PyTorch's FileSystemReader reads such a chunk whole).
//  So memory beyond the destination is one scratch block: kBlockBytes, or one dim-0 row of a
//  chunk when a row is larger, or a whole chunk in the rare case of a chunk stored with
//  non-contiguous strides.
#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/crc32.h"
#include "checkpoint/dcp_storage.h"
#include "checkpoint/file_io.h"

namespace fsdp::checkpoint {
namespace {

// The bytes a view of a contiguous tensor spans, when they are one range: [begin, end).
bool ContiguousRange(const at::Tensor& view, int64_t* begin, int64_t* end) {
  if (!view.is_contiguous()) return false;
  const int64_t item = static_cast<int64_t>(view.element_size());
  *begin = view.storage_offset() * item;
  *end = *begin + view.numel() * item;
  return true;
}

}  // namespace

struct DcpReader::OpenFile {
  ScopedFd fd;
  int64_t size = 0;
};

DcpReader::DcpReader(std::string dir, const DcpMetadata& metadata, const char* caller)
    : dir_(std::move(dir)), md_(metadata), caller_(caller) {}

DcpReader::~DcpReader() = default;

const DcpEntry& DcpReader::Entry(const std::string& fqn) const {
  const DcpEntry* e = md_.Find(fqn);
  if (e == nullptr) {
    std::vector<std::string> names;
    for (size_t i = 0; i < md_.entries.size() && i < 8; ++i) names.push_back("'" + md_.entries[i].fqn + "'");
    if (md_.entries.size() > 8) names.push_back("...");
    TORCH_CHECK(false, caller_, ": the checkpoint '", dir_, "' has no entry '", fqn, "' (it has ", md_.entries.size(),
                ": ", absl::StrJoin(names, ", "), ")");
  }
  return *e;
}

DcpReader::OpenFile& DcpReader::File(const DcpStorageInfo& s, const std::string& item) {
  auto it = files_.find(s.relative_path);
  const std::string path = JoinPath(dir_, s.relative_path);
  if (it == files_.end()) {
    auto f = std::make_unique<OpenFile>();
    f->fd = ScopedFd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    TORCH_CHECK(f->fd.get() >= 0, caller_, ": cannot open '", path, "' (holding ", item, ") for reading (",
                std::strerror(errno), ")");
    struct stat st {};
    TORCH_CHECK(::fstat(f->fd.get(), &st) == 0 && S_ISREG(st.st_mode), caller_, ": '", path, "' is not a regular file");
    f->size = st.st_size;
    it = files_.emplace(s.relative_path, std::move(f)).first;
  }
  TORCH_CHECK(s.offset <= it->second->size && s.length <= it->second->size - s.offset, caller_, ": ", item,
              " is stored at bytes [", s.offset, ", ", s.offset + s.length, ") of '", path, "', which has only ",
              it->second->size, " bytes (truncated?)");
  return *it->second;
}

char* DcpReader::Scratch(size_t size) {
  if (!scratch_.defined() || static_cast<size_t>(scratch_.numel()) < size) {
    scratch_ = at::Tensor();                                        // the old block first: never two at once
    scratch_ = at::empty({static_cast<int64_t>(size)}, at::kByte);  // c10's allocator: memory tests see it
  }
  return static_cast<char*>(scratch_.data_ptr());
}

std::vector<char> DcpReader::ReadBytes(const std::string& fqn) {
  const DcpEntry& e = Entry(fqn);
  TORCH_CHECK(e.is_bytes, caller_, ": '", fqn, "' in '", dir_, "' is a tensor, not a bytes entry (ReadInto reads it)");
  const std::string item = absl::StrCat("bytes entry '", fqn, "'");
  OpenFile& f = File(e.bytes_storage, item);
  std::vector<char> bytes(e.bytes_storage.length);
  PreadFully(f.fd.get(), e.bytes_storage.offset, bytes.size(), bytes.data(),
             JoinPath(dir_, e.bytes_storage.relative_path), caller_);
  return bytes;
}

void DcpReader::ForEachOverlap(
    const std::string& fqn, const std::vector<int64_t>& dest_offsets, const at::Tensor& dest,
    const std::function<void(const DcpEntry&, const DcpChunk&, const std::vector<int64_t>&, const at::Tensor&)>& fn) {
  const DcpEntry& e = Entry(fqn);
  TORCH_CHECK(!e.is_bytes, caller_, ": '", fqn, "' in '", dir_,
              "' is a bytes entry, not a tensor (ReadBytes reads it)");
  TORCH_CHECK(dest.defined(), caller_, ": the destination of '", fqn, "' is an undefined tensor");
  TORCH_CHECK(dest.scalar_type() == e.properties.dtype, caller_, ": '", fqn, "' in '", dir_, "' is stored as ",
              c10::toString(e.properties.dtype), ", the destination is ", c10::toString(dest.scalar_type()));
  const size_t dims = e.size.size();
  const std::string box = absl::StrCat("the box at offsets ", c10::str(c10::IntArrayRef(dest_offsets)), " of size ",
                                       c10::str(c10::IntArrayRef(dest.sizes())));
  TORCH_CHECK(dest.dim() == static_cast<int64_t>(dims) && dest_offsets.size() == dims, caller_, ": ", box,
              " does not have the ", dims, " dimensions of '", fqn, "' (size ", c10::str(c10::IntArrayRef(e.size)),
              ")");
  for (size_t d = 0; d < dims; ++d) {
    TORCH_CHECK(dest_offsets[d] >= 0 && dest_offsets[d] <= e.size[d] && dest.size(d) <= e.size[d] - dest_offsets[d],
                caller_, ": ", box, " lies outside '", fqn, "' of size ", c10::str(c10::IntArrayRef(e.size)));
  }
  const at::Tensor out = dest.detach();  // a leaf that requires grad is filled like its data
  int64_t covered = 0;
  for (const DcpChunk& c : e.chunks) {
    std::vector<int64_t> lo(dims), len(dims);
    int64_t volume = 1;
    for (size_t d = 0; d < dims; ++d) {
      lo[d] = std::max(c.offsets[d], dest_offsets[d]);
      len[d] = std::min(c.offsets[d] + c.sizes[d], dest_offsets[d] + dest.size(d)) - lo[d];
      volume *= std::max<int64_t>(len[d], 0);
    }
    if (volume == 0) continue;  // no overlap: this chunk's bytes are not read
    at::Tensor dst = out;
    for (size_t d = 0; d < dims; ++d) dst = dst.narrow(d, lo[d] - dest_offsets[d], len[d]);
    std::vector<int64_t> src_lo(dims);
    for (size_t d = 0; d < dims; ++d) src_lo[d] = lo[d] - c.offsets[d];
    fn(e, c, src_lo, dst);
    covered += volume;
  }
  TORCH_CHECK(covered == dest.numel(), caller_, ": the chunks of '", fqn, "' in '", dir_, "' cover ", covered,
              " of the ", dest.numel(), " elements of ", box);
}

void DcpReader::Prepare(const std::string& fqn, const std::vector<int64_t>& dest_offsets, const at::Tensor& dest) {
  // Opening each file and checking the ranges is cheap; parsing each chunk's archive here
  // would read every chunk's head and tail in a pass of its own (a seek per chunk on a cold
  // disk), so that waits for ReadInto.
  ForEachOverlap(fqn, dest_offsets, dest,
                 [this](const DcpEntry& e, const DcpChunk& c, const std::vector<int64_t>&, const at::Tensor&) {
                   File(c.storage,
                        absl::StrCat("the chunk of '", e.fqn, "' at offsets ", c10::str(c10::IntArrayRef(c.offsets))));
                 });
}

void DcpReader::ReadInto(const std::string& fqn, const std::vector<int64_t>& dest_offsets, const at::Tensor& dest) {
  ForEachOverlap(fqn, dest_offsets, dest,
                 [this](const DcpEntry& e, const DcpChunk& c, const std::vector<int64_t>& src_lo,
                        const at::Tensor& dst) { ReadChunk(e, c, src_lo, dst); });
}

std::string DcpReader::ItemName(const DcpEntry& e, const DcpChunk& c) {
  return absl::StrCat("the chunk of '", e.fqn, "' at offsets ", c10::str(c10::IntArrayRef(c.offsets)));
}

std::string DcpReader::SourceOf(const DcpEntry& e, const DcpChunk& c) const {
  const int64_t base = c.storage.offset;
  return absl::StrCat("'", JoinPath(dir_, c.storage.relative_path), "' bytes [", base, ", ", base + c.storage.length,
                      ") (", ItemName(e, c), ")");
}

const DcpReader::Located& DcpReader::Locate(const DcpEntry& e, const DcpChunk& c) {
  const auto key = std::make_pair(c.storage.relative_path, c.storage.offset);
  if (auto it = located_.find(key); it != located_.end()) return it->second;
  const std::string item = ItemName(e, c);
  OpenFile& f = File(c.storage, item);
  const std::string path = JoinPath(dir_, c.storage.relative_path);
  const int64_t base = c.storage.offset;
  Located out{.fd = f.fd.get(), .path = path, .base = base};
  const std::string source = SourceOf(e, c);
  out.tensor = LocateCheckpointTensor(
      static_cast<uint64_t>(c.storage.length),
      [&](uint64_t offset, size_t size, char* into) { PreadFully(out.fd, base + offset, size, into, path, caller_); },
      source);
  const at::Tensor& stored = out.tensor.meta;
  TORCH_CHECK(stored.scalar_type() == e.properties.dtype && stored.sizes() == c10::IntArrayRef(c.sizes), caller_, ": '",
              path, "' holds at bytes [", base, ", ", base + c.storage.length, ") a ",
              c10::toString(stored.scalar_type()), " tensor of size ", c10::str(c10::IntArrayRef(stored.sizes())),
              ", not ", item, " (", c10::toString(e.properties.dtype), " of size ", c10::str(c10::IntArrayRef(c.sizes)),
              ")");
  return located_.emplace(key, std::move(out)).first->second;
}

uint32_t DcpReader::ReadRecord(const Record& r, const std::vector<int64_t>& src_lo, const at::Tensor& dst) {
  const at::Tensor& stored = r.stored;
  const int64_t item_size = static_cast<int64_t>(stored.element_size());
  const bool is_bool = stored.scalar_type() == at::kBool;
  uint32_t crc = 0;
  // Every byte of the record read passes here once, in order.
  const auto check = [&](const char* data, int64_t n) {
    crc = internal::Crc32Update(crc, data, static_cast<size_t>(n));
    if (!is_bool) return;
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(static_cast<uint8_t>(data[i]) <= 1, r.what, "bool storage record '", r.name, "' holds byte ",
                  static_cast<int>(static_cast<uint8_t>(data[i])));
    }
  };
  const auto read = [&](int64_t from, int64_t n, char* into) {
    PreadFully(r.fd, r.offset + from, static_cast<size_t>(n), into, r.path, caller_);
    check(into, n);
  };
  // Reads record bytes [from, to) through the scratch block, for the CRC only (not at all when
  // there is no CRC to check).
  const auto skip = [&](int64_t from, int64_t to) {
    if (!r.whole) return;
    for (int64_t at = from; at < to; at += kBlockBytes) {
      const int64_t n = std::min<int64_t>(kBlockBytes, to - at);
      read(at, n, Scratch(static_cast<size_t>(n)));
    }
  };
  at::Tensor src = stored;  // the overlap, as a view of the (meta) stored tensor
  for (int64_t d = 0; d < stored.dim(); ++d) src = src.narrow(d, src_lo[d], dst.size(d));
  int64_t begin = 0, end = 0;
  if (!stored.is_contiguous() || stored.storage_offset() != 0 || stored.numel() * item_size != r.size) {
    // Stored as a view of a larger storage or with other strides (not what DCP writes: it
    // clones such tensors): the whole record at once.
    char* all = Scratch(static_cast<size_t>(r.size));
    read(0, r.size, all);
    const at::Tensor storage = at::from_blob(all, {r.size / item_size}, stored.options().device(at::kCPU));
    dst.copy_(storage.as_strided(src.sizes(), src.strides(), src.storage_offset()));
  } else if (ContiguousRange(src, &begin, &end) && dst.is_contiguous() && dst.is_cpu()) {
    skip(0, begin);  // straight into the destination, a block at a time
    char* into = static_cast<char*>(dst.data_ptr());
    for (int64_t at = begin; at < end; at += kBlockBytes) {
      read(at, std::min<int64_t>(kBlockBytes, end - at), into + (at - begin));
    }
    skip(end, r.size);
  } else {
    // Whole dim-0 rows of the chunk through the scratch block, their overlap copied out.
    const int64_t row = stored.size(0) > 0 ? r.size / stored.size(0) : r.size;
    const int64_t rows_per_block = std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(row, 1));
    const int64_t first = src_lo[0], last = src_lo[0] + dst.size(0);
    skip(0, first * row);
    std::vector<int64_t> block_sizes = stored.sizes().vec();
    for (int64_t at_row = first; at_row < last; at_row += rows_per_block) {
      const int64_t n = std::min(rows_per_block, last - at_row);
      char* block = Scratch(static_cast<size_t>(n * row));
      read(at_row * row, n * row, block);
      block_sizes[0] = n;
      at::Tensor from = at::from_blob(block, block_sizes, stored.options().device(at::kCPU));
      for (int64_t d = 1; d < stored.dim(); ++d) from = from.narrow(d, src_lo[d], dst.size(d));
      dst.narrow(0, at_row - first, n).copy_(from);
    }
    skip(last * row, r.size);
  }
  return crc;
}

bool DcpReader::ReadChunkInOrder(const DcpEntry& e, const DcpChunk& c, const std::vector<int64_t>& src_lo,
                                 const at::Tensor& dst) {
  const std::string item = ItemName(e, c);
  OpenFile& f = File(c.storage, item);
  const std::string path = JoinPath(dir_, c.storage.relative_path);
  // The first record's local header: what torch.save's archive starts with, the storage's
  // data (LibTorch's writer and Python's put data/0 first).
  char head[30 + 512];
  const size_t head_size = static_cast<size_t>(std::min<int64_t>(c.storage.length, sizeof(head)));
  PreadFully(f.fd.get(), c.storage.offset, head_size, head, path, caller_);
  uint32_t signature;
  uint16_t name_size, extra_size;
  if (head_size < 30) return false;
  std::memcpy(&signature, head, 4);
  std::memcpy(&name_size, head + 26, 2);
  std::memcpy(&extra_size, head + 28, 2);
  if (signature != 0x04034b50 || 30u + name_size > head_size) return false;
  const std::string name(head + 30, name_size);
  int64_t numel = 1;
  for (int64_t s : c.sizes) numel *= s;
  const int64_t data = 30 + name_size + extra_size,
                size = numel * static_cast<int64_t>(c10::elementSize(e.properties.dtype));
  if (name.find("/data/") == std::string::npos || size == 0 || data > c.storage.length ||
      size > c.storage.length - data) {
    return false;
  }
  // Guess: a contiguous tensor of the chunk's sizes over the whole record (what DCP writes).
  const Record guess{f.fd.get(),
                     path,
                     c.storage.offset + data,
                     size,
                     /*whole=*/true,
                     at::empty(c.sizes, at::TensorOptions().dtype(e.properties.dtype).device(at::kMeta)),
                     SourceOf(e, c) + " is not a valid checkpoint: ",
                     name};
  const uint32_t crc = ReadRecord(guess, src_lo, dst);
  const LocatedTensor& t = Locate(e, c).tensor;  // the directory and the pickle, checked
  if (t.record != name || static_cast<int64_t>(t.record_offset) != data ||
      static_cast<int64_t>(t.record_size) != size || !t.meta.is_contiguous() || t.meta.storage_offset() != 0) {
    return false;  // another layout: read again as located
  }
  CheckCrc(t, crc);
  return true;
}

void DcpReader::CheckCrc(const LocatedTensor& t, uint32_t crc) const {
  TORCH_CHECK(t.crc == 0 || crc == t.crc, t.what, "record '", t.record, "' (", t.record_size, " bytes at offset ",
              t.record_offset, ") has CRC-32 ", crc, " but the archive lists ", t.crc, " (corrupted)");
}

void DcpReader::ReadChunk(const DcpEntry& e, const DcpChunk& c, const std::vector<int64_t>& src_lo,
                          const at::Tensor& dst) {
  // Not located yet: read the chunk front to back (its data, then its directory and pickle,
  // which torch.save puts after the data), so a cold disk streams it; checked after.
  if (!located_.contains({c.storage.relative_path, c.storage.offset}) && ReadChunkInOrder(e, c, src_lo, dst)) return;
  const Located& located = Locate(e, c);
  const LocatedTensor& t = located.tensor;
  if (t.record.empty()) return;  // an empty storage: nothing to read (and no overlap)
  const Record r{located.fd,
                 located.path,
                 located.base + static_cast<int64_t>(t.record_offset),
                 static_cast<int64_t>(t.record_size),
                 /*whole=*/t.crc != 0,
                 t.meta,
                 t.what,
                 t.record};
  CheckCrc(t, ReadRecord(r, src_lo, dst));
}

void ReadInto(const std::string& dir, const DcpMetadata& metadata, const std::string& fqn,
              const std::vector<int64_t>& dest_offsets, const at::Tensor& dest) {
  DcpReader(dir, metadata, "ReadInto").ReadInto(fqn, dest_offsets, dest);
}

std::vector<char> ReadBytes(const std::string& dir, const DcpMetadata& metadata, const std::string& fqn) {
  return DcpReader(dir, metadata, "ReadBytes").ReadBytes(fqn);
}

DcpMetadata ReadMetadata(const std::string& dir) {
  const std::string path = JoinPath(dir, ".metadata");  // filesystem.py _metadata_fn
  const std::vector<char> bytes = ReadFile(path, "ReadMetadata");
  return ParseDcpMetadata(bytes.data(), bytes.size(), "'" + path + "'");
}

}  // namespace fsdp::checkpoint
