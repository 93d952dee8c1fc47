#include "checkpoint/dcp_storage.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/file_io.h"

namespace fsdp::checkpoint {
namespace {

constexpr char kMetadataFile[] = ".metadata";  // filesystem.py _metadata_fn

std::string Reason(int error) { return std::strerror(error); }
std::string Shape(c10::IntArrayRef v) { return absl::StrCat("[", absl::StrJoin(v, ", "), "]"); }
std::string Join(const std::string& dir, const std::string& name) {
  return !dir.empty() && dir.back() == '/' ? dir + name : absl::StrCat(dir, "/", name);
}

// Closes the descriptor on every path out of a function.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int Release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// mkdir -p, as filesystem.py FileSystem.mkdir (parents=True, exist_ok=True).
void MakeDirs(const std::string& dir, const char* caller) {
  TORCH_CHECK(!dir.empty(), caller, ": the checkpoint directory is empty");
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    const std::string prefix = dir.substr(0, pos);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      TORCH_CHECK(false, caller, ": cannot create the directory '", prefix, "' (", Reason(errno), ")");
    }
  }
  struct stat st {};
  TORCH_CHECK(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), caller, ": '", dir, "' is not a directory");
}

// A fresh random UUID (version 4), what filesystem.py _generate_uuid gives save_id.
std::string NewUuid() {
  std::random_device rd;
  uint8_t b[16];
  for (auto& x : b) x = static_cast<uint8_t>(rd());
  b[6] = (b[6] & 0x0F) | 0x40;
  b[8] = (b[8] & 0x3F) | 0x80;
  std::string out;
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    absl::StrAppend(&out, absl::Hex(b[i], absl::kZeroPad2));
  }
  return out;
}

// Writes a file through a temporary next to it, renamed over it once complete and synced.
class AtomicFile {
 public:
  AtomicFile(std::string path, const char* caller) : path_(std::move(path)), caller_(caller) {
    static std::atomic<uint64_t> counter{0};
    tmp_ = absl::StrCat(path_, ".tmp.", ::getpid(), ".", counter.fetch_add(1));
    fd_ = Fd(::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    TORCH_CHECK(fd_.get() >= 0, caller_, ": cannot create '", tmp_, "' to write '", path_, "' (", Reason(errno), ")");
  }
  ~AtomicFile() {
    if (fd_.get() >= 0) {  // not committed: an error left it behind
      ::close(fd_.Release());
      ::unlink(tmp_.c_str());
    }
  }
  void Write(const std::vector<char>& bytes) {
    for (size_t done = 0; done < bytes.size();) {
      const ssize_t n = ::write(fd_.get(), bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) Fail("write", errno);
      done += static_cast<size_t>(n);
    }
    size_ += static_cast<int64_t>(bytes.size());
  }
  int64_t size() const { return size_; }
  void Commit() {
    if (::fsync(fd_.get()) != 0) Fail("fsync", errno);
    const int fd = fd_.Release();
    if (::close(fd) != 0) {
      ::unlink(tmp_.c_str());
      TORCH_CHECK(false, caller_, ": writing '", path_, "' failed: close (", Reason(errno), ")");
    }
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
      const int error = errno;
      ::unlink(tmp_.c_str());
      TORCH_CHECK(false, caller_, ": cannot rename '", tmp_, "' to '", path_, "' (", Reason(error), ")");
    }
  }

 private:
  [[noreturn]] void Fail(const char* what, int error) {
    TORCH_CHECK(false, caller_, ": writing '", path_, "' failed: ", what, " (", Reason(error), ")");
  }
  std::string path_, tmp_;
  const char* caller_;
  Fd fd_;
  int64_t size_ = 0;
};

// The bytes of one stored chunk: torch.save of the local tensor on the CPU, without the
// storage beyond it (filesystem.py _SerialCpuLoader clones such tensors).
std::vector<char> ChunkBytes(const DcpTensorItem& item, const std::string& name) {
  TORCH_CHECK(item.local.defined(), "WriteRankData: ", name, " has no tensor");
  TORCH_CHECK(item.local.scalar_type() == item.dtype, "WriteRankData: ", name, " is declared ",
              c10::toString(item.dtype), " but its tensor is ", c10::toString(item.local.scalar_type()));
  const size_t dims = item.global_size.size();
  TORCH_CHECK(item.local.dim() == static_cast<int64_t>(dims) && item.offsets.size() == dims, "WriteRankData: ", name,
              " has a tensor of size ", Shape(item.local.sizes()), " at offsets ", Shape(item.offsets),
              " in a tensor of size ", Shape(item.global_size), ": the dimensions differ");
  for (size_t d = 0; d < dims; ++d) {
    TORCH_CHECK(item.offsets[d] >= 0 && item.offsets[d] <= item.global_size[d] &&
                    item.local.size(d) <= item.global_size[d] - item.offsets[d],
                "WriteRankData: ", name, ": a tensor of size ", Shape(item.local.sizes()), " at offsets ",
                Shape(item.offsets), " does not fit in its global size ", Shape(item.global_size));
  }
  at::Tensor t = item.local.detach().to(at::kCPU);
  if (static_cast<int64_t>(t.storage().nbytes()) != static_cast<int64_t>(t.nbytes()) || t.storage_offset() != 0) {
    t = t.clone();
  }
  return WriteCheckpoint(c10::IValue(t));
}

