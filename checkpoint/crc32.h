// Zip's CRC-32 (the checksum of every record of a torch.save archive). Internal to the
// checkpoint reader and writer.
#ifndef FSDP_CHECKPOINT_CRC32_H_
#define FSDP_CHECKPOINT_CRC32_H_

#include <cstddef>
#include <cstdint>

namespace fsdp::checkpoint::internal {

// Zip's CRC-32 of data[0, size): with VPCLMULQDQ + AVX-512 or PCLMULQDQ where the CPU has
// them, else by table.
uint32_t Crc32(const char* data, size_t size);
// The CRC-32 of the bytes before data[0, size) (whose CRC-32 is `crc`) followed by them, as
// zlib's crc32(crc, data, size): Crc32Update(Crc32(a), b) == Crc32(a + b); Crc32Update(0, ...)
// == Crc32(...). For checking a record read in pieces.
uint32_t Crc32Update(uint32_t crc, const char* data, size_t size);
// By table only (the reference the fast one is tested against).
uint32_t Crc32Portable(const char* data, size_t size);

}  // namespace fsdp::checkpoint::internal

#endif  // FSDP_CHECKPOINT_CRC32_H_
