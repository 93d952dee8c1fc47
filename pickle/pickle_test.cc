// The pickle layer on its own: Python's bytes read as pickle.loads reads them, the writer read
// back, and untrusted bytes (truncations, cycles, depth, protocols, code) as errors that start
// with the caller's prefix. The formats on top have their own tests (checkpoint/, tests/).
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pickle/opcodes.h"
#include "pickle/pickle_machine.h"
#include "pickle/pickler.h"
#include "pickle/py_value.h"
#include "testing/expect_error.h"

namespace fsdp::pickle {
namespace {

using Kind = PyValue::Kind;

// Python's repr() of the plain values read, to compare with what Python printed.
std::string Repr(const PyValue& v) {
  switch (v.kind) {
    case Kind::kNone: return "None";
    case Kind::kBool: return v.b ? "True" : "False";
    case Kind::kInt: return absl::StrCat(v.i);
    case Kind::kFloat: return absl::StrCat(v.f);
    case Kind::kStr: return absl::StrCat("'", v.str, "'");
    case Kind::kTuple:
    case Kind::kList: {
      std::vector<std::string> items;
      for (const PyRef& item : v.items) items.push_back(Repr(*item));
      const bool tuple = v.kind == Kind::kTuple;
      return absl::StrCat(tuple ? "(" : "[", absl::StrJoin(items, ", "), tuple && items.size() == 1 ? "," : "",
                          tuple ? ")" : "]");
    }
    case Kind::kDict: {
      std::vector<std::string> items;
      for (size_t k = 0; k < v.items.size(); k += 2) {
        items.push_back(absl::StrCat(Repr(*v.items[k]), ": ", Repr(*v.items[k + 1])));
      }
      return absl::StrCat("{", absl::StrJoin(items, ", "), "}");
    }
    default: return Describe(v.kind);
  }
}

// Python 3's repr(obj) and pickle.dumps(obj, protocol=2 / 4) of
//   obj = {"version": "2.10", "ints": [0, 255, 256, 65535, 65536, -1, 2**31 - 1, -2**31, 2**31,
//          -2**63, 2**63 - 1], "pair": ("a\u00e9\u4e2d", "b"), "f": 1.5, "n": None, "t": True,
//          "nested": [[1], {"k": []}]}
// (protocol 5's bytes are protocol 4's with 5 in PROTO: nothing here needs its new opcodes).
constexpr std::string_view kPythonRepr =
    "{'version': '2.10', 'ints': [0, 255, 256, 65535, 65536, -1, 2147483647, -2147483648, 2147483648, "
    "-9223372036854775808, 9223372036854775807], 'pair': ('a\xc3\xa9\xe4\xb8\xad', 'b'), 'f': 1.5, 'n': None, "
    "'t': True, 'nested': [[1], {'k': []}]}";
const std::string kPython2(
    "\x80\x02\x7d\x71\x00\x28\x58\x07\x00\x00\x00\x76\x65\x72\x73\x69\x6f\x6e\x71\x01\x58\x04\x00\x00\x00\x32\x2e\x31"
    "\x30\x71\x02\x58\x04\x00\x00\x00\x69\x6e\x74\x73\x71\x03\x5d\x71\x04\x28\x4b\x00\x4b\xff\x4d\x00\x01\x4d\xff\xff"
    "\x4a\x00\x00\x01\x00\x4a\xff\xff\xff\xff\x4a\xff\xff\xff\x7f\x4a\x00\x00\x00\x80\x8a\x05\x00\x00\x00\x80\x00\x8a"
    "\x08\x00\x00\x00\x00\x00\x00\x00\x80\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f\x65\x58\x04\x00\x00\x00\x70\x61\x69"
    "\x72\x71\x05\x58\x06\x00\x00\x00\x61\xc3\xa9\xe4\xb8\xad\x71\x06\x58\x01\x00\x00\x00\x62\x71\x07\x86\x71\x08\x58"
    "\x01\x00\x00\x00\x66\x71\x09\x47\x3f\xf8\x00\x00\x00\x00\x00\x00\x58\x01\x00\x00\x00\x6e\x71\x0a\x4e\x58\x01\x00"
    "\x00\x00\x74\x71\x0b\x88\x58\x06\x00\x00\x00\x6e\x65\x73\x74\x65\x64\x71\x0c\x5d\x71\x0d\x28\x5d\x71\x0e\x4b\x01"
    "\x61\x7d\x71\x0f\x58\x01\x00\x00\x00\x6b\x71\x10\x5d\x71\x11\x73\x65\x75\x2e",
    215);
const std::string kPython4(
    "\x80\x04\x95\xa2\x00\x00\x00\x00\x00\x00\x00\x7d\x94\x28\x8c\x07\x76\x65\x72\x73\x69\x6f\x6e\x94\x8c\x04\x32\x2e"
    "\x31\x30\x94\x8c\x04\x69\x6e\x74\x73\x94\x5d\x94\x28\x4b\x00\x4b\xff\x4d\x00\x01\x4d\xff\xff\x4a\x00\x00\x01\x00"
    "\x4a\xff\xff\xff\xff\x4a\xff\xff\xff\x7f\x4a\x00\x00\x00\x80\x8a\x05\x00\x00\x00\x80\x00\x8a\x08\x00\x00\x00\x00"
    "\x00\x00\x00\x80\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f\x65\x8c\x04\x70\x61\x69\x72\x94\x8c\x06\x61\xc3\xa9\xe4"
    "\xb8\xad\x94\x8c\x01\x62\x94\x86\x94\x8c\x01\x66\x94\x47\x3f\xf8\x00\x00\x00\x00\x00\x00\x8c\x01\x6e\x94\x4e\x8c"
    "\x01\x74\x94\x88\x8c\x06\x6e\x65\x73\x74\x65\x64\x94\x5d\x94\x28\x5d\x94\x4b\x01\x61\x7d\x94\x8c\x01\x6b\x94\x5d"
    "\x94\x73\x65\x75\x2e",
    173);

TEST(PlainData, ReadsPythonsProtocols2To5AsPickleLoads) {
  EXPECT_EQ(Repr(*UnpicklePlainData(kPython2, "p2: ")), kPythonRepr);
  EXPECT_EQ(Repr(*UnpicklePlainData(kPython4, "p4: ")), kPythonRepr);
  std::string p5 = kPython4;
  p5[1] = 5;
  EXPECT_EQ(Repr(*UnpicklePlainData(p5, "p5: ")), kPythonRepr);
  // pickle.loads ignores what follows STOP.
  EXPECT_EQ(Repr(*UnpicklePlainData(kPython2 + "trailing", "p2: ")), kPythonRepr);
}

// The writer's bytes for the same value, read back; and the opcodes of the pickle spec
// (Python's Lib/pickle.py) for single values, written out by hand.
TEST(Pickler, WritesWhatTheReaderAndThePickleSpecAgreeOn) {
  Pickler p("writer test");
  p.EmptyDict();
  p.Mark();
  p.Str("version");
  p.Str("2.10");
  p.Str("ints");
  p.EmptyList();
  p.Mark();
  for (int64_t v : {int64_t{0}, int64_t{255}, int64_t{256}, int64_t{65535}, int64_t{65536}, int64_t{-1},
                    int64_t{INT32_MAX}, int64_t{INT32_MIN}, int64_t{1} << 31, INT64_MIN, INT64_MAX}) {
    p.Int(v);
  }
  p.Appends();
  p.Str("pair");
  p.Str("a\xc3\xa9\xe4\xb8\xad");
  p.Str("b");
  p.Tuple2();
  p.Str("f");
  p.Float(1.5);
  p.Str("n");
  p.None();
  p.Str("t");
  p.Bool(true);
  p.Str("nested");
  p.EmptyList();
  p.Mark();
  p.Mark();
  p.Int(1);
  p.Tuple();  // a tuple where Python has a list: shows Tuple() against Mark
  p.EmptyDict();
  p.Mark();
  p.Str("k");
  p.EmptyList();
  p.SetItems();
  p.Appends();
  p.SetItems();
  const std::vector<char> bytes = p.Finish();
  std::string expected(kPythonRepr);
  expected.replace(expected.find("[[1]"), 4, "[(1,)");
  EXPECT_EQ(Repr(*UnpicklePlainData(std::string_view(bytes.data(), bytes.size()), "round trip: ")), expected);

  auto one = [](auto write) {
    Pickler q("one");
    write(q);
    const std::vector<char> b = q.Finish();
    return std::string(b.begin(), b.end());
  };
  EXPECT_EQ(one([](Pickler& q) { q.Int(7); }), std::string("\x80\x02K\x07.", 5));                       // BININT1
  EXPECT_EQ(one([](Pickler& q) { q.Int(-2); }), std::string("\x80\x02J\xfe\xff\xff\xff.", 8));          // BININT
  EXPECT_EQ(one([](Pickler& q) { q.Str("hi"); }), std::string("\x80\x02X\x02\x00\x00\x00hi.", 10));     // BINUNICODE
  EXPECT_EQ(one([](Pickler& q) { q.Float(1.0); }), std::string("\x80\x02G\x3f\xf0\0\0\0\0\0\0.", 12));  // big-endian
  EXPECT_EQ(one([](Pickler& q) {
              q.Global("m", "n");
              q.Global("m", "n");
            }),
            std::string("\x80\x02"
                        "cm\nn\nq\x00"
                        "h\x00.",
                        12));
}

TEST(Pickler, RefusesAStrPythonCouldNotRead) {
  Pickler p("my writer");
  EXPECT_ERROR_CONTAINS(p.Str("bad \xff byte"), "my writer: the str 'bad");
  EXPECT_TRUE(IsUtf8("\xed\xa0\x80"));       // a surrogate: Python's pickle reads it ('surrogatepass')
  EXPECT_FALSE(IsUtf8("\xc0\x80"));          // an overlong NUL
  EXPECT_FALSE(IsUtf8("\xf4\x90\x80\x80"));  // above U+10FFFF
}

// Every cut of a valid pickle is an error that names the caller's source; no prefix crashes.
TEST(PlainData, EveryTruncationIsAnErrorWithTheCallersPrefix) {
  for (size_t n = 0; n < kPython2.size(); ++n) {
    EXPECT_ERROR_CONTAINS(UnpicklePlainData(std::string_view(kPython2).substr(0, n), "cut.pkl: "), "cut.pkl: ");
  }
}

TEST(PlainData, RefusesWhatPickleLoadWouldRunOrCannotBuild) {
  // Code: GLOBAL os.system, REDUCE, BUILD; a persistent id.
  EXPECT_ERROR_CONTAINS(UnpicklePlainData("\x80\x02"
                                          "cos\nsystem\n.",
                                          "g: "),
                        "g: byte 2: unsupported pickle opcode 0x63");
  EXPECT_ERROR_CONTAINS(UnpicklePlainData("\x80\x02N)R.", "r: "), "r: byte 4: unsupported pickle opcode 0x52");
  EXPECT_ERROR_CONTAINS(UnpicklePlainData("\x80\x02NNb.", "b: "), "b: byte 4: unsupported pickle opcode 0x62");
  EXPECT_ERROR_CONTAINS(UnpicklePlainData("\x80\x02NQ.", "q: "), "q: byte 3: unsupported pickle opcode 0x51");
  // Protocols: 2 to 5, and nothing without PROTO.
  EXPECT_ERROR_CONTAINS(UnpicklePlainData("\x80\x01N.", "v1: "), "pickle protocol 1 (2 to 5 are read)");
  EXPECT_ERROR_CONTAINS(UnpicklePlainData("\x80\x06N.", "v6: "), "pickle protocol 6 (2 to 5 are read)");
  EXPECT_ERROR_CONTAINS(UnpicklePlainData("N.", "none: "), "does not start with a pickle PROTO opcode");
  // A list holding itself (BINPUT 0, BINGET 0, APPEND), and one put into another, then changed.
  EXPECT_ERROR_CONTAINS(UnpicklePlainData(std::string("\x80\x02]q\x00h\x00"
                                                      "a.",
                                                      9),
                                          "cycle: "),
                        "cycle: byte 7: the pickle puts a value into itself");
  EXPECT_ERROR_CONTAINS(UnpicklePlainData(std::string("\x80\x02]q\x00]h\x00"
                                                      "ah\x00N"
                                                      "a.",
                                                      14),
                                          "late: "),
                        "modifies a value after putting it into another");
  // Values nest at most kMaxPickleDepth deep: 65 lists, one in the next.
  std::string deep = "\x80\x02";
  for (int k = 0; k <= kMaxPickleDepth; ++k) deep += "](";
  for (int k = 0; k <= kMaxPickleDepth; ++k) deep += "e";
  deep += ".";
  EXPECT_ERROR_CONTAINS(UnpicklePlainData(deep, "deep: "), "values nest 65 deep, more than 64");
  // A dict key Python cannot hash, a str that is not UTF-8, an operand past the end.
  EXPECT_ERROR_CONTAINS(UnpicklePlainData("\x80\x02}]Ns.", "key: "), "key: byte 5: a dict key is a list or dict");
  EXPECT_ERROR_CONTAINS(UnpicklePlainData(std::string("\x80\x02X\x01\x00\x00\x00\xff.", 9), "utf8: "),
                        "a str is not valid UTF-8");
  EXPECT_ERROR_CONTAINS(UnpicklePlainData(std::string("\x80\x02X\xff\xff\xff\xff", 7), "long: "),
                        "an operand of 4294967295 bytes runs past the end");
}

}  // namespace
}  // namespace fsdp::pickle