// A data file opened for reading, with its size.
struct OpenFile {
  Fd fd;
  int64_t size = 0;
};

class RangeReader {
 public:
  RangeReader(std::string dir, const char* caller) : dir_(std::move(dir)), caller_(caller) {}

  // The bytes [s.offset, s.offset + s.length) of the file, in the reused buffer.
  std::string_view Read(const DcpStorageInfo& s, const std::string& item) {
    const std::string path = Join(dir_, s.relative_path);
    auto it = files_.find(s.relative_path);
    if (it == files_.end()) {
      OpenFile f{Fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC))};
      TORCH_CHECK(f.fd.get() >= 0, caller_, ": cannot open '", path, "' (holding ", item, ") for reading (",
                  Reason(errno), ")");
      struct stat st {};
      TORCH_CHECK(::fstat(f.fd.get(), &st) == 0 && S_ISREG(st.st_mode), caller_, ": '", path,
                  "' is not a regular file");
      f.size = st.st_size;
      it = files_.emplace(s.relative_path, std::move(f)).first;
    }
    const int64_t file_size = it->second.size;
    TORCH_CHECK(s.offset <= file_size && s.length <= file_size - s.offset, caller_, ": ", item, " is stored at bytes [",
                s.offset, ", ", s.offset + s.length, ") of '", path, "', which has only ", file_size,
                " bytes (truncated?)");
    if (static_cast<size_t>(s.length) > capacity_) {
      // Default-initialized (not zero-filled like a vector's resize): pread overwrites it.
      buffer_.reset(new char[s.length]);
      capacity_ = static_cast<size_t>(s.length);
    }
    for (int64_t done = 0; done < s.length;) {
      const ssize_t n = ::pread(it->second.fd.get(), buffer_.get() + done, s.length - done, s.offset + done);
      if (n < 0 && errno == EINTR) continue;
      TORCH_CHECK(n > 0, caller_, ": reading bytes [", s.offset, ", ", s.offset + s.length, ") of '", path,
                  "' failed after ", done, " bytes (", n == 0 ? "end of file: truncated?" : Reason(errno), ")");
      done += n;
    }
    return std::string_view(buffer_.get(), s.length);
  }
  std::string Path(const DcpStorageInfo& s) const { return Join(dir_, s.relative_path); }

 private:
  std::string dir_;
  const char* caller_;
  std::map<std::string, OpenFile> files_;
  std::unique_ptr<char[]> buffer_;  // the one read buffer, as large as the largest range read
  size_t capacity_ = 0;
};

const DcpEntry& FindEntry(const std::string& dir, const DcpMetadata& md, const std::string& fqn, const char* caller) {
  const DcpEntry* e = md.Find(fqn);
  if (e == nullptr) {
    std::vector<std::string> names;
    for (size_t i = 0; i < md.entries.size() && i < 8; ++i) names.push_back("'" + md.entries[i].fqn + "'");
    if (md.entries.size() > 8) names.push_back("...");
    TORCH_CHECK(false, caller, ": the checkpoint '", dir, "' has no entry '", fqn, "' (it has ", md.entries.size(),
                ": ", absl::StrJoin(names, ", "), ")");
  }
  return *e;
}

}  // namespace

std::string DcpDataFileName(int64_t rank) { return absl::StrCat("__", rank, "_0.distcp"); }

