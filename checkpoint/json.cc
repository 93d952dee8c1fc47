#include "checkpoint/json.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <utility>

namespace fsdp::checkpoint::internal {
namespace {

// The length of the valid UTF-8 sequence at s[i], or 0 (RFC 3629's table: no overlong
// forms, no UTF-16 surrogates, nothing above U+10FFFF).
size_t Utf8Length(std::string_view s, size_t i) {
  auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = byte(i);
  if (c < 0x80) return 1;
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > s.size() || byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
  }
  return n;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// A byte for an error message: 'x' when printable ASCII, else its hex value.
std::string ByteName(unsigned char c) {
  char buffer[16];
  if (c >= 0x20 && c < 0x7F) {
    std::snprintf(buffer, sizeof(buffer), "'%c'", c);
  } else {
    std::snprintf(buffer, sizeof(buffer), "byte 0x%02x", c);
  }
  return buffer;
}

// A key for an error message, cut short (a key may be megabytes long).
std::string ShortKey(const std::string& key) {
  constexpr size_t kMax = 64;
  if (key.size() <= kMax) return key;
  size_t n = kMax;
  while (n > 0 && (static_cast<unsigned char>(key[n]) & 0xC0) == 0x80) --n;  // not inside a character
  return key.substr(0, n) + "...";
}

class JsonParser {
 public:
  JsonParser(std::string_view json, const JsonLimits& limits, const std::string& what)
      : s_(json), limits_(limits), what_(what) {}

  JsonValue Parse(size_t* end) {
    SkipWhitespace();
    JsonValue v = Value(0);
    *end = pos_;
    return v;
  }

 private:
  [[noreturn]] void Fail(size_t at, const std::string& problem) const {
    std::string where;
    for (size_t i = 0; i < path_.size(); ++i) where += (i == 0 ? " (inside '" : " > '") + ShortKey(path_[i]) + "'";
    if (!where.empty()) where += ")";
    TORCH_CHECK(false, what_, ": ", problem, " at byte ", at, " of the JSON", where);
  }
  bool AtEnd() const { return pos_ >= s_.size(); }
  unsigned char Peek() const { return static_cast<unsigned char>(s_[pos_]); }
  void SkipWhitespace() {
    while (!AtEnd() && (Peek() == ' ' || Peek() == '\t' || Peek() == '\n' || Peek() == '\r')) ++pos_;
  }
  std::string Found() const { return AtEnd() ? "the end of the JSON (truncated?)" : ByteName(Peek()); }

  JsonValue Value(int depth) {
    TORCH_CHECK(++values_ <= limits_.max_values, what_, ": more than ", limits_.max_values, " values in the JSON");
    if (AtEnd()) Fail(pos_, "the JSON ends where a value should start (truncated?)");
    JsonValue v;
    v.offset = pos_;
    const unsigned char c = Peek();
    if (c == '{' || c == '[') {
      if (depth + 1 > limits_.max_depth) {
        Fail(pos_, "arrays and objects nest more than " + std::to_string(limits_.max_depth) + " deep");
      }
      c == '{' ? Object(depth + 1, &v) : Array(depth + 1, &v);
    } else if (c == '"') {
      v.kind = JsonValue::Kind::kString;
      String(&v.text);
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      Number(&v);
    } else if (c == 't' || c == 'f' || c == 'n') {
      const std::string_view word = c == 't' ? "true" : c == 'f' ? "false" : "null";
      if (s_.substr(pos_, word.size()) != word) Fail(pos_, "invalid literal (expected '" + std::string(word) + "')");
      pos_ += word.size();
      v.kind = c == 'n' ? JsonValue::Kind::kNull : JsonValue::Kind::kBool;
      v.boolean = c == 't';
    } else {
      Fail(pos_, "expected a value, found " + ByteName(c));
    }
    return v;
  }

