#include "pickle/pickler.h"

#include <c10/util/Exception.h>

#include <bit>
#include <cstdint>
#include <utility>

namespace fsdp::pickle {

Pickler::Pickler(std::string what) : what_(std::move(what)) {
  Op(op::kProto);
  Op(2);
}

void Pickler::Le(uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void Pickler::Int(int64_t v) {  // the shortest form, as Python's pickler
  if (v >= 0 && v < 256) {
    Op(op::kBinInt1), Le(v, 1);
  } else if (v >= 0 && v < 65536) {
    Op(op::kBinInt2), Le(v, 2);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    Op(op::kBinInt), Le(static_cast<uint32_t>(v), 4);
  } else {
    Op(op::kLong1), Op(8), Le(static_cast<uint64_t>(v), 8);
  }
}

void Pickler::Float(double v) {
  Op(op::kBinFloat);
  const uint64_t bits = std::bit_cast<uint64_t>(v);
  for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xFF));
}

void Pickler::Str(std::string_view v) {
  TORCH_CHECK(IsUtf8(v), what_, ": the str '", v.substr(0, 64), "' is not valid UTF-8");
  TORCH_CHECK(v.size() <= UINT32_MAX, what_, ": a str of ", v.size(), " bytes");
  Op(op::kBinUnicode);
  Le(v.size(), 4);
  out_.insert(out_.end(), v.begin(), v.end());
}

void Pickler::Global(std::string_view module, std::string_view name) {
  const std::string key = std::string(module) + "\n" + std::string(name) + "\n";
  auto it = memo_.find(key);
  if (it != memo_.end()) {
    const uint32_t id = it->second;
    id < 256 ? (Op(op::kBinGet), Le(id, 1)) : (Op(op::kLongBinGet), Le(id, 4));
    return;
  }
  Op(op::kGlobal);
  out_.insert(out_.end(), key.begin(), key.end());
  const uint32_t id = static_cast<uint32_t>(memo_.size());
  memo_.emplace(key, id);
  id < 256 ? (Op(op::kBinPut), Le(id, 1)) : (Op(op::kLongBinPut), Le(id, 4));
}

std::vector<char> Pickler::Finish() {
  Op(op::kStop);
  return std::move(out_);
}

}  // namespace fsdp::pickle
