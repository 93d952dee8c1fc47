#include "checkpoint/checkpoint_zip.h"

#include <c10/util/Exception.h>

#include <array>
#include <cstring>

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

// CRC-32 (zip's polynomial), slicing by 8 bytes: a few GB/s, so checking every record of a
// large checkpoint costs little next to reading it.
uint32_t Crc32(const char* data, size_t size) {
  static const auto tables = [] {
    std::array<std::array<uint32_t, 256>, 8> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (int s = 1; s < 8; ++s) {
      for (uint32_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  const auto* p = reinterpret_cast<const uint8_t*>(data);
  for (; size >= 8; size -= 8, p += 8) {
    const uint32_t lo = U32(reinterpret_cast<const char*>(p)) ^ crc, hi = U32(reinterpret_cast<const char*>(p + 4));
    crc = tables[7][lo & 0xFF] ^ tables[6][(lo >> 8) & 0xFF] ^ tables[5][(lo >> 16) & 0xFF] ^ tables[4][lo >> 24] ^
          tables[3][hi & 0xFF] ^ tables[2][(hi >> 8) & 0xFF] ^ tables[1][(hi >> 16) & 0xFF] ^ tables[0][hi >> 24];
  }
  for (; size > 0; --size, ++p) crc = tables[0][(crc ^ *p) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

}  // namespace

CheckpointZip::CheckpointZip(const char* data, size_t size, const std::string& what)
    : data_(data), size_(size), what_(what) {
  Parse();
}

std::string_view CheckpointZip::Read(const std::string& name) const {
  auto it = records_.find(name);
  TORCH_CHECK(it != records_.end(), what_, "it has no record '", name, "'");
  const Record& r = it->second;
  const std::string_view bytes(data_ + r.offset, r.size);
  if (r.crc != 0) {  // 0: written without checksums (torch.save's compute_crc32=False)
    const uint32_t crc = Crc32(bytes.data(), bytes.size());
    TORCH_CHECK(crc == r.crc, what_, "record '", name, "' (", r.size, " bytes at offset ", r.offset, ") has CRC-32 ",
                crc, " but the archive lists ", r.crc, " (corrupted)");
  }
  return bytes;
}

void CheckpointZip::Parse() {
  TORCH_CHECK(size_ >= 22, what_, "it has ", size_, " bytes, fewer than the 22 of an empty zip archive (truncated?)");
  // End of central directory: the last 22 bytes, or earlier by a comment that ends the file.
  size_t eocd = size_;
  const size_t lowest = size_ - 22 > 65535 ? size_ - 22 - 65535 : 0;
  for (size_t pos = size_ - 22;; --pos) {
    if (U32(data_ + pos) == 0x06054b50 && pos + 22 + U16(data_ + pos + 20) == size_) {
      eocd = pos;
      break;
    }
    if (pos == lowest) break;
  }
  TORCH_CHECK(eocd != size_, what_,
              "no zip end-of-central-directory record at its end (truncated, or not a file "
              "that torch.save / torch::pickle_save wrote)");
  uint64_t entries = U16(data_ + eocd + 10), cd_size = U32(data_ + eocd + 12), cd_offset = U32(data_ + eocd + 16);
  uint64_t cd_limit = eocd;                                  // the central directory ends before this
  if (eocd >= 20 && U32(data_ + eocd - 20) == 0x07064b50) {  // zip64 locator
    const uint64_t eocd64 = U64(data_ + eocd - 20 + 8);
    TORCH_CHECK(eocd64 <= eocd - 20 && eocd - 20 - eocd64 >= 56 && U32(data_ + eocd64) == 0x06064b50, what_,
                "its zip64 end-of-central-directory offset ", eocd64, " does not point at one");
    entries = U64(data_ + eocd64 + 32);
    cd_size = U64(data_ + eocd64 + 40);
    cd_offset = U64(data_ + eocd64 + 48);
    cd_limit = eocd64;
  }
  TORCH_CHECK(cd_offset <= cd_limit && cd_size <= cd_limit - cd_offset, what_, "its central directory (", cd_size,
              " bytes at offset ", cd_offset, ") does not fit before byte ", cd_limit, " (truncated?)");
  TORCH_CHECK(entries <= cd_size / 46, what_, "its central directory of ", cd_size, " bytes cannot hold ", entries,
              " records");
  data_end_ = cd_offset;
  const char* p = data_ + cd_offset;
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
  TORCH_CHECK(local <= data_end_ && data_end_ - local >= 30 && U32(data_ + local) == 0x04034b50, what_, "record '",
              name, "' has no local header at offset ", local);
  const uint64_t offset = local + 30 + U16(data_ + local + 26) + U16(data_ + local + 28);
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