  void Object(int depth, JsonValue* v) {
    v->kind = JsonValue::Kind::kObject;
    ++pos_;
    std::vector<size_t> key_offsets;
    SkipWhitespace();
    if (!AtEnd() && Peek() == '}') {
      ++pos_;
      return;
    }
    for (;;) {
      SkipWhitespace();
      if (AtEnd() || Peek() != '"') Fail(pos_, "expected a string key, found " + Found());
      if (static_cast<int64_t>(v->members.size()) >= limits_.max_members) {
        Fail(pos_, "an object with more than " + std::to_string(limits_.max_members) + " members");
      }
      key_offsets.push_back(pos_);
      std::string key;
      String(&key);
      SkipWhitespace();
      if (AtEnd() || Peek() != ':') Fail(pos_, "expected ':' after a key, found " + Found());
      ++pos_;
      SkipWhitespace();
      path_.push_back(key);
      JsonValue value = Value(depth);
      path_.pop_back();
      v->members.push_back({std::move(key), std::move(value)});
      SkipWhitespace();
      if (!AtEnd() && Peek() == ',') {
        ++pos_;
      } else if (!AtEnd() && Peek() == '}') {
        ++pos_;
        break;
      } else {
        Fail(pos_, "expected ',' or '}' after an object member, found " + Found());
      }
    }
    // Duplicate keys: Python's reader keeps the last, another reader may keep the first.
    std::vector<size_t> order(v->members.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const int c = v->members[a].key.compare(v->members[b].key);
      return c != 0 ? c < 0 : a < b;
    });
    for (size_t i = 1; i < order.size(); ++i) {
      if (v->members[order[i]].key == v->members[order[i - 1]].key) {
        Fail(key_offsets[order[i]], "duplicate key '" + ShortKey(v->members[order[i]].key) + "'");
      }
    }
  }

  void Array(int depth, JsonValue* v) {
    v->kind = JsonValue::Kind::kArray;
    ++pos_;
    SkipWhitespace();
    if (!AtEnd() && Peek() == ']') {
      ++pos_;
      return;
    }
    for (;;) {
      SkipWhitespace();
      if (static_cast<int64_t>(v->items.size()) >= limits_.max_members) {
        Fail(pos_, "an array with more than " + std::to_string(limits_.max_members) + " elements");
      }
      v->items.push_back(Value(depth));
      SkipWhitespace();
      if (!AtEnd() && Peek() == ',') {
        ++pos_;
      } else if (!AtEnd() && Peek() == ']') {
        ++pos_;
        break;
      } else {
        Fail(pos_, "expected ',' or ']' after an array element, found " + Found());
      }
    }
  }

  void String(std::string* out) {
    const size_t start = pos_++;
    for (;;) {
      if (AtEnd()) Fail(start, "a string that does not end (truncated?)");
      const unsigned char c = Peek();
      if (c == '"') {
        ++pos_;
        return;
      }
      if (c == '\\') {
        Escape(out);
      } else if (c < 0x20) {
        Fail(pos_, "unescaped control character " + ByteName(c) + " in a string");
      } else {
        const size_t n = Utf8Length(s_, pos_);
        if (n == 0) Fail(pos_, "invalid UTF-8 (" + ByteName(c) + ") in a string");
        out->append(s_.data() + pos_, n);
        pos_ += n;
      }
      if (static_cast<int64_t>(out->size()) > limits_.max_string_bytes) {
        Fail(start, "a string longer than " + std::to_string(limits_.max_string_bytes) + " bytes");
      }
    }
  }

  void Escape(std::string* out) {
    const size_t at = pos_++;
    if (AtEnd()) Fail(at, "a string that ends inside an escape (truncated?)");
    const char e = s_[pos_++];
    switch (e) {
      case '"': out->push_back('"'); return;
      case '\\': out->push_back('\\'); return;
      case '/': out->push_back('/'); return;
      case 'b': out->push_back('\b'); return;
      case 'f': out->push_back('\f'); return;
      case 'n': out->push_back('\n'); return;
      case 'r': out->push_back('\r'); return;
      case 't': out->push_back('\t'); return;
      case 'u': break;
      default: Fail(at, "invalid escape '\\" + std::string(1, e) + "'");
    }
    uint32_t cp = Hex4(at);
    if (cp >= 0xDC00 && cp <= 0xDFFF) Fail(at, "a low surrogate escape without a high one before it");
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      if (s_.substr(pos_, 2) != "\\u") Fail(at, "a high surrogate escape not followed by a low one");
      pos_ += 2;
      const uint32_t low = Hex4(pos_ - 2);
      if (low < 0xDC00 || low > 0xDFFF) Fail(at, "a high surrogate escape not followed by a low one");
      cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
    }
    AppendUtf8(cp, out);
  }

