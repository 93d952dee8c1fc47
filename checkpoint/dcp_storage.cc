#include "checkpoint/dcp_storage.h"

#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
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

// The tensor one stored chunk holds: the local tensor on the CPU, without the storage beyond
// it (filesystem.py _SerialCpuLoader clones such tensors).
at::Tensor ChunkTensor(const DcpTensorItem& item, const std::string& name) {
  TORCH_CHECK(item.local.defined(), "WriteRankData: ", name, " has no tensor");
  TORCH_CHECK(item.local.scalar_type() == item.dtype, "WriteRankData: ", name, " is declared ",
              c10::toString(item.dtype), " but its tensor is ", c10::toString(item.local.scalar_type()));
  const size_t dims = item.global_size.size();
  TORCH_CHECK(item.local.dim() == static_cast<int64_t>(dims) && item.offsets.size() == dims, "WriteRankData: ", name,
              " has a tensor of size ", c10::str(c10::IntArrayRef(item.local.sizes())), " at offsets ",
              c10::str(c10::IntArrayRef(item.offsets)), " in a tensor of size ",
              c10::str(c10::IntArrayRef(item.global_size)), ": the dimensions differ");
  for (size_t d = 0; d < dims; ++d) {
    TORCH_CHECK(item.offsets[d] >= 0 && item.offsets[d] <= item.global_size[d] &&
                    item.local.size(d) <= item.global_size[d] - item.offsets[d],
                "WriteRankData: ", name, ": a tensor of size ", c10::str(c10::IntArrayRef(item.local.sizes())),
                " at offsets ", c10::str(c10::IntArrayRef(item.offsets)), " does not fit in its global size ",
                c10::str(c10::IntArrayRef(item.global_size)));
  }
  at::Tensor t = item.local.detach().to(at::kCPU);
  if (static_cast<int64_t>(t.storage().nbytes()) != static_cast<int64_t>(t.nbytes()) || t.storage_offset() != 0) {
    t = t.clone();
  }
  return t;
}

}  // namespace

std::string DcpDataFileName(int64_t rank) { return absl::StrCat("__", rank, "_0.distcp"); }

namespace {

// The fragment of a rank's file holding `bytes` then `tensors` back to back (the layout
// WriteRankData writes), the i-th tensor's archive `tensor_lengths[i]` bytes long.
DcpFragment RankFragment(int64_t rank, const std::vector<DcpTensorItem>& tensors,
                         const std::vector<DcpBytesItem>& bytes, const std::vector<int64_t>& tensor_lengths) {
  TORCH_CHECK(tensor_lengths.size() == tensors.size(), "RankFragment: ", tensor_lengths.size(), " lengths for ",
              tensors.size(), " tensor items");
  const std::string file = DcpDataFileName(rank);
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
  int64_t offset = 0;
  for (const DcpBytesItem& item : bytes) {  // bytes first, as filesystem.py _write_files_from_queue
    auto [e, added] = entry(item.fqn);
    TORCH_CHECK(added, "WriteRankData: '", item.fqn, "' is written twice by rank ", rank);
    e->is_bytes = true;
    e->bytes_storage = {file, offset, static_cast<int64_t>(item.bytes.size())};
    offset += static_cast<int64_t>(item.bytes.size());
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const DcpTensorItem& item = tensors[i];
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
    TORCH_CHECK(e->size == item.global_size && e->properties.dtype == item.dtype, "WriteRankData: the chunk of '",
                item.fqn, "' at offsets ", c10::str(c10::IntArrayRef(item.offsets)), " is declared ",
                c10::toString(item.dtype), " of size ", c10::str(c10::IntArrayRef(item.global_size)),
                ", an earlier chunk of it ", c10::toString(e->properties.dtype), " of size ",
                c10::str(c10::IntArrayRef(e->size)));
    e->chunks.push_back({item.offsets, item.local.sizes().vec(), {file, offset, tensor_lengths[i]}});
    offset += tensor_lengths[i];
  }
  ValidateDcpMetadata(DcpMetadata{fragment.entries}, absl::StrCat("WriteRankData: rank ", rank, ": "));
  return fragment;
}

}  // namespace

