#include "checkpoint/zip_writer.h"

#include <algorithm>
#include <bit>
#include <utility>

#include "checkpoint/crc32.h"

namespace fsdp::checkpoint::internal {
namespace {

static_assert(std::endian::native == std::endian::little, "zip fields are little-endian");

void Put16(std::string& s, uint16_t v) { s.append(reinterpret_cast<const char*>(&v), 2); }
void Put32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }
void Put64(std::string& s, uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }

constexpr uint16_t kVersion = 45;          // 4.5: zip64
constexpr uint16_t kFlags = 0x0808;        // UTF-8 names, CRC-32 and sizes in a data descriptor
constexpr uint32_t kInZip64 = 0xFFFFFFFF;  // a field whose value is in the zip64 extra field

// A record's local header: sizes in a zip64 extra field (zero: the data descriptor has them,
// as Python's zipfile writes a streamed zip64 record), then an "FB" field padding the header
// so that the data starts at a multiple of 64 bytes (inline_container.cc getPadding).
std::string LocalHeader(uint64_t offset, const std::string& name) {
  std::string h;
  Put32(h, 0x04034b50);
  Put16(h, kVersion);
  Put16(h, kFlags);
  Put16(h, 0);  // stored
  Put32(h, 0);  // time, date
  Put32(h, 0);  // CRC-32: in the data descriptor
  Put32(h, kInZip64);
  Put32(h, kInZip64);
  const uint64_t unpadded = offset + 30 + name.size() + 20 + 4;
  const uint16_t pad = static_cast<uint16_t>((64 - unpadded % 64) % 64);
  Put16(h, static_cast<uint16_t>(name.size()));
  Put16(h, static_cast<uint16_t>(20 + 4 + pad));
  h += name;
  Put16(h, 1);  // zip64: uncompressed and compressed size
  Put16(h, 16);
  Put64(h, 0);
  Put64(h, 0);
  h += "FB";
  Put16(h, pad);
  h.append(pad, 'Z');
  return h;
}

std::string DataDescriptor(uint32_t crc, uint64_t size) {
  std::string d;
  Put32(d, 0x08074b50);
  Put32(d, crc);
  Put64(d, size);  // compressed
  Put64(d, size);  // uncompressed
  return d;
}

}  // namespace

void ZipWriter::Emit(const char* data, size_t size) {
  sink_(data, size);
  offset_ += size;
}

void ZipWriter::Add(const std::string& name, const char* data, size_t size) {
  const uint64_t offset = offset_;
  Emit(LocalHeader(offset, name));
  uint32_t crc = 0;
  constexpr size_t kBlock = size_t{1} << 19;  // CRC'ed while in the cache, then written
  for (size_t at = 0; at < size; at += kBlock) {
    const size_t n = std::min(kBlock, size - at);
    crc = Crc32Update(crc, data + at, n);
    Emit(data + at, n);
  }
  Emit(DataDescriptor(crc, size));
  entries_.push_back({name, crc, size, offset});
}

void ZipWriter::Finish() {
  const uint64_t cd_offset = offset_;
  std::string tail;
  for (const Entry& e : entries_) {
    Put32(tail, 0x02014b50);
    Put16(tail, kVersion);  // made by
    Put16(tail, kVersion);  // needed
    Put16(tail, kFlags);
    Put16(tail, 0);  // stored
    Put32(tail, 0);  // time, date
    Put32(tail, e.crc);
    Put32(tail, kInZip64);
    Put32(tail, kInZip64);
    Put16(tail, static_cast<uint16_t>(e.name.size()));
    Put16(tail, 28);  // the zip64 extra field
    Put16(tail, 0);   // comment
    Put16(tail, 0);   // disk
    Put16(tail, 0);   // internal attributes
    Put32(tail, 0);   // external attributes
    Put32(tail, kInZip64);
    tail += e.name;
    Put16(tail, 1);  // zip64: uncompressed size, compressed size, local header offset
    Put16(tail, 24);
    Put64(tail, e.size);
    Put64(tail, e.size);
    Put64(tail, e.offset);
  }
  const uint64_t cd_size = tail.size(), eocd64 = cd_offset + cd_size, n = entries_.size();
  Put32(tail, 0x06064b50);  // zip64 end of central directory
  Put64(tail, 44);
  Put16(tail, kVersion);
  Put16(tail, kVersion);
  Put32(tail, 0);
  Put32(tail, 0);
  Put64(tail, n);
  Put64(tail, n);
  Put64(tail, cd_size);
  Put64(tail, cd_offset);
  Put32(tail, 0x07064b50);  // its locator
  Put32(tail, 0);
  Put64(tail, eocd64);
  Put32(tail, 1);
  Put32(tail, 0x06054b50);  // the classic end record: what fits, the rest in the zip64 one
  Put16(tail, 0);
  Put16(tail, 0);
  Put16(tail, static_cast<uint16_t>(std::min<uint64_t>(n, 0xFFFF)));
  Put16(tail, static_cast<uint16_t>(std::min<uint64_t>(n, 0xFFFF)));
  Put32(tail, static_cast<uint32_t>(std::min<uint64_t>(cd_size, kInZip64)));
  Put32(tail, static_cast<uint32_t>(std::min<uint64_t>(cd_offset, kInZip64)));
  Put16(tail, 0);
  Emit(tail);
}

}  // namespace fsdp::checkpoint::internal
