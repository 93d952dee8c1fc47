// The zip layer of the checkpoint writer (checkpoint_writer.h), internal to //checkpoint:
// stored (uncompressed) records as torch.load's reader (caffe2/serialize/inline_container.cc,
// miniz) and ours (checkpoint_zip.h) read them.
//
// Each record's data starts at a multiple of 64 bytes (an "FB" extra field pads its local
// header, as PyTorch's writer does, so that torch.load(mmap=True) maps storages aligned) and
// is CRC-32'd (crc32.h) while it is written, in blocks still in the cache: no copy, one pass.
// The CRC-32 follows the data (a data descriptor). Every record and the end of the archive are
// zip64 (8-byte sizes and offsets), so archives of any size take the one layout the tests
// check, not a branch only a 4 GiB file would reach.
#ifndef FSDP_CHECKPOINT_ZIP_WRITER_H_
#define FSDP_CHECKPOINT_ZIP_WRITER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp::checkpoint::internal {

class ZipWriter {
 public:
  // Takes the archive's bytes in order; it takes all of them or throws.
  using Sink = std::function<void(const char* data, size_t size)>;
  explicit ZipWriter(Sink sink) : sink_(std::move(sink)) {}

  // Appends the record `name` holding data[0, size).
  void Add(const std::string& name, const char* data, size_t size);
  void Add(const std::string& name, std::string_view data) { Add(name, data.data(), data.size()); }
  // Writes the central directory and the end records. Nothing is added afterwards.
  void Finish();

 private:
  struct Entry {
    std::string name;
    uint32_t crc;
    uint64_t size, offset;
  };
  void Emit(const char* data, size_t size);
  void Emit(const std::string& bytes) { Emit(bytes.data(), bytes.size()); }

  Sink sink_;
  uint64_t offset_ = 0;  // bytes written so far
  std::vector<Entry> entries_;
};

}  // namespace fsdp::checkpoint::internal

#endif  // FSDP_CHECKPOINT_ZIP_WRITER_H_