  // The 4 hex digits at pos_ (of the \u escape at `at`).
  uint32_t Hex4(size_t at) {
    if (pos_ + 4 > s_.size()) Fail(at, "a \\u escape cut short (truncated?)");
    uint32_t cp = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = s_[pos_++];
      const int digit = h >= '0' && h <= '9'   ? h - '0'
                        : h >= 'a' && h <= 'f' ? h - 'a' + 10
                        : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                               : -1;
      if (digit < 0) Fail(at, "a \\u escape with a non-hex digit " + ByteName(static_cast<unsigned char>(h)));
      cp = cp * 16 + static_cast<uint32_t>(digit);
    }
    return cp;
  }

  void Number(JsonValue* v) {
    v->kind = JsonValue::Kind::kNumber;
    const size_t start = pos_;
    auto digits = [&](const char* where) {
      if (AtEnd() || Peek() < '0' || Peek() > '9')
        Fail(pos_, std::string("expected a digit ") + where + ", found " + Found());
      while (!AtEnd() && Peek() >= '0' && Peek() <= '9') ++pos_;
    };
    if (Peek() == '-') ++pos_;
    if (!AtEnd() && Peek() == '0') {
      ++pos_;  // a leading zero is the whole integer part
    } else {
      digits("in a number");
    }
    if (!AtEnd() && Peek() == '.') {
      ++pos_;
      digits("after a decimal point");
    }
    if (!AtEnd() && (Peek() == 'e' || Peek() == 'E')) {
      ++pos_;
      if (!AtEnd() && (Peek() == '+' || Peek() == '-')) ++pos_;
      digits("in an exponent");
    }
    if (static_cast<int64_t>(pos_ - start) > limits_.max_string_bytes) {
      Fail(start, "a number longer than " + std::to_string(limits_.max_string_bytes) + " bytes");
    }
    v->text.assign(s_.data() + start, pos_ - start);
  }

  std::string_view s_;
  const JsonLimits& limits_;
  const std::string& what_;
  size_t pos_ = 0;
  int64_t values_ = 0;
  std::vector<std::string> path_;  // the keys of the members being parsed, outermost first
};

}  // namespace

const char* JsonKindName(JsonValue::Kind kind) {
  switch (kind) {
    case JsonValue::Kind::kNull: return "null";
    case JsonValue::Kind::kBool: return "a bool";
    case JsonValue::Kind::kNumber: return "a number";
    case JsonValue::Kind::kString: return "a string";
    case JsonValue::Kind::kArray: return "an array";
    case JsonValue::Kind::kObject: return "an object";
  }
  return "?";
}

JsonValue ParseJson(std::string_view json, const JsonLimits& limits, const std::string& what, size_t* end) {
  return JsonParser(json, limits, what).Parse(end);
}

void AppendJsonString(std::string_view s, std::string* out) {
  static constexpr char kHex[] = "0123456789abcdef";
  out->push_back('"');
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\b': out->append("\\b"); break;
      case '\f': out->append("\\f"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      default:
        if (c < 0x20) {
          out->append("\\u00");
          out->push_back(kHex[c >> 4]);
          out->push_back(kHex[c & 0xF]);
        } else {
          out->push_back(ch);
        }
    }
  }
  out->push_back('"');
}

size_t InvalidUtf8Offset(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = Utf8Length(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

}  // namespace fsdp::checkpoint::internal
