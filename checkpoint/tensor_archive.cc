#include "checkpoint/tensor_archive.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <unordered_set>
#include <vector>

#include "checkpoint/crc32.h"

namespace fsdp::checkpoint {
namespace {

void Put16(std::string& s, uint16_t v) { s.append(reinterpret_cast<const char*>(&v), 2); }
void Put32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }
void Put64(std::string& s, uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }

// A pickle int as LibTorch's Pickler::pushInt writes it.
void PickleInt(std::string& p, int64_t v) {
  if (v >= 0 && v <= 0xFF) {
    p += 'K';
    p += static_cast<char>(v);
  } else if (v >= 0 && v <= 0xFFFF) {
    p += 'M';
    Put16(p, static_cast<uint16_t>(v));
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    p += 'J';
    Put32(p, static_cast<uint32_t>(static_cast<int32_t>(v)));
  } else {
    p += '\x8a';  // LONG1 with 8 bytes
    p += '\x08';
    Put64(p, static_cast<uint64_t>(v));
  }
}

void PickleString(std::string& p, const std::string& v) {
  p += 'X';  // BINUNICODE
  Put32(p, static_cast<uint32_t>(v.size()));
  p += v;
}

void PickleInts(std::string& p, c10::IntArrayRef v) {
  p += '(';
  for (int64_t x : v) PickleInt(p, x);
  p += 't';
}

// BINPUT i: LibTorch's Pickler memoizes every global and string it writes.
void Memo(std::string& p, int i) {
  p += 'q';
  p += static_cast<char>(i);
}

// data.pkl of _rebuild_tensor_v2(storage '0', 0, sizes, strides, False, OrderedDict()), as
// LibTorch's Pickler writes it for a tensor (BINPERSID of its storage's id tuple).
std::string TensorPickle(const at::Tensor& t, const char* storage) {
  std::string p = "\x80\x02";  // PROTO 2
  p += "ctorch._utils\n_rebuild_tensor_v2\n";
  Memo(p, 0);
  p += "((";  // the arguments' tuple, then the persistent id's
  PickleString(p, "storage");
  Memo(p, 1);
  p += std::string("ctorch\n") + storage + "\n";
  Memo(p, 2);
  PickleString(p, "0");
  Memo(p, 3);
  PickleString(p, "cpu");
  Memo(p, 4);
  PickleInt(p, t.numel());
  p += "tQ";  // TUPLE, BINPERSID
  Memo(p, 5);
  PickleInt(p, 0);  // storage offset
  PickleInts(p, t.sizes());
  PickleInts(p, t.strides());
  p += '\x89';  // requires_grad: NEWFALSE
  p += "ccollections\nOrderedDict\n";
  Memo(p, 6);
  p += ")Rt";  // OrderedDict(), then the arguments' TUPLE
  p += 'R';    // REDUCE: _rebuild_tensor_v2(*args)
  Memo(p, 7);
  p += '.';
  return p;
}

// Flags: UTF-8 names (0x0800), and a data descriptor after the data (0x0008) for a
// non-empty record (miniz writes none for an empty one).
uint16_t Flags(uint32_t size) { return size > 0 ? 0x0808 : 0x0800; }

// A record's local header, padded with an "FB" extra field so that its data starts at a
// multiple of 64 bytes (inline_container.cc getPadding).
std::string LocalHeader(uint64_t offset, const std::string& name, uint16_t flags) {
  std::string h;
  Put32(h, 0x04034b50);
  Put16(h, 0);  // version needed
  Put16(h, flags);
  Put16(h, 0);  // stored
  Put32(h, 0);  // time, date
  Put32(h, 0);  // CRC-32 and sizes: in the data descriptor
  Put32(h, 0);
  Put32(h, 0);
  const uint64_t unpadded = offset + 30 + name.size() + 4;
  const uint16_t pad = static_cast<uint16_t>((64 - unpadded % 64) % 64);
  Put16(h, static_cast<uint16_t>(name.size()));
  Put16(h, static_cast<uint16_t>(4 + pad));
  h += name;
  h += "FB";
  Put16(h, pad);
  h.append(pad, 'Z');
  return h;
}

std::string DataDescriptor(uint32_t crc, uint32_t size) {
  std::string d;
  Put32(d, 0x08074b50);
  Put32(d, crc);
  Put32(d, size);
  Put32(d, size);
  return d;
}

struct Entry {
  std::string name;
  uint32_t crc, size;
  uint64_t offset;
};

// c10::hash_combine (c10/util/hash.h).
uint64_t HashCombine(uint64_t seed, uint64_t value) { return seed ^ (value + 0x9e3779b9 + (seed << 6) + (seed >> 2)); }

// The serialization id LibTorch's writer derives from the records before it
// (PyTorchStreamWriter::writeSerializationId): a combined hash of their names (short, without
// "archive/"), taken in the iteration order of the std::unordered_set it keeps them in, and
// one of the CRC-32s of the non-empty ones in writing order, each as 20 zero-padded digits. Deterministic: the same
// tensor, the same bytes (and this libstdc++ is LibTorch's: the same set order and hash).
std::string SerializationId(const std::vector<Entry>& records) {
  std::unordered_set<std::string> written;
  uint64_t names = 0, crcs = 0;
  for (const Entry& e : records) {
    written.insert(e.name.substr(std::string("archive/").size()));
    if (e.size > 0) crcs = HashCombine(crcs, e.crc);  // an empty record adds no CRC
  }
  for (const std::string& name : written) names = HashCombine(names, std::hash<std::string>{}(name));
  char id[41];
  std::snprintf(id, sizeof(id), "%020llu%020llu", static_cast<unsigned long long>(names),
                static_cast<unsigned long long>(crcs));
  return std::string(id, 40);
}

}  // namespace

