// The zip layer of checkpoint files (checkpoint_reader.h): the central directory of an
// archive whose records are stored uncompressed, each checked to lie inside the data area
// before anything is read. Internal to the checkpoint reader.
#ifndef FSDP_CHECKPOINT_CHECKPOINT_ZIP_H_
#define FSDP_CHECKPOINT_CHECKPOINT_ZIP_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/container/flat_hash_map.h"

namespace fsdp::checkpoint::internal {

// Zip's CRC-32 of data[0, size): with PCLMULQDQ where the CPU has it, else by table.
uint32_t Crc32(const char* data, size_t size);
// By table only (the reference the fast one is tested against).
uint32_t Crc32Portable(const char* data, size_t size);

class CheckpointZip {
 public:
  // Parses the directory of `data[0, size)`; errors are c10::Errors starting with `what`
  // (which must outlive this object).
  CheckpointZip(const char* data, size_t size, const std::string& what);

  bool Has(const std::string& name) const { return records_.contains(name); }
  // The directory name of the archive's first record (what every record is under).
  const std::string& archive() const { return archive_; }
  // The record's bytes (a view into `data`), CRC-32 checked unless the writer stored no CRC.
  std::string_view Read(const std::string& name) const;

 private:
  struct Record {
    uint64_t offset, size;
    uint32_t crc;
  };
  void Parse();
  const char* ParseEntry(const char* p, const char* end, uint64_t index);

  const char* data_;
  size_t size_;
  const std::string& what_;
  uint64_t data_end_ = 0;
  std::string archive_;
  absl::flat_hash_map<std::string, Record> records_;
};

}  // namespace fsdp::checkpoint::internal

#endif  // FSDP_CHECKPOINT_CHECKPOINT_ZIP_H_
