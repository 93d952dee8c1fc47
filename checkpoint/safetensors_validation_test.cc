// //checkpoint safetensors files are untrusted input: each crafted header or data section
// below is a c10::Error naming the file, the tensor or metadata key and the bad value
// (safetensors.h lists the checks), and the JSON parser under it (json.h) is strict and
// bounded. Truncations and bit flips of a real file: //fuzz:corrupt_checkpoint_test.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/file_io.h"
#include "checkpoint/json.h"
#include "checkpoint/safetensors.h"
#include "testing/expect_error.h"
#include "testing/test_dir.h"

namespace fsdp::checkpoint::safetensors_validation_test {
namespace {

// A file: the 8-byte length `length` (the header's own by default), `header`, `data`.
std::string CraftedFile(const std::string& header, const std::string& data = "", uint64_t length = UINT64_MAX) {
  if (length == UINT64_MAX) length = header.size();
  std::vector<char> bytes(8);
  std::memcpy(bytes.data(), &length, 8);
  bytes.insert(bytes.end(), header.begin(), header.end());
  bytes.insert(bytes.end(), data.begin(), data.end());
  const std::string path = fsdp::testing::NewTestPath("crafted") + ".safetensors";
  WriteFileAtomically(path, bytes, "test");
  return path;
}

// `header` and `data` are refused with an error naming the file, then `what`.
void ExpectBad(const std::string& header, const std::string& data, const std::string& what,
               uint64_t length = UINT64_MAX) {
  SCOPED_TRACE(header);
  const std::string path = CraftedFile(header, data, length);
  EXPECT_ERROR_CONTAINS((void)SafetensorsReader(path),
                        "SafetensorsReader: '" + path + "' is not a valid safetensors file: " + what);
}

// The JSON of one tensor entry.
std::string Tensor(const std::string& name, const std::string& dtype, const std::string& shape,
                   const std::string& offsets) {
  return absl::StrCat("\"", name, "\":{\"dtype\":", dtype, ",\"shape\":", shape, ",\"data_offsets\":", offsets, "}");
}
std::string F32(const std::string& name, const std::string& shape, const std::string& offsets) {
  return Tensor(name, "\"F32\"", shape, offsets);
}

TEST(SafetensorsValidation, LengthAndFraming) {
  const std::string path = fsdp::testing::NewTestPath("short");
  WriteFileAtomically(path, {'\x10', 0, 0, 0, 0}, "test");
  EXPECT_ERROR_CONTAINS((void)SafetensorsReader(path), "SafetensorsReader: '" + path +
                                                           "' is not a valid safetensors file: it has 5 bytes, fewer "
                                                           "than the 8 of its header length (truncated?)");
  ExpectBad("{}", "", "its header length is 100000001 bytes, more than the 100000000 read", 100000001);
  ExpectBad("{}", "", "its header length is 18446744073709551614 bytes, more than", UINT64_MAX - 1);
  ExpectBad("{}", "", "its header length is 50 bytes but only 2 bytes follow the length (truncated?)", 50);
  ExpectBad("", "", "its header does not start with '{' (it is empty)");
  ExpectBad(" {}", "", "its header does not start with '{' (byte 0x20)");
  ExpectBad("[]", "", "its header does not start with '{' (byte 0x5b)");
  const std::string w = "{" + F32("w", "[1]", "[0,4]") + "}";
  ExpectBad(w + "x", std::string(4, '\0'),
            "its header has byte 0x78 at byte 54, after the JSON (only spaces may pad it)");
  ExpectBad(w + "  \n", std::string(4, '\0'), "its header has byte 0x0a at byte 56");
  ExpectBad(w + " \"", std::string(4, '\0'), "its header has byte 0x22 at byte 55");
  // What is valid: no tensors; whitespace between tokens; padding; metadata only.
  const std::vector<std::pair<std::string, std::string>> valid = {
      {"{}", ""},
      {"{ }    ", ""},
      {R"({"__metadata__":{}})", ""},
      {"{\"w\" :\n\t{\"shape\" :[ 1 ], \"data_offsets\":[0 ,4],\"dtype\":\"F32\"}\r}  ", std::string(4, '\0')},
  };
  for (const auto& [header, data] : valid)
    EXPECT_NO_THROW((void)SafetensorsReader(CraftedFile(header, data))) << header;
}

TEST(SafetensorsValidation, HeaderMustBeStrictJson) {
  const std::string json = "its header is not valid JSON: ";
  ExpectBad(R"({"a":1,})", "", json + "expected a string key, found '}' at byte 7 of the JSON");
  ExpectBad(R"({"a)", "", json + "a string that does not end (truncated?) at byte 1 of the JSON");
  ExpectBad(R"({"a":)", "",
            json + "the JSON ends where a value should start (truncated?) at byte 5 of the JSON (inside 'a')");
  ExpectBad(R"({"a\x":1})", "", json + "invalid escape '\\x' at byte 3");
  ExpectBad(R"({"\ud800":1})", "", json + "a high surrogate escape not followed by a low one at byte 2");
  ExpectBad(R"({"\ud800\u0041":1})", "", json + "a high surrogate escape not followed by a low one at byte 2");
  ExpectBad(R"({"\udc00":1})", "", json + "a low surrogate escape without a high one before it at byte 2");
  ExpectBad(R"({"\u12G4":1})", "", json + "a \\u escape with a non-hex digit 'G' at byte 2");
  ExpectBad(R"({"\u12)", "", json + "a \\u escape cut short (truncated?) at byte 2");
  ExpectBad("{\"a\xff\":1}", "", json + "invalid UTF-8 (byte 0xff) in a string at byte 3");
  ExpectBad("{\"\xc0\x80\":1}", "", json + "invalid UTF-8 (byte 0xc0) in a string at byte 2");      // overlong
  ExpectBad("{\"\xed\xa0\x80\":1}", "", json + "invalid UTF-8 (byte 0xed) in a string at byte 2");  // a surrogate
  ExpectBad("{\"\xf4\x90\x80\x80\":1}", "", json + "invalid UTF-8 (byte 0xf4)");                    // above U+10FFFF
  ExpectBad("{\"\xe2\x82\":1}", "", json + "invalid UTF-8 (byte 0xe2)");                            // cut short
  ExpectBad("{\"a\x01\":1}", "", json + "unescaped control character byte 0x01 in a string at byte 3");
  ExpectBad(
      R"({"w":{"dtype":"F32","shape":[01],"data_offsets":[0,4]}})", "",
      json + "expected ',' or ']' after an array element, found '1' at byte 30 of the JSON (inside 'w' > 'shape')");
  ExpectBad(R"({"w":tru})", "", json + "invalid literal (expected 'true') at byte 5 of the JSON (inside 'w')");
  ExpectBad(R"({"w":-})", "", json + "expected a digit in a number, found '}'");
  ExpectBad(R"({"w":1.})", "", json + "expected a digit after a decimal point, found '}'");
  ExpectBad(R"({"w":1e+})", "", json + "expected a digit in an exponent, found '}'");
  ExpectBad(R"({"w" 1})", "", json + "expected ':' after a key, found '1' at byte 5");
  ExpectBad(R"({"w":{} "v":1})", "", json + "expected ',' or '}' after an object member, found '\"' at byte 8");
  ExpectBad(R"({"w":{"dtype":"F32","shape":[[[[[[[[1]]]]]]]],"data_offsets":[0,4]}})", "",
            json + "arrays and objects nest more than 8 deep at byte 34 of the JSON (inside 'w' > 'shape')");
  const std::string w = F32("w", "[1]", "[0,4]");
  ExpectBad("{" + w + "," + w + "}", std::string(4, '\0'), json + "duplicate key 'w' at byte 54 of the JSON");
  ExpectBad(R"({"__metadata__":{"k":"a","k":"b"}})", "",
            json + "duplicate key 'k' at byte 25 of the JSON (inside '__metadata__')");
  // Escapes that are valid decode to the name.
  const std::string escaped =
      R"({"a\u00e9\ud83d\ude00\n\/\"\\\b\f\r\t\u0000":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  const SafetensorsReader reader(CraftedFile(escaped, "x"));
  ASSERT_EQ(reader.entries().size(), 1u);
  EXPECT_EQ(reader.entries()[0].name, std::string("a\u00e9\U0001F600\n/\"\\\b\f\r\t\0", 16));
}

TEST(SafetensorsValidation, TensorEntries) {
  const std::string four(4, '\0'), eight(8, '\0');
  ExpectBad(R"({"w":[1]})", "", "tensor 'w' is described by an array, not an object");
  ExpectBad(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", four,
            "tensor 'w' has an unknown field 'x' (a tensor has dtype, shape and data_offsets)");
  ExpectBad(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", four, "tensor 'w' has no dtype");
  ExpectBad(R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", four, "tensor 'w' has no shape");
  ExpectBad(R"({"w":{"dtype":"F32","shape":[1]}})", four, "tensor 'w' has no data_offsets");
  ExpectBad("{" + Tensor("w", "32", "[1]", "[0,4]") + "}", four,
            "tensor 'w' has a dtype that is a number, not a string");
  ExpectBad("{" + Tensor("w", "\"F33\"", "[1]", "[0,4]") + "}", four,
            "tensor 'w' has dtype 'F33', which is not a safetensors dtype");
  ExpectBad("{" + Tensor("w", "\"f32\"", "[1]", "[0,4]") + "}", four, "tensor 'w' has dtype 'f32', which is not a");
  ExpectBad("{" + Tensor("w", "\"F4\"", "[2]", "[0,1]") + "}", "x",
            "tensor 'w' has dtype 'F4', which LibTorch has no type for (sub-byte elements)");
  ExpectBad("{" + Tensor("w", "\"F6_E2M3\"", "[4]", "[0,3]") + "}", "xyz",
            "tensor 'w' has dtype 'F6_E2M3', which LibTorch has no type for");
  ExpectBad("{" + F32("w", "\"2\"", "[0,4]") + "}", four, "tensor 'w' has a shape that is a string, not an array");
  ExpectBad("{" + F32("w", "[2,-2]", "[0,4]") + "}", four, "tensor 'w': shape dimension 1 is -2 (negative)");
  ExpectBad("{" + F32("w", "[1.5]", "[0,4]") + "}", four, "tensor 'w': shape dimension 0 is 1.5, not an integer");
  ExpectBad("{" + F32("w", "[1e0]", "[0,4]") + "}", four, "tensor 'w': shape dimension 0 is 1e0, not an integer");
  ExpectBad("{" + F32("w", "[\"1\"]", "[0,4]") + "}", four,
            "tensor 'w': shape dimension 0 is a string, not an integer");
  ExpectBad("{" + F32("w", "[null]", "[0,4]") + "}", four, "tensor 'w': shape dimension 0 is null, not an integer");
  ExpectBad("{" + F32("w", "[99999999999999999999]", "[0,4]") + "}", four,
            "tensor 'w': shape dimension 0 is 99999999999999999999, more than int64 holds");
  std::string dims = "[1";
  for (int i = 0; i < 64; ++i) dims += ",1";
  ExpectBad("{" + F32("w", dims + "]", "[0,4]") + "}", four, "tensor 'w' has 65 dimensions, more than the 64 read");
  ExpectBad("{" + F32("w", "[1099511627776,1099511627776]", "[0,4]") + "}", four,
            "tensor 'w' has shape [1099511627776, 1099511627776], more elements than int64 counts");
  ExpectBad("{" + F32("w", "[0,4611686018427387904,4]", "[0,0]") + "}", "",
            "tensor 'w' has shape [0, 4611686018427387904, 4], more elements than int64 counts");  // even if empty
  ExpectBad("{" + F32("w", "[2305843009213693952]", "[0,4]") + "}", four,
            "tensor 'w' has shape [2305843009213693952], more bytes than int64 counts");
  ExpectBad("{" + F32("w", "[1]", "[0]") + "}", four, "tensor 'w' has data_offsets of 1 values, not [begin, end]");
  ExpectBad("{" + F32("w", "[1]", "{}") + "}", four,
            "tensor 'w' has data_offsets that are an object, not [begin, end]");
  ExpectBad("{" + F32("w", "[1]", "[-1,4]") + "}", four, "tensor 'w': data_offsets[0] is -1 (negative)");
  ExpectBad("{" + F32("w", "[1]", "[0,4.0]") + "}", four, "tensor 'w': data_offsets[1] is 4.0, not an integer");
  ExpectBad("{" + F32("w", "[0]", "[8,4]") + "}", eight,
            "tensor 'w' has data_offsets [8, 4]: the end is before the beginning");
  ExpectBad("{" + F32("w", "[2]", "[0,4]") + "}", four,
            "tensor 'w' of dtype F32 and shape [2] has 8 bytes, but its data_offsets [0, 4] span 4");
  ExpectBad("{" + F32("w", "[2]", "[0,8]") + "}", four,
            "tensor 'w' has data_offsets [0, 8] but the data section has only 4 bytes (truncated?)");
  const std::string long_name(300, 'x');
  ExpectBad("{" + Tensor(long_name, "\"Q\"", "[1]", "[0,4]") + "}", four,
            "tensor '" + long_name.substr(0, 200) + "...' (300 bytes) has dtype 'Q'");
}

TEST(SafetensorsValidation, TensorsTileTheDataSection) {
  ExpectBad("{" + F32("a", "[2]", "[0,8]") + "," + F32("b", "[2]", "[4,12]") + "}", std::string(12, '\0'),
            "tensor 'b' at data_offsets [4, 12] overlaps tensor 'a' at [0, 8]");
  ExpectBad("{" + F32("a", "[2]", "[0,8]") + "," + F32("b", "[2]", "[0,8]") + "}", std::string(8, '\0'),
            "tensor 'b' at data_offsets [0, 8] overlaps tensor 'a' at [0, 8]");
  ExpectBad("{" + F32("a", "[2]", "[0,8]") + "," + F32("e", "[0]", "[4,4]") + "}", std::string(8, '\0'),
            "tensor 'e' at data_offsets [4, 4] overlaps tensor 'a' at [0, 8]");
  ExpectBad("{" + F32("b", "[1]", "[8,12]") + "," + F32("a", "[1]", "[0,4]") + "}", std::string(12, '\0'),
            "bytes [4, 8) of the data section belong to no tensor (the gap before tensor 'b')");
  ExpectBad("{" + F32("a", "[1]", "[0,4]") + "}", std::string(8, '\0'),
            "its data section has 8 bytes but its tensors end at byte 4 (bytes [4, 8) belong to no tensor)");
  ExpectBad("{}", "data", "its data section has 4 bytes but its tensors end at byte 0");
  // In any order in the header; empty tensors anywhere between the others.
  const SafetensorsReader ok(CraftedFile(
      "{" + F32("b", "[1]", "[4,8]") + "," + F32("e", "[0,2]", "[4,4]") + "," + F32("a", "[1]", "[0,4]") + "}",
      std::string(8, '\1')));
  EXPECT_EQ(ok.entries().size(), 3u);
}

TEST(SafetensorsValidation, MetadataAndBoolValues) {
  ExpectBad(R"({"__metadata__":[]})", "", "its __metadata__ is an array, not an object of strings");
  ExpectBad(R"({"__metadata__":{"k":1}})", "", "its __metadata__ 'k' is a number, not a string");
  ExpectBad(R"({"__metadata__":{"k":{"n":"v"}}})", "", "its __metadata__ 'k' is an object, not a string");
  // A bool is 0 or 1: checked in what is read (rows 2 and 3 read; all of it does not).
  const std::string path =
      CraftedFile(R"({"flags":{"dtype":"BOOL","shape":[4],"data_offsets":[0,4]}})", std::string("\x01\x02\x00\x01", 4));
  const SafetensorsReader reader(path);
  EXPECT_TRUE(at::equal(reader.ReadRows("flags", 2, 4), at::tensor({0, 1}).to(at::kBool)));
  EXPECT_ERROR_CONTAINS(reader.Read("flags"), "SafetensorsReader::Read: '" + path +
                                                  "' is not a valid safetensors file: BOOL tensor 'flags' holds byte "
                                                  "2 at element 1 (a bool is 0 or 1)");
  at::Tensor dest = at::zeros({4}, at::kFloat);
  EXPECT_ERROR_CONTAINS(reader.ReadInto("flags", dest), "BOOL tensor 'flags' holds byte 2 at element 1");
  char raw[4];
  reader.ReadBytes("flags", 0, 4, raw);  // raw bytes, as they are
  EXPECT_EQ(raw[1], 2);
}

// ------------------------------------------------------------------ the JSON parser
using internal::JsonLimits;
using internal::JsonValue;

// The value `json` holds, followed by `trailing` bytes that ParseJson leaves to the caller.
JsonValue Parse(const std::string& json, const JsonLimits& limits = {}, size_t trailing = 0) {
  size_t end = 0;
  JsonValue v = internal::ParseJson(json, limits, "test", &end);
  EXPECT_EQ(end, json.size() - trailing) << json;
  return v;
}

TEST(SafetensorsJson, LimitsBoundDepthValuesMembersAndStrings) {
  JsonLimits small;
  small.max_depth = 3;
  small.max_values = 5;
  small.max_members = 3;
  small.max_string_bytes = 4;
  EXPECT_NO_THROW(Parse("[[[1]]]", small));
  EXPECT_ERROR_CONTAINS(Parse("[[[[1]]]]", small), "test: arrays and objects nest more than 3 deep at byte 3");
  EXPECT_ERROR_CONTAINS(Parse("[[1,2],[3]]", small), "test: more than 5 values in the JSON");
  EXPECT_ERROR_CONTAINS(Parse("[1,2,3,4]", small), "test: an array with more than 3 elements at byte 7");
  EXPECT_ERROR_CONTAINS(Parse(R"({"a":1,"b":2,"c":3,"d":4})", small), "an object with more than 3 members at byte 19");
  EXPECT_NO_THROW(Parse(R"("abcd")", small));
  EXPECT_ERROR_CONTAINS(Parse(R"("abcde")", small), "test: a string longer than 4 bytes at byte 0");
  EXPECT_ERROR_CONTAINS(Parse("12345", small), "test: a number longer than 4 bytes at byte 0");
  // Depth costs no stack: a deep document is refused at the limit, not by a crash.
  EXPECT_ERROR_CONTAINS(Parse(std::string(1000000, '[')), "nest more than 64 deep");
}

TEST(SafetensorsJson, ValuesAndTheirText) {
  const JsonValue v = Parse(R"( {"n":-1.5e+3, "t":true, "f":false, "z":null, "a":[0, "x"], "o":{}}  )", {}, 2);
  ASSERT_EQ(v.kind, JsonValue::Kind::kObject);
  ASSERT_EQ(v.members.size(), 6u);
  EXPECT_EQ(v.members[0].value.text, "-1.5e+3");
  EXPECT_EQ(v.members[0].value.offset, 6u);
  EXPECT_TRUE(v.members[1].value.boolean);
  EXPECT_EQ(v.members[2].value.kind, JsonValue::Kind::kBool);
  EXPECT_FALSE(v.members[2].value.boolean);
  EXPECT_EQ(v.members[3].value.kind, JsonValue::Kind::kNull);
  EXPECT_EQ(v.members[4].value.items.size(), 2u);
  EXPECT_EQ(v.members[4].value.items[1].text, "x");
  EXPECT_EQ(v.members[5].value.kind, JsonValue::Kind::kObject);
}

TEST(SafetensorsJson, EscapingRoundTripsAsSerdeJsonWritesIt) {
  auto escaped = [](const std::string& s) {
    std::string out;
    internal::AppendJsonString(s, &out);
    return out;
  };
  EXPECT_EQ(escaped(std::string("\x01\x1f\b\f\n\r\t\"\\/\x7f", 11)), R"("\u0001\u001f\b\f\n\r\t\"\\/)"
                                                                     "\x7f\"");
  EXPECT_EQ(escaped(std::string("\0", 1)), R"("\u0000")");
  EXPECT_EQ(escaped("\u00e9\U0001F600"), "\"\u00e9\U0001F600\"");
  std::string all;
  for (int c = 0; c < 0x80; ++c) all.push_back(static_cast<char>(c));
  all += "\u00e9\u2028\U0001F600\U0010FFFF";
  EXPECT_EQ(Parse(escaped(all)).text, all);
  EXPECT_EQ(internal::InvalidUtf8Offset(all), std::string::npos);
  EXPECT_EQ(internal::InvalidUtf8Offset("ab\xc3"), 2u);
  EXPECT_EQ(internal::InvalidUtf8Offset("\xf5\x80\x80\x80"), 0u);
}

}  // namespace
}  // namespace fsdp::checkpoint::safetensors_validation_test
