// The zip layer of checkpoint files (checkpoint_reader.h): the central directory of an
// archive whose records are stored uncompressed, each checked to lie inside the data area
// before anything is read. The checkpoint reader's; public for LocateCheckpointTensor's Fetch.
//
// Two sources: an archive in memory, or one read in ranges through a `Fetch` (a chunk of a
// DCP data file: only the directory, the local headers and the records asked for are read).
#ifndef FSDP_CHECKPOINT_CHECKPOINT_ZIP_H_
#define FSDP_CHECKPOINT_CHECKPOINT_ZIP_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/container/flat_hash_map.h"

namespace fsdp::checkpoint::internal {

class CheckpointZip {
 public:
  // Parses the directory of `data[0, size)`; errors are c10::Errors starting with `what`
  // (which must outlive this object).
  CheckpointZip(const char* data, size_t size, const std::string& what);
  // Reads bytes [offset, offset + size) of the archive into `out`; called only with ranges
  // inside [0, size) of the constructor's `size`. Errors propagate.
  using Fetch = std::function<void(uint64_t offset, size_t size, char* out)>;
  // The archive of `size` bytes that `fetch` reads; only its directory is read here.
  CheckpointZip(uint64_t size, Fetch fetch, const std::string& what);

  // Where a record's bytes lie in the archive, and their CRC-32 (0: the writer stored none).
  struct Record {
    uint64_t offset, size;
    uint32_t crc;
  };
  // The record `name`; an error naming it when the archive has none.
  const Record& Find(const std::string& name) const;

  bool Has(const std::string& name) const { return records_.contains(name); }
  // The directory name of the archive's first record (what every record is under).
  const std::string& archive() const { return archive_; }
  // The record's bytes (a view into `data`, or, fetched, into a buffer this object owns),
  // CRC-32 checked unless the writer stored no CRC.
  std::string_view Read(const std::string& name) const;

 private:
  // The error for a record whose bytes have CRC-32 `crc` instead of the listed one.
  [[noreturn]] void CrcMismatch(const std::string& name, uint32_t crc) const;
  void Parse();
  const char* ParseEntry(const char* p, const char* end, uint64_t index);
  // Bytes [offset, offset + n) of the archive (inside it: the caller checked).
  const char* At(uint64_t offset, uint64_t n) const;

  const char* data_ = nullptr;  // the archive in memory, or null: read through fetch_
  uint64_t size_;
  Fetch fetch_;
  mutable std::deque<std::pair<uint64_t, std::string>> fetched_;  // (offset, bytes), alive as long as this
  const std::string& what_;
  uint64_t data_end_ = 0;
  std::string archive_;
  absl::flat_hash_map<std::string, Record> records_;
};

}  // namespace fsdp::checkpoint::internal

#endif  // FSDP_CHECKPOINT_CHECKPOINT_ZIP_H_
