// PickleWriter: the subset of Python's pickle protocol 2 the flight recorder's dump needs
// (dicts, lists, 2-tuples, str, int, bool, None), as PyTorch's C++ pickler writes it for the
// same dump (torch/csrc/distributed/c10d/FlightRecorderDetail.hpp): pickle.load reads it.
//
// Contract: calls nest (Begin/End pairs match, a dict alternates key and value); Finish()
// once, last. Not thread-safe.
#ifndef FSDP_COMM_INTERNAL_PICKLE_WRITER_H_
#define FSDP_COMM_INTERNAL_PICKLE_WRITER_H_

#include <cstdint>
#include <string>
#include <string_view>

namespace fsdp::comm::internal {

class PickleWriter {
 public:
  PickleWriter() { out_.append("\x80\x02", 2); }  // PROTO 2

  void BeginDict() { out_.append("}(", 2); }  // EMPTY_DICT MARK
  void EndDict() { out_.push_back('u'); }     // SETITEMS
  void BeginList() { out_.append("](", 2); }  // EMPTY_LIST MARK
  void EndList() { out_.push_back('e'); }     // APPENDS

  void String(std::string_view s) {
    out_.push_back('X');  // BINUNICODE: 4-byte little-endian length, UTF-8 bytes
    AppendLittleEndian(static_cast<uint64_t>(s.size()), 4);
    out_.append(s);
  }
  void Int(int64_t v) {
    if (v >= INT32_MIN && v <= INT32_MAX) {
      out_.push_back('J');  // BININT: 4-byte signed little-endian
      AppendLittleEndian(static_cast<uint64_t>(static_cast<uint32_t>(static_cast<int32_t>(v))), 4);
      return;
    }
    out_.append("\x8a\x08", 2);  // LONG1, 8 bytes two's complement little-endian
    AppendLittleEndian(static_cast<uint64_t>(v), 8);
  }
  void Bool(bool v) { out_.push_back(v ? '\x88' : '\x89'); }  // NEWTRUE / NEWFALSE
  void None() { out_.push_back('N'); }
  void Tuple2(std::string_view a, std::string_view b) {
    String(a);
    String(b);
    out_.push_back('\x86');  // TUPLE2
  }

  std::string Finish() {
    out_.push_back('.');  // STOP
    return std::move(out_);
  }

 private:
  void AppendLittleEndian(uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string out_;
};

}  // namespace fsdp::comm::internal

#endif  // FSDP_COMM_INTERNAL_PICKLE_WRITER_H_