DcpFragment WriteRankData(const std::string& dir, int64_t rank, const std::vector<DcpTensorItem>& tensors,
                          const std::vector<DcpBytesItem>& bytes) {
  TORCH_CHECK(rank >= 0, "WriteRankData: rank ", rank, " is negative");
  MakeDirs(dir, "WriteRankData");
  const std::string metadata = Join(dir, kMetadataFile);
  TORCH_CHECK(::unlink(metadata.c_str()) == 0 || errno == ENOENT, "WriteRankData: cannot remove the old '", metadata,
              "' (", Reason(errno), ")");
  const std::string file = DcpDataFileName(rank);
  AtomicFile out(Join(dir, file), "WriteRankData");
  DcpFragment fragment;
  absl::flat_hash_map<std::string, size_t> index;  // fqn -> its entry in `fragment`
  const auto entry = [&](const std::string& fqn) -> std::pair<DcpEntry*, bool> {
    auto [it, added] = index.emplace(fqn, fragment.entries.size());
    if (added) {
      fragment.entries.emplace_back();
      fragment.entries.back().fqn = fqn;
      fragment.entries.back().object_path = {fqn};
    }
    return {&fragment.entries[it->second], added};
  };
  for (const DcpBytesItem& item : bytes) {  // bytes first, as filesystem.py _write_files_from_queue
    auto [e, added] = entry(item.fqn);
    TORCH_CHECK(added, "WriteRankData: '", item.fqn, "' is written twice by rank ", rank);
    e->is_bytes = true;
    e->bytes_storage = {file, out.size(), static_cast<int64_t>(item.bytes.size())};
    out.Write(item.bytes);
  }
  for (const DcpTensorItem& item : tensors) {
    const std::string name = absl::StrCat("the chunk of '", item.fqn, "' at offsets ", Shape(item.offsets));
    const std::vector<char> data = ChunkBytes(item, name);
    auto [e, added] = entry(item.fqn);
    TORCH_CHECK(!e->is_bytes, "WriteRankData: '", item.fqn, "' is written as bytes and as a tensor");
    if (added) {
      // Python records the properties of the saving rank's local tensor
      // (metadata.py TensorProperties.create_from_tensor).
      e->size = item.global_size;
      e->properties.dtype = item.dtype;
      e->properties.requires_grad = item.local.requires_grad();
      e->properties.pin_memory = item.local.is_pinned();
      e->properties.strides = item.local.strides().vec();
    }
    TORCH_CHECK(e->size == item.global_size && e->properties.dtype == item.dtype, "WriteRankData: ", name,
                " is declared ", c10::toString(item.dtype), " of size ", Shape(item.global_size),
                ", an earlier chunk of it ", c10::toString(e->properties.dtype), " of size ", Shape(e->size));
    e->chunks.push_back(
        {item.offsets, item.local.sizes().vec(), {file, out.size(), static_cast<int64_t>(data.size())}});
    out.Write(data);
  }
  ValidateDcpMetadata(DcpMetadata{fragment.entries}, absl::StrCat("WriteRankData: rank ", rank, ": "));
  out.Commit();
  return fragment;
}

DcpMetadata MergeDcpFragments(const std::vector<DcpFragment>& fragments, const std::string& checkpoint_id) {
  DcpMetadata md;
  absl::flat_hash_map<std::string, size_t> index;
  for (size_t rank = 0; rank < fragments.size(); ++rank) {
    for (const DcpEntry& e : fragments[rank].entries) {
      auto [it, added] = index.emplace(e.fqn, md.entries.size());
      if (added) {
        md.entries.push_back(e);
        continue;
      }
      DcpEntry& into = md.entries[it->second];
      TORCH_CHECK(!into.is_bytes && !e.is_bytes, "WriteMetadata: '", e.fqn,
                  "' is written by more than one rank and is not a tensor (fragment ", rank, ")");
      TORCH_CHECK(into.size == e.size && into.properties.dtype == e.properties.dtype, "WriteMetadata: tensor '", e.fqn,
                  "' is ", c10::toString(e.properties.dtype), " of size ", Shape(e.size), " in fragment ", rank,
                  " but ", c10::toString(into.properties.dtype), " of size ", Shape(into.size), " in an earlier one");
      into.chunks.insert(into.chunks.end(), e.chunks.begin(), e.chunks.end());
      if (into.object_path.empty()) into.object_path = e.object_path;
    }
  }
  ValidateDcpMetadata(md, "WriteMetadata: ");
  for (const DcpEntry& e : md.entries) {  // no overlap (checked above), so full volume = exact cover
    if (e.is_bytes) continue;
    int64_t volume = 0, numel = 1;
    for (int64_t s : e.size) numel *= s;  // fits: checked above
    for (const DcpChunk& c : e.chunks) {
      int64_t v = 1;
      for (int64_t s : c.sizes) v *= s;
      volume += v;  // disjoint boxes inside the tensor: at most numel
    }
    TORCH_CHECK(volume == numel, "WriteMetadata: the chunks of tensor '", e.fqn, "' (size ", Shape(e.size), ") cover ",
                volume, " of its ", numel, " elements");
  }
  md.has_planner_data = true;
  md.storage_meta = DcpStorageMeta{checkpoint_id, NewUuid(), std::nullopt, {}};
  md.version = kDcpVersion;
  return md;
}

void WriteMetadata(const std::string& dir, const std::vector<DcpFragment>& fragments) {
  const std::vector<char> bytes = SerializeDcpMetadata(MergeDcpFragments(fragments, dir));
  WriteFileAtomically(Join(dir, kMetadataFile), bytes, "WriteMetadata");
}