const char* TorchStorageName(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "FloatStorage";
    case at::kDouble: return "DoubleStorage";
    case at::kHalf: return "HalfStorage";
    case at::kBFloat16: return "BFloat16Storage";
    case at::kLong: return "LongStorage";
    case at::kInt: return "IntStorage";
    case at::kShort: return "ShortStorage";
    case at::kChar: return "CharStorage";
    case at::kByte: return "ByteStorage";
    case at::kBool: return "BoolStorage";
    case at::kComplexFloat: return "ComplexFloatStorage";
    case at::kComplexDouble: return "ComplexDoubleStorage";
    default: return nullptr;
  }
}

bool WriteTensorArchive(AtomicFile& out, const at::Tensor& t) {
  const char* storage = t.defined() ? TorchStorageName(t.scalar_type()) : nullptr;
  if (storage == nullptr || !t.device().is_cpu() || !t.is_contiguous() || t.storage_offset() != 0 ||
      t.storage().nbytes() != t.nbytes() || t.nbytes() >= 0xFFFFFFFFull) {
    return false;
  }
  const uint64_t start = static_cast<uint64_t>(out.size());
  std::vector<Entry> entries;
  // Appends one record whose bytes `write` writes, CRC'ed by `write` into `crc`.
  const auto record = [&](const std::string& name, uint32_t size, auto&& write) {
    const uint64_t offset = static_cast<uint64_t>(out.size()) - start;
    const std::string header = LocalHeader(offset, name, Flags(size));
    out.Write(header.data(), header.size());
    uint32_t crc = 0;
    write(crc);
    if (size > 0) out.Write(DataDescriptor(crc, size).data(), 16);
    entries.push_back({name, crc, size, offset});
  };
  const auto bytes = [&](const std::string& value) {
    return [&out, &value](uint32_t& crc) {
      crc = internal::Crc32(value.data(), value.size());
      out.Write(value.data(), value.size());
    };
  };
  const char* data = static_cast<const char*>(t.data_ptr());
  const size_t nbytes = t.nbytes();
  record("archive/data/0", static_cast<uint32_t>(nbytes), [&](uint32_t& crc) {
    constexpr size_t kBlock = size_t{1} << 19;  // CRC'ed while in the cache, then written
    for (size_t at = 0; at < nbytes; at += kBlock) {
      const size_t n = std::min(kBlock, nbytes - at);
      crc = internal::Crc32Update(crc, data + at, n);
      out.Write(data + at, n);
    }
  });
  const std::string pickle = TensorPickle(t, storage), version = "3\n", order = "little";
  record("archive/data.pkl", static_cast<uint32_t>(pickle.size()), bytes(pickle));
  record("archive/version", 2, bytes(version));
  record("archive/byteorder", 6, bytes(order));
  const std::string id = SerializationId(entries);
  record("archive/.data/serialization_id", 40, bytes(id));
  // The central directory, then zip64's end record and locator, then the classic end record.
  const uint64_t cd_offset = static_cast<uint64_t>(out.size()) - start;
  std::string tail;
  for (const Entry& e : entries) {
    Put32(tail, 0x02014b50);
    Put16(tail, 0);  // version made by
    Put16(tail, 0);  // version needed
    Put16(tail, Flags(e.size));
    Put16(tail, 0);  // stored
    Put32(tail, 0);  // time, date
    Put32(tail, e.crc);
    Put32(tail, e.size);
    Put32(tail, e.size);
    Put16(tail, static_cast<uint16_t>(e.name.size()));
    Put16(tail, 0);  // extra
    Put16(tail, 0);  // comment
    Put16(tail, 0);  // disk
    Put16(tail, 0);  // internal attributes
    Put32(tail, 0);  // external attributes
    Put32(tail, static_cast<uint32_t>(e.offset));
    tail += e.name;
  }
  const uint64_t cd_size = tail.size(), eocd64 = cd_offset + cd_size;
  Put32(tail, 0x06064b50);
  Put64(tail, 44);
  Put16(tail, 0x031e);  // version made by, as miniz
  Put16(tail, 0x2d);    // version needed: 4.5 (zip64)
  Put32(tail, 0);
  Put32(tail, 0);
  Put64(tail, entries.size());
  Put64(tail, entries.size());
  Put64(tail, cd_size);
  Put64(tail, cd_offset);
  Put32(tail, 0x07064b50);
  Put32(tail, 0);
  Put64(tail, eocd64);
  Put32(tail, 1);
  Put32(tail, 0x06054b50);
  Put16(tail, 0);
  Put16(tail, 0);
  Put16(tail, static_cast<uint16_t>(entries.size()));
  Put16(tail, static_cast<uint16_t>(entries.size()));
  Put32(tail, static_cast<uint32_t>(cd_size));
  Put32(tail, static_cast<uint32_t>(cd_offset));
  Put16(tail, 0);
  out.Write(tail.data(), tail.size());
  return true;
}

}  // namespace fsdp::checkpoint
