// A strict JSON (RFC 8259) parser for untrusted bytes, and the string escaping JSON writers
// need: what the safetensors header (safetensors.h) is made of. Internal to //checkpoint.
//
// ParseJson reads one value into a tree, with limits that bound its time, stack and memory:
// nesting depth, values in the document, members of one object or array, bytes of one
// string. Strict: UTF-8 is validated (no overlong forms, no surrogates, nothing above
// U+10FFFF), control characters must be escaped, \uXXXX escapes must pair their surrogates,
// numbers follow the grammar (no leading zeros, no '+', no NaN), and an object may not
// repeat a key. Every error is a c10::Error: "<what>: <problem> at byte <n> of the JSON",
// followed, when the error is inside an object, by the keys leading to it
// (" (inside 'w' > 'shape')").
//
// Thread-safety: none needed (pure functions).
#ifndef FSDP_CHECKPOINT_JSON_H_
#define FSDP_CHECKPOINT_JSON_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp::checkpoint::internal {

struct JsonLimits {
  int max_depth = 64;                           // arrays and objects nested in each other
  int64_t max_values = int64_t{1} << 23;        // values in the whole document
  int64_t max_members = int64_t{1} << 20;       // members of one object, or elements of one array
  int64_t max_string_bytes = int64_t{1} << 24;  // of one string (key or value), decoded
};

struct JsonMember;

struct JsonValue {
  enum class Kind : uint8_t { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool boolean = false;
  uint64_t offset = 0;              // of the value's first byte in the document, for callers' errors
  std::string text;                 // kString: the decoded UTF-8; kNumber: the literal as written
  std::vector<JsonValue> items;     // kArray
  std::vector<JsonMember> members;  // kObject: document order, keys unique
};

struct JsonMember {
  std::string key;
  JsonValue value;
};

// "null", "a bool", "a number", "a string", "an array", "an object": for error messages.
const char* JsonKindName(JsonValue::Kind kind);

// Parses the value that starts `json` (after optional whitespace). `*end` is set to the byte
// after the value; what follows it is the caller's to check (nothing is read past the value
// and its trailing whitespace is not skipped).
JsonValue ParseJson(std::string_view json, const JsonLimits& limits, const std::string& what, size_t* end);

// Appends `s` (valid UTF-8) as a JSON string, quoted, escaped as serde_json (Rust) escapes:
// '"' and '\\' with a backslash, \b \t \n \f \r, other bytes below 0x20 as \u00xx (lower-case
// hex), everything else as it is. (Python's safetensors writes its header with serde_json.)
void AppendJsonString(std::string_view s, std::string* out);

// The offset of the first byte of `s` that is not part of valid UTF-8 (as ParseJson accepts
// it), or std::string_view::npos when all of it is.
size_t InvalidUtf8Offset(std::string_view s);

}  // namespace fsdp::checkpoint::internal

#endif  // FSDP_CHECKPOINT_JSON_H_
