#include "checkpoint/checkpoint_zip.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

// CRC-32 (zip's polynomial, bit-reflected), slicing by 8 bytes: ~2 GB/s. `reg` is the
// register (the CRC before its final inversion).
uint32_t Crc32Table(const uint8_t* p, size_t size, uint32_t reg) {
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
  uint32_t crc = reg;
  for (; size >= 8; size -= 8, p += 8) {
    const uint32_t lo = U32(reinterpret_cast<const char*>(p)) ^ crc, hi = U32(reinterpret_cast<const char*>(p + 4));
    crc = tables[7][lo & 0xFF] ^ tables[6][(lo >> 8) & 0xFF] ^ tables[5][(lo >> 16) & 0xFF] ^ tables[4][lo >> 24] ^
          tables[3][hi & 0xFF] ^ tables[2][(hi >> 8) & 0xFF] ^ tables[1][(hi >> 16) & 0xFF] ^ tables[0][hi >> 24];
  }
  for (; size > 0; --size, ++p) crc = tables[0][(crc ^ *p) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
// The same register update with carry-less multiplication (PCLMULQDQ): ~11 GB/s, so checking
// a loaded checkpoint's records costs about a memcpy instead of 5x one (bench/dcp_bench).
// Intel's folding method ("Fast CRC Computation for Generic Polynomials Using PCLMULQDQ
// Instruction", Gopal et al., 2009): four 128-bit lanes are folded forward 512 bits at a time
// (x^k mod P constants k1, k2), then into one lane (k3, k4) and 128 bits at a time, then
// 128 -> 64 -> 32 bits (k5) and a Barrett reduction (P' and mu). The constants are the
// bit-reflected ones for P = 0x104C11DB7. `size` >= 64 and a multiple of 16.
// (Helpers, not lambdas: GCC does not pass the target attribute on to a lambda.)
__attribute__((target("pclmul,sse4.1"))) inline __m128i Load128(const uint8_t* q) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
}
// lane * x^a ^ lane * x^b (its high and low 64 bits folded by k's two halves) ^ next.
__attribute__((target("pclmul,sse4.1"))) inline __m128i Fold128(__m128i lane, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(lane, k, 0x11), _mm_clmulepi64_si128(lane, k, 0x00)), next);
}

__attribute__((target("pclmul,sse4.1"))) uint32_t Crc32Fold(const uint8_t* p, size_t size, uint32_t reg) {
  alignas(16) static const uint64_t k1k2[] = {0x0154442bd4, 0x01c6e41596};
  alignas(16) static const uint64_t k3k4[] = {0x01751997d0, 0x00ccaa009e};
  alignas(16) static const uint64_t k5[] = {0x0163cd6124, 0};
  alignas(16) static const uint64_t barrett[] = {0x01db710641, 0x01f7011641};  // P', mu
  __m128i x1 = _mm_xor_si128(Load128(p), _mm_cvtsi32_si128(static_cast<int>(reg)));
  __m128i x2 = Load128(p + 16), x3 = Load128(p + 32), x4 = Load128(p + 48);
  p += 64;
  size -= 64;
  __m128i k = _mm_load_si128(reinterpret_cast<const __m128i*>(k1k2));
  for (; size >= 64; size -= 64, p += 64) {
    x1 = Fold128(x1, k, Load128(p));
    x2 = Fold128(x2, k, Load128(p + 16));
    x3 = Fold128(x3, k, Load128(p + 32));
    x4 = Fold128(x4, k, Load128(p + 48));
  }
  k = _mm_load_si128(reinterpret_cast<const __m128i*>(k3k4));
  x1 = Fold128(x1, k, x2);
  x1 = Fold128(x1, k, x3);
  x1 = Fold128(x1, k, x4);
  for (; size >= 16; size -= 16, p += 16) x1 = Fold128(x1, k, Load128(p));
  // 128 -> 64 bits.
  const __m128i low32 = _mm_setr_epi32(~0, 0, ~0, 0);
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), _mm_clmulepi64_si128(x1, k, 0x10));
  k = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k5));
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, low32), k, 0x00), _mm_srli_si128(x1, 4));
  // Barrett reduction to 32 bits.
  k = _mm_load_si128(reinterpret_cast<const __m128i*>(barrett));
  __m128i t = _mm_clmulepi64_si128(_mm_and_si128(x1, low32), k, 0x10);
  t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), k, 0x00);
  return static_cast<uint32_t>(_mm_extract_epi32(_mm_xor_si128(x1, t), 1));
}

bool HasCrc32Fold() {
  static const bool has = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return has;
}
#endif

}  // namespace

uint32_t Crc32(const char* data, size_t size) {
  const auto* p = reinterpret_cast<const uint8_t*>(data);
  uint32_t reg = 0xFFFFFFFFu;
#if defined(__x86_64__)
  if (size >= 64 && HasCrc32Fold()) {
    const size_t folded = size & ~size_t{15};
    reg = Crc32Fold(p, folded, reg);
    p += folded;
    size -= folded;
  }
#endif
  return Crc32Table(p, size, reg) ^ 0xFFFFFFFFu;
}

uint32_t Crc32Portable(const char* data, size_t size) {
  return Crc32Table(reinterpret_cast<const uint8_t*>(data), size, 0xFFFFFFFFu) ^ 0xFFFFFFFFu;
}

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
