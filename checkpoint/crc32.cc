#include "checkpoint/crc32.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <array>
#include <cstring>

namespace fsdp::checkpoint::internal {
namespace {

uint32_t LoadWord32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// CRC-32 (zip's polynomial, bit-reflected), slicing by 8 bytes: the portable fallback. `reg`
// is the register (the CRC before its final inversion).
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
    const uint32_t lo = LoadWord32(reinterpret_cast<const char*>(p)) ^ crc,
                   hi = LoadWord32(reinterpret_cast<const char*>(p + 4));
    crc = tables[7][lo & 0xFF] ^ tables[6][(lo >> 8) & 0xFF] ^ tables[5][(lo >> 16) & 0xFF] ^ tables[4][lo >> 24] ^
          tables[3][hi & 0xFF] ^ tables[2][(hi >> 8) & 0xFF] ^ tables[1][(hi >> 16) & 0xFF] ^ tables[0][hi >> 24];
  }
  for (; size > 0; --size, ++p) crc = tables[0][(crc ^ *p) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
// The same register update with carry-less multiplication. Every record of a loaded checkpoint
// is CRC-checked, so for a load to reach plain-file-read throughput the CRC must run well
// above memcpy speed, which the table does not (docs/design/measured-choices.md has the
// throughput of each variant and how it was measured). Intel's folding method ("Fast
// CRC Computation for Generic Polynomials Using PCLMULQDQ Instruction", Gopal et al., 2009):
// lanes of the message are folded forward D bits at a time (a 128-bit lane's two 64-bit
// halves times x^(D+32) and x^(D-32) mod P: congruent to lane * x^D modulo P), then into one
// 128-bit lane, then 128 -> 64 -> 32 bits (k5) and a Barrett reduction (P' and mu).
// The constants are for P = 0x104C11DB7, bit-reflected: (x^n mod P) reversed in 32 bits,
// shifted left 1 (so x^544 -> 0x154442bd4). The variants, the fastest the CPU has chosen at
// run time:
//   Crc32Table:      slicing by 8
//   Crc32Fold:       PCLMULQDQ, four 128-bit lanes by 512 bits
//   Crc32FoldAvx512: VPCLMULQDQ, four 512-bit lanes by 2048 bits
// (Helpers, not lambdas: GCC does not pass the target attribute on to a lambda.)
__attribute__((target("pclmul,sse4.1"))) inline __m128i Load128(const uint8_t* q) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
}
// lane * x^a ^ lane * x^b (its high and low 64 bits folded by k's two halves) ^ next.
__attribute__((target("pclmul,sse4.1"))) inline __m128i Fold128(__m128i lane, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(lane, k, 0x11), _mm_clmulepi64_si128(lane, k, 0x00)), next);
}

// Folds the 128-bit lane x1 (the register so far, p[0, size) still to come; `size` a multiple
// of 16) over p 128 bits at a time, then reduces it to the 32-bit register.
__attribute__((target("pclmul,sse4.1"))) uint32_t Crc32FoldTail(__m128i x1, const uint8_t* p, size_t size) {
  alignas(16) static const uint64_t k3k4[] = {0x01751997d0, 0x00ccaa009e};     // x^160, x^96
  alignas(16) static const uint64_t k5[] = {0x0163cd6124, 0};                  // x^64
  alignas(16) static const uint64_t barrett[] = {0x01db710641, 0x01f7011641};  // P', mu
  __m128i k = _mm_load_si128(reinterpret_cast<const __m128i*>(k3k4));
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

// Four 128-bit lanes folded 512 bits at a time. `size` >= 64 and a multiple of 16.
__attribute__((target("pclmul,sse4.1"))) uint32_t Crc32Fold(const uint8_t* p, size_t size, uint32_t reg) {
  alignas(16) static const uint64_t k1k2[] = {0x0154442bd4, 0x01c6e41596};  // x^544, x^480
  alignas(16) static const uint64_t k3k4[] = {0x01751997d0, 0x00ccaa009e};  // x^160, x^96
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
  return Crc32FoldTail(x1, p, size);
}

bool HasCrc32Fold() {
  static const bool has = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return has;
}

// The same folds on 512-bit registers (VPCLMULQDQ does four 128-bit carry-less multiplies at
// once): four 512-bit lanes folded 2048 bits at a time, then into one (512 bits at a time),
// then its four 128-bit parts into one (by 384, 256 and 128 bits), handed to Crc32FoldTail.
#define FSDP_CRC32_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,vpclmulqdq,pclmul,sse4.1")))
FSDP_CRC32_AVX512 inline __m512i Load512(const uint8_t* q) { return _mm512_loadu_si512(q); }
// Each 128-bit part: as Fold128 (0x96: a three-way xor).
FSDP_CRC32_AVX512 inline __m512i Fold512(__m512i lane, __m512i k, __m512i next) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(lane, k, 0x11), _mm512_clmulepi64_epi128(lane, k, 0x00),
                                   next, 0x96);
}
// (x^(D+32) mod P, x^(D-32) mod P) for fold distance D, in every 128-bit part.
FSDP_CRC32_AVX512 inline __m512i FoldConstant512(uint64_t lo, uint64_t hi) {
  const auto l = static_cast<long long>(lo), h = static_cast<long long>(hi);
  return _mm512_set_epi64(h, l, h, l, h, l, h, l);
}

