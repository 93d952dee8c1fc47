#include "pickle/opcodes.h"

#include <cstddef>

namespace fsdp::pickle {

bool IsUtf8(std::string_view s) {
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};  // shortest form per length
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<uint8_t>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (len > s.size() - i) return false;
    for (size_t k = 1; k < len; ++k) {
      const auto cc = static_cast<uint8_t>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (cp < kMin[len] || cp > 0x10FFFF) return false;
    i += len;
  }
  return true;
}

}  // namespace fsdp::pickle
