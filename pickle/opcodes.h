// Python's pickle opcodes, as the reader (pickle_machine.h) and the writer (pickler.h) of
// this package name them, and the one rule on str both apply: UTF-8, as Python decodes it.
//
// Thread-safety: constants and a pure function.
#ifndef FSDP_PICKLE_OPCODES_H_
#define FSDP_PICKLE_OPCODES_H_

#include <cstdint>
#include <string_view>

namespace fsdp::pickle {

// The opcodes read or written, by their names in Python's Lib/pickle.py.
namespace op {
inline constexpr uint8_t kMark = '(', kStop = '.', kBinFloat = 'G', kBinInt = 'J', kBinInt1 = 'K', kBinInt2 = 'M',
                         kNone = 'N', kBinPersId = 'Q', kReduce = 'R', kBinUnicode = 'X', kEmptyList = ']',
                         kAppend = 'a', kBuild = 'b', kGlobal = 'c', kDict = 'd', kEmptyDict = '}', kAppends = 'e',
                         kBinGet = 'h', kLongBinGet = 'j', kList = 'l', kBinPut = 'q', kLongBinPut = 'r',
                         kSetItem = 's', kTuple = 't', kEmptyTuple = ')', kSetItems = 'u';
// Protocol 2.
inline constexpr uint8_t kProto = 0x80, kNewObj = 0x81, kTuple1 = 0x85, kTuple2 = 0x86, kTuple3 = 0x87, kNewTrue = 0x88,
                         kNewFalse = 0x89, kLong1 = 0x8a;
// Protocol 4.
inline constexpr uint8_t kShortBinUnicode = 0x8c, kBinUnicode8 = 0x8d, kStackGlobal = 0x93, kMemoize = 0x94,
                         kFrame = 0x95;
}  // namespace op

// Whether `s` is UTF-8 as Python's pickle decodes str (surrogates allowed: 'surrogatepass').
bool IsUtf8(std::string_view s);

}  // namespace fsdp::pickle

#endif  // FSDP_PICKLE_OPCODES_H_