// The 128-bit part kI of z. (All of it through the zero-masking form: GCC 12's plain
// _mm512_extracti32x4_epi32 trips -Wuninitialized on its own header.)
template <int kI>
FSDP_CRC32_AVX512 inline __m128i Part128(__m512i z) {
  return _mm512_maskz_extracti32x4_epi32(0xF, z, kI);
}

// `size` >= 256 and a multiple of 16.
FSDP_CRC32_AVX512 uint32_t Crc32FoldAvx512(const uint8_t* p, size_t size, uint32_t reg) {
  __m512i z1 = _mm512_xor_si512(Load512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(reg))));
  __m512i z2 = Load512(p + 64), z3 = Load512(p + 128), z4 = Load512(p + 192);
  p += 256;
  size -= 256;
  __m512i k = FoldConstant512(0x011542778a, 0x01322d1430);  // D = 2048: x^2080, x^2016
  for (; size >= 256; size -= 256, p += 256) {
    z1 = Fold512(z1, k, Load512(p));
    z2 = Fold512(z2, k, Load512(p + 64));
    z3 = Fold512(z3, k, Load512(p + 128));
    z4 = Fold512(z4, k, Load512(p + 192));
  }
  k = FoldConstant512(0x0154442bd4, 0x01c6e41596);  // D = 512: x^544, x^480
  z1 = Fold512(z1, k, z2);
  z1 = Fold512(z1, k, z3);
  z1 = Fold512(z1, k, z4);
  for (; size >= 64; size -= 64, p += 64) z1 = Fold512(z1, k, Load512(p));
  const __m128i k384 = _mm_set_epi64x(0x0174359406, 0x003db1ecdc);  // x^352, x^416
  const __m128i k256 = _mm_set_epi64x(0x015a546366, 0x00f1da05aa);  // x^224, x^288
  const __m128i k128 = _mm_set_epi64x(0x00ccaa009e, 0x01751997d0);  // x^96, x^160
  const __m128i x1 =
      Fold128(Part128<0>(z1), k384, Fold128(Part128<1>(z1), k256, Fold128(Part128<2>(z1), k128, Part128<3>(z1))));
  return Crc32FoldTail(x1, p, size);
}
#undef FSDP_CRC32_AVX512

bool HasCrc32FoldAvx512() {
  static const bool has = HasCrc32Fold() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("vpclmulqdq");
  return has;
}
#endif

}  // namespace

uint32_t Crc32Update(uint32_t crc, const char* data, size_t size) {
  const auto* p = reinterpret_cast<const uint8_t*>(data);
  uint32_t reg = crc ^ 0xFFFFFFFFu;
#if defined(__x86_64__)
  if (size >= 64 && HasCrc32Fold()) {
    const size_t folded = size & ~size_t{15};
    reg = size >= 256 && HasCrc32FoldAvx512() ? Crc32FoldAvx512(p, folded, reg) : Crc32Fold(p, folded, reg);
    p += folded;
    size -= folded;
  }
#endif
  return Crc32Table(p, size, reg) ^ 0xFFFFFFFFu;
}

uint32_t Crc32(const char* data, size_t size) { return Crc32Update(0, data, size); }

uint32_t Crc32Portable(const char* data, size_t size) {
  return Crc32Table(reinterpret_cast<const uint8_t*>(data), size, 0xFFFFFFFFu) ^ 0xFFFFFFFFu;
}

}  // namespace fsdp::checkpoint::internal