std::vector<char> SerializeDcpFragment(const DcpFragment& fragment) {
  DcpMetadata md{fragment.entries};
  md.has_planner_data = true;
  return SerializeDcpMetadata(md);
}

DcpFragment ParseDcpFragment(const std::vector<char>& bytes, const std::string& source) {
  return DcpFragment{ParseDcpMetadata(bytes.data(), bytes.size(), source).entries};
}

DcpMetadata ReadMetadata(const std::string& dir) {
  const std::string path = Join(dir, kMetadataFile);
  const std::vector<char> bytes = ReadFile(path, "ReadMetadata");
  return ParseDcpMetadata(bytes.data(), bytes.size(), "'" + path + "'");
}

void ReadInto(const std::string& dir, const DcpMetadata& md, const std::string& fqn,
              const std::vector<int64_t>& dest_offsets, const at::Tensor& dest) {
  const DcpEntry& e = FindEntry(dir, md, fqn, "ReadInto");
  TORCH_CHECK(!e.is_bytes, "ReadInto: '", fqn, "' in '", dir, "' is a bytes entry, not a tensor (ReadBytes reads it)");
  TORCH_CHECK(dest.defined(), "ReadInto: the destination of '", fqn, "' is an undefined tensor");
  TORCH_CHECK(dest.scalar_type() == e.properties.dtype, "ReadInto: '", fqn, "' in '", dir, "' is stored as ",
              c10::toString(e.properties.dtype), ", the destination is ", c10::toString(dest.scalar_type()));
  const size_t dims = e.size.size();
  const std::string box = absl::StrCat("the box at offsets ", Shape(dest_offsets), " of size ", Shape(dest.sizes()));
  TORCH_CHECK(dest.dim() == static_cast<int64_t>(dims) && dest_offsets.size() == dims, "ReadInto: ", box,
              " does not have the ", dims, " dimensions of '", fqn, "' (size ", Shape(e.size), ")");
  for (size_t d = 0; d < dims; ++d) {
    TORCH_CHECK(dest_offsets[d] >= 0 && dest_offsets[d] <= e.size[d] && dest.size(d) <= e.size[d] - dest_offsets[d],
                "ReadInto: ", box, " lies outside '", fqn, "' of size ", Shape(e.size));
  }
  const at::Tensor out = dest.detach();  // a leaf that requires grad is filled like its data
  RangeReader reader(dir, "ReadInto");
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
    const std::string item = absl::StrCat("the chunk of '", fqn, "' at offsets ", Shape(c.offsets));
    const std::string_view bytes = reader.Read(c.storage, item);
    // Aliasing: `bytes` (the reader's buffer) lives until the copy into `out` below.
    const c10::IValue value = ReadCheckpointAliasing(bytes.data(), bytes.size(),
                                             absl::StrCat("'", reader.Path(c.storage), "' bytes [", c.storage.offset,
                                                          ", ", c.storage.offset + c.storage.length, ") (", item, ")"));
    TORCH_CHECK(value.isTensor() && value.toTensor().scalar_type() == e.properties.dtype &&
                    value.toTensor().sizes() == c10::IntArrayRef(c.sizes),
                "ReadInto: '", reader.Path(c.storage), "' holds at bytes [", c.storage.offset, ", ",
                c.storage.offset + c.storage.length, ") ",
                value.isTensor() ? absl::StrCat("a ", c10::toString(value.toTensor().scalar_type()), " tensor of size ",
                                                Shape(value.toTensor().sizes()))
                                 : absl::StrCat("a ", value.tagKind()),
                ", not ", item, " (", c10::toString(e.properties.dtype), " of size ", Shape(c.sizes), ")");
    at::Tensor src = value.toTensor(), dst = out;
    for (size_t d = 0; d < dims; ++d) {
      src = src.narrow(d, lo[d] - c.offsets[d], len[d]);
      dst = dst.narrow(d, lo[d] - dest_offsets[d], len[d]);
    }
    dst.copy_(src);
    covered += volume;
  }
  TORCH_CHECK(covered == dest.numel(), "ReadInto: the chunks of '", fqn, "' in '", dir, "' cover ", covered, " of the ",
              dest.numel(), " elements of ", box);
}

std::vector<char> ReadBytes(const std::string& dir, const DcpMetadata& md, const std::string& fqn) {
  const DcpEntry& e = FindEntry(dir, md, fqn, "ReadBytes");
  TORCH_CHECK(e.is_bytes, "ReadBytes: '", fqn, "' in '", dir, "' is a tensor, not a bytes entry (ReadInto reads it)");
  RangeReader reader(dir, "ReadBytes");
  const std::string_view bytes = reader.Read(e.bytes_storage, absl::StrCat("bytes entry '", fqn, "'"));
  return std::vector<char>(bytes.begin(), bytes.end());
}

}  // namespace fsdp::checkpoint
