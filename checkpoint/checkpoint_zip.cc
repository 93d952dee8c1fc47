#include "checkpoint/checkpoint_zip.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "checkpoint/crc32.h"

namespace fsdp::checkpoint::internal {
namespace {

uint16_t U16(const char* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
uint32_t U32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t U64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

}  // namespace

CheckpointZip::CheckpointZip(const char* data, size_t size, const std::string& what)
    : data_(data), size_(size), what_(what) {
  Parse();
}

CheckpointZip::CheckpointZip(uint64_t size, Fetch fetch, const std::string& what)
    : size_(size), fetch_(std::move(fetch)), what_(what) {
  Parse();
}

const char* CheckpointZip::At(uint64_t offset, uint64_t n) const {
  if (data_ != nullptr) return data_ + offset;
  for (const auto& [from, bytes] : fetched_) {  // a range fetched before holds it (the tail: the directory)
    if (offset >= from && n <= bytes.size() && offset - from <= bytes.size() - n) return bytes.data() + (offset - from);
  }
  // The archive's first 4 KiB come with any range in them: the local headers and the pickle
  // of a one-tensor archive are there, so a chunk is parsed in two reads (head and tail).
  const uint64_t head = std::min<uint64_t>(size_, 4096), at = offset;
  if (offset + n <= head) {
    offset = 0;
    n = head;
  }
  auto& [from, bytes] = fetched_.emplace_back(offset, std::string());
  bytes.resize(n);
  if (n > 0) fetch_(offset, n, bytes.data());
  return bytes.data() + (at - from);
}

const CheckpointZip::Record& CheckpointZip::Find(const std::string& name) const {
  auto it = records_.find(name);
  TORCH_CHECK(it != records_.end(), what_, "it has no record '", name, "'");
  return it->second;
}

void CheckpointZip::CrcMismatch(const std::string& name, uint32_t crc) const {
  const Record& r = Find(name);
  TORCH_CHECK(false, what_, "record '", name, "' (", r.size, " bytes at offset ", r.offset, ") has CRC-32 ", crc,
              " but the archive lists ", r.crc, " (corrupted)");
}

std::string_view CheckpointZip::Read(const std::string& name) const {
  const Record& r = Find(name);
  const std::string_view bytes(At(r.offset, r.size), r.size);
  if (r.crc != 0) {  // 0: written without checksums (torch.save's compute_crc32=False)
    const uint32_t crc = Crc32(bytes.data(), bytes.size());
    if (crc != r.crc) CrcMismatch(name, crc);
  }
  return bytes;
}

void CheckpointZip::Parse() {
  TORCH_CHECK(size_ >= 22, what_, "it has ", size_, " bytes, fewer than the 22 of an empty zip archive (truncated?)");
  // End of central directory: the last 22 bytes, or earlier by a comment that ends the file.
  // Fetched: the last 4 KiB first (no comment, the usual case), then the whole window.
  uint64_t eocd = size_;
  const uint64_t lowest = size_ - 22 > 65535 ? size_ - 22 - 65535 : 0;
  for (uint64_t window : {uint64_t{4096}, uint64_t{65535 + 22}}) {
    const uint64_t from = data_ != nullptr || size_ - lowest <= window ? lowest : size_ - window;
    const char* tail = At(from, size_ - from);
    for (uint64_t pos = size_ - 22;; --pos) {
      if (U32(tail + (pos - from)) == 0x06054b50 && pos + 22 + U16(tail + (pos - from) + 20) == size_) {
        eocd = pos;
        break;
      }
      if (pos == from) break;
    }
    if (eocd != size_ || from == lowest) break;
  }
  TORCH_CHECK(eocd != size_, what_,
              "no zip end-of-central-directory record at its end (truncated, or not a file "
              "that torch.save / torch::pickle_save wrote)");
  const char* end_record = At(eocd, 22);
  uint64_t entries = U16(end_record + 10), cd_size = U32(end_record + 12), cd_offset = U32(end_record + 16);
  uint64_t cd_limit = eocd;  // the central directory ends before this
  const char* locator = eocd >= 20 ? At(eocd - 20, 20) : nullptr;
  if (locator != nullptr && U32(locator) == 0x07064b50) {  // zip64 locator
    const uint64_t eocd64 = U64(locator + 8);
    TORCH_CHECK(eocd64 <= eocd - 20 && eocd - 20 - eocd64 >= 56, what_, "its zip64 end-of-central-directory offset ",
                eocd64, " does not point at one");
    const char* end64 = At(eocd64, 56);
    TORCH_CHECK(U32(end64) == 0x06064b50, what_, "its zip64 end-of-central-directory offset ", eocd64,
                " does not point at one");
    entries = U64(end64 + 32);
    cd_size = U64(end64 + 40);
    cd_offset = U64(end64 + 48);
    cd_limit = eocd64;
  }
  TORCH_CHECK(cd_offset <= cd_limit && cd_size <= cd_limit - cd_offset, what_, "its central directory (", cd_size,
              " bytes at offset ", cd_offset, ") does not fit before byte ", cd_limit, " (truncated?)");
  TORCH_CHECK(entries <= cd_size / 46, what_, "its central directory of ", cd_size, " bytes cannot hold ", entries,
              " records");
  data_end_ = cd_offset;
  const char* p = At(cd_offset, cd_size);
  const char* const end = p + cd_size;
  for (uint64_t i = 0; i < entries; ++i) p = ParseEntry(p, end, i);
}

const char* CheckpointZip::ParseEntry(const char* p, const char* end, uint64_t index) {
  TORCH_CHECK(end - p >= 46 && U32(p) == 0x02014b50, what_, "central directory entry ", index,
              " is not a zip file header");
  const uint16_t flags = U16(p + 8), method = U16(p + 10), name_len = U16(p + 28), extra_len = U16(p + 30),
                 comment_len = U16(p + 32);
  const uint32_t crc = U32(p + 16);
  uint64_t comp = U32(p + 20), uncomp = U32(p + 24), local = U32(p + 42);
  TORCH_CHECK(static_cast<uint64_t>(end - p) >= 46ull + name_len + extra_len + comment_len, what_,
              "central directory entry ", index, " runs past the directory");
  const std::string name(p + 46, name_len);
  const char* extra = p + 46 + name_len;
  for (size_t at = 0; at + 4 <= extra_len;) {  // extra fields; id 1 holds zip64 sizes
    const uint16_t id = U16(extra + at), len = U16(extra + at + 2);
    TORCH_CHECK(at + 4 + len <= extra_len, what_, "record '", name, "' has a malformed extra field");
    size_t field = at + 4;
    const size_t field_end = field + len;
    at = field_end;
    if (id != 1) continue;
    for (uint64_t* v : {&uncomp, &comp, &local}) {
      if (*v != 0xFFFFFFFFu) continue;
      TORCH_CHECK(field + 8 <= field_end, what_, "record '", name, "' has a short zip64 extra field");
      *v = U64(extra + field);
      field += 8;
    }
  }
  TORCH_CHECK((flags & 1) == 0, what_, "record '", name, "' is encrypted");
  TORCH_CHECK(method == 0, what_, "record '", name, "' is compressed (method ", method,
              "); torch checkpoints store records uncompressed");
  TORCH_CHECK(comp == uncomp, what_, "record '", name, "' is stored with ", comp, " bytes but lists ", uncomp,
              " uncompressed");
  TORCH_CHECK(local <= data_end_ && data_end_ - local >= 30, what_, "record '", name,
              "' has no local header at offset ", local);
  const char* header = At(local, 30);
  TORCH_CHECK(U32(header) == 0x04034b50, what_, "record '", name, "' has no local header at offset ", local);
  const uint64_t offset = local + 30 + U16(header + 26) + U16(header + 28);
  TORCH_CHECK(offset <= data_end_ && uncomp <= data_end_ - offset, what_, "record '", name, "' (", uncomp,
              " bytes at offset ", offset, ") extends past the data area, which ends at byte ", data_end_,
              " (truncated?)");
  if (index == 0) {
    const size_t slash = name.find('/');
    TORCH_CHECK(slash != std::string::npos && slash > 0, what_, "its first record '", name,
                "' is not in an archive directory");
    archive_ = name.substr(0, slash);
  }
  TORCH_CHECK(records_.emplace(name, Record{offset, uncomp, crc}).second, what_, "record '", name, "' appears twice");
  return p + 46 + name_len + extra_len + comment_len;
}

}  // namespace fsdp::checkpoint::internal