DcpFragment WriteRankData(const std::string& dir, int64_t rank, const std::vector<DcpTensorItem>& tensors,
                          const std::vector<DcpBytesItem>& bytes) {
  TORCH_CHECK(rank >= 0, "WriteRankData: rank ", rank, " is negative");
  MakeDirs(dir, "WriteRankData");
  const std::string metadata = JoinPath(dir, kMetadataFile);
  TORCH_CHECK(::unlink(metadata.c_str()) == 0 || errno == ENOENT, "WriteRankData: cannot remove the old '", metadata,
              "' (", Reason(errno), ")");
  AtomicFile out(JoinPath(dir, DcpDataFileName(rank)), "WriteRankData");
  for (const DcpBytesItem& item : bytes) out.Write(item.bytes);
  std::vector<int64_t> lengths;
  for (const DcpTensorItem& item : tensors) {
    const std::string name =
        absl::StrCat("the chunk of '", item.fqn, "' at offsets ", c10::str(c10::IntArrayRef(item.offsets)));
    const at::Tensor chunk = ChunkTensor(item, name);
    const int64_t start = out.size();
    TorchSaveWriter([&out](const char* data, size_t size) { out.Write(data, size); }, "WriteRankData")
        .Finish(chunk);  // streamed from the chunk's memory
    lengths.push_back(out.size() - start);
  }
  DcpFragment fragment = RankFragment(rank, tensors, bytes, lengths);
  out.Commit();  // only a consistent fragment's file replaces the old one
  return fragment;
}

namespace {

// The length of the torch.save archive of a contiguous tensor of `sizes` and `dtype`: it does
// not depend on the values (data.pkl holds only the storage key, dtype, sizes and strides; the
// data record is stored uncompressed), so one archive of zeros per shape says.
int64_t ArchiveLength(at::ScalarType dtype, const std::vector<int64_t>& sizes) {
  static std::mutex mu;
  static std::map<std::pair<int, std::vector<int64_t>>, int64_t> cache;
  const auto key = std::make_pair(static_cast<int>(dtype), sizes);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  const int64_t n = static_cast<int64_t>(WriteCheckpoint(c10::IValue(at::zeros(sizes, dtype))).size());
  std::lock_guard<std::mutex> lock(mu);
  cache.emplace(key, n);
  return n;
}

}  // namespace

DcpFragment PredictRankData(int64_t rank, const std::vector<DcpTensorItem>& tensors,
                            const std::vector<DcpBytesItem>& bytes) {
  std::vector<int64_t> lengths;
  for (const DcpTensorItem& item : tensors) {
    TORCH_CHECK(item.local.is_contiguous(), "PredictRankData: the chunk of '", item.fqn,
                "' is not contiguous (its archive's length would depend on how WriteRankData copies it)");
    lengths.push_back(ArchiveLength(item.dtype, item.local.sizes().vec()));
  }
  return RankFragment(rank, tensors, bytes, lengths);
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
                  "' is ", c10::toString(e.properties.dtype), " of size ", c10::str(c10::IntArrayRef(e.size)),
                  " in fragment ", rank, " but ", c10::toString(into.properties.dtype), " of size ",
                  c10::str(c10::IntArrayRef(into.size)), " in an earlier one");
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
    TORCH_CHECK(volume == numel, "WriteMetadata: the chunks of tensor '", e.fqn, "' (size ",
                c10::str(c10::IntArrayRef(e.size)), ") cover ", volume, " of its ", numel, " elements");
  }
  md.has_planner_data = true;
  md.storage_meta = DcpStorageMeta{checkpoint_id, NewUuid(), std::nullopt, {}};
  md.version = kDcpVersion;
  return md;
}

void WriteMetadata(const std::string& dir, const std::vector<DcpFragment>& fragments) {
  const std::vector<char> bytes = SerializeDcpMetadata(MergeDcpFragments(fragments, dir));
  WriteFileAtomically(JoinPath(dir, kMetadataFile), bytes, "WriteMetadata");
}

std::vector<char> SerializeDcpFragment(const DcpFragment& fragment) {
  DcpMetadata md{fragment.entries};
  md.has_planner_data = true;
  return SerializeDcpMetadata(md);
}

DcpFragment ParseDcpFragment(const std::vector<char>& bytes, const std::string& source) {
  return DcpFragment{ParseDcpMetadata(bytes.data(), bytes.size(), source).entries};
}

}  // namespace fsdp::checkpoint
