#include "tools/fr_trace_lib.h"

#include <c10/util/Exception.h>
#include <dirent.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp::tools {
namespace {

// Bounds on untrusted dumps: far above what a ring of PyTorch's maximum size holds.
constexpr size_t kMaxDumpBytes = size_t{1} << 30;
constexpr size_t kMaxStackDepth = 1 << 20;
constexpr size_t kMaxListedRanks = size_t{1} << 22;

// ------------------------------------------------------------------ pickle values

struct Value {
  enum class Kind { kNone, kBool, kInt, kFloat, kStr, kList, kTuple, kDict, kMark };
  Kind kind = Kind::kNone;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<Value*> items;                     // list, tuple
  std::vector<std::pair<Value*, Value*>> pairs;  // dict
};

const char* KindName(Value::Kind kind) {
  switch (kind) {
    case Value::Kind::kNone: return "None";
    case Value::Kind::kBool: return "bool";
    case Value::Kind::kInt: return "int";
    case Value::Kind::kFloat: return "float";
    case Value::Kind::kStr: return "str";
    case Value::Kind::kList: return "list";
    case Value::Kind::kTuple: return "tuple";
    case Value::Kind::kDict: return "dict";
    case Value::Kind::kMark: return "mark";
  }
  return "?";
}

// Values live in an arena owned by the parser: memo references (BINGET) may share and even
// cycle, which neither leaks nor recurses here (readers below walk a fixed depth).
class Unpickler {
 public:
  Unpickler(std::string_view bytes, const std::string& what) : bytes_(bytes), what_(what) {}

  const Value* Parse() {
    TORCH_CHECK(bytes_.size() <= kMaxDumpBytes, what_, ": ", bytes_.size(), " bytes is more than a dump holds");
    while (true) {
      TORCH_CHECK(pos_ < bytes_.size(), what_, ": truncated pickle (no STOP) at byte ", pos_);
      const size_t at = pos_;
      const uint8_t op = Byte();
      switch (op) {
        case 0x80: Byte(); break;    // PROTO
        case 0x95: Bytes(8); break;  // FRAME
        case '.': {                  // STOP
          TORCH_CHECK(stack_.size() == 1 && stack_[0]->kind != Value::Kind::kMark, what_, ": pickle ends with ",
                      stack_.size(), " values on the stack, expected 1");
          return stack_[0];
        }
        case '(': Push(New(Value::Kind::kMark)); break;
        case '}': Push(New(Value::Kind::kDict)); break;
        case ']': Push(New(Value::Kind::kList)); break;
        case ')': Push(New(Value::Kind::kTuple)); break;
        case 'N': Push(New(Value::Kind::kNone)); break;
        case 0x88:
        case 0x89: {
          Value* v = New(Value::Kind::kBool);
          v->i = op == 0x88;
          Push(v);
          break;
        }
        case 'J': PushInt(static_cast<int32_t>(Little(4))); break;
        case 'K': PushInt(static_cast<int64_t>(Little(1))); break;
        case 'M': PushInt(static_cast<int64_t>(Little(2))); break;
        case 0x8a: {  // LONG1
          const size_t n = Byte();
          TORCH_CHECK(n <= 8, what_, ": integer of ", n, " bytes at byte ", at, " does not fit 64 bits");
          uint64_t v = n == 0 ? 0 : Little(n);
          if (n > 0 && n < 8 && (v >> (8 * n - 1)) != 0) v |= ~uint64_t{0} << (8 * n);  // sign-extend
          PushInt(static_cast<int64_t>(v));
          break;
        }
        case 'G': {  // BINFLOAT, big-endian
          const std::string_view b = Bytes(8);
          uint64_t bits = 0;
          for (char c : b) bits = (bits << 8) | static_cast<uint8_t>(c);
          Value* v = New(Value::Kind::kFloat);
          std::memcpy(&v->f, &bits, sizeof(double));
          Push(v);
          break;
        }
        case 'X': PushStr(Bytes(Little(4))); break;   // BINUNICODE
        case 0x8c: PushStr(Bytes(Byte())); break;     // SHORT_BINUNICODE
        case 0x8d: PushStr(Bytes(Little(8))); break;  // BINUNICODE8
        case 't': {                                   // TUPLE
          Value* t = New(Value::Kind::kTuple);
          t->items = PopToMark(at);
          Push(t);
          break;
        }
        case 0x85:
        case 0x86:
        case 0x87: {  // TUPLE1..3
          const size_t n = op - 0x84;
          TORCH_CHECK(stack_.size() >= n, what_, ": TUPLE", n, " at byte ", at, " with ", stack_.size(), " values");
          Value* t = New(Value::Kind::kTuple);
          t->items.assign(stack_.end() - n, stack_.end());
          for (Value* item : t->items) CheckNotMark(item, at);
          stack_.resize(stack_.size() - n);
          Push(t);
          break;
        }
        case 'a': {  // APPEND
          Value* item = Pop(at);
          Container(Value::Kind::kList, at)->items.push_back(item);
          break;
        }
        case 'e': {  // APPENDS
          std::vector<Value*> items = PopToMark(at);
          Value* list = Container(Value::Kind::kList, at);
          list->items.insert(list->items.end(), items.begin(), items.end());
          break;
        }
        case 's': {  // SETITEM
          Value* value = Pop(at);
          Value* key = Pop(at);
          Container(Value::Kind::kDict, at)->pairs.emplace_back(key, value);
          break;
        }
        case 'u': {  // SETITEMS
          std::vector<Value*> items = PopToMark(at);
          TORCH_CHECK(items.size() % 2 == 0, what_, ": SETITEMS at byte ", at, " with an odd count ", items.size());
          Value* dict = Container(Value::Kind::kDict, at);
          for (size_t k = 0; k < items.size(); k += 2) dict->pairs.emplace_back(items[k], items[k + 1]);
          break;
        }
        case 'q': Memo(Byte(), at); break;              // BINPUT
        case 'r': Memo(Little(4), at); break;           // LONG_BINPUT
        case 0x94: Memo(memo_.size(), at); break;       // MEMOIZE: the next index
        case 'h': Push(MemoGet(Byte(), at)); break;     // BINGET
        case 'j': Push(MemoGet(Little(4), at)); break;  // LONG_BINGET
        default:
          TORCH_CHECK(false, what_, ": unsupported pickle opcode 0x", std::hex, static_cast<int>(op), std::dec,
                      " at byte ", at, " (a flight recorder dump holds dicts, lists, strings and numbers only)");
      }
    }
  }

 private:
  uint8_t Byte() {
    TORCH_CHECK(pos_ < bytes_.size(), what_, ": truncated at byte ", pos_);
    return static_cast<uint8_t>(bytes_[pos_++]);
  }
  std::string_view Bytes(uint64_t n) {
    TORCH_CHECK(n <= bytes_.size() - pos_, what_, ": ", n, " bytes wanted at byte ", pos_, " but only ",
                bytes_.size() - pos_, " remain");
    std::string_view out = bytes_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  uint64_t Little(size_t n) {
    const std::string_view b = Bytes(n);
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) v |= static_cast<uint64_t>(static_cast<uint8_t>(b[k])) << (8 * k);
    return v;
  }
  Value* New(Value::Kind kind) {
    arena_.push_back(std::make_unique<Value>());
    arena_.back()->kind = kind;
    return arena_.back().get();
  }
  void Push(Value* v) {
    TORCH_CHECK(stack_.size() < kMaxStackDepth, what_, ": more than ", kMaxStackDepth, " values on the stack");
    stack_.push_back(v);
  }
  void PushInt(int64_t i) {
    Value* v = New(Value::Kind::kInt);
    v->i = i;
    Push(v);
  }
  void PushStr(std::string_view s) {
    Value* v = New(Value::Kind::kStr);
    v->s = std::string(s);
    Push(v);
  }
  void CheckNotMark(const Value* v, size_t at) const {
    TORCH_CHECK(v->kind != Value::Kind::kMark, what_, ": a MARK used as a value at byte ", at);
  }
  Value* Pop(size_t at) {
    TORCH_CHECK(!stack_.empty(), what_, ": pop from an empty stack at byte ", at);
    Value* v = stack_.back();
    stack_.pop_back();
    CheckNotMark(v, at);
    return v;
  }
  std::vector<Value*> PopToMark(size_t at) {
    size_t k = stack_.size();
    while (k > 0 && stack_[k - 1]->kind != Value::Kind::kMark) --k;
    TORCH_CHECK(k > 0, what_, ": no MARK for the opcode at byte ", at);
    std::vector<Value*> items(stack_.begin() + k, stack_.end());
    stack_.resize(k - 1);
    return items;
  }
  Value* Container(Value::Kind kind, size_t at) {
    TORCH_CHECK(!stack_.empty() && stack_.back()->kind == kind, what_, ": expected a ", KindName(kind),
                " on the stack at byte ", at, ", found ", stack_.empty() ? "nothing" : KindName(stack_.back()->kind));
    return stack_.back();
  }
  void Memo(uint64_t index, size_t at) {
    TORCH_CHECK(!stack_.empty(), what_, ": memo put from an empty stack at byte ", at);
    memo_[index] = stack_.back();
  }
  Value* MemoGet(uint64_t index, size_t at) {
    auto it = memo_.find(index);
    TORCH_CHECK(it != memo_.end(), what_, ": memo get of unset index ", index, " at byte ", at);
    return it->second;
  }

  std::string_view bytes_;
  const std::string& what_;
  size_t pos_ = 0;
  std::vector<Value*> stack_;
  absl::flat_hash_map<uint64_t, Value*> memo_;
  std::vector<std::unique_ptr<Value>> arena_;

 public:
  // The arena outlives Parse()'s result: the parser object owns it.
};

// ------------------------------------------------------------------ typed access

class Reader {
 public:
  explicit Reader(const std::string& what) : what_(what) {}

  // nullptr when `dict` has no `key`.
  const Value* FieldOrNull(const Value* dict, const char* key, const std::string& where) const {
    TORCH_CHECK(dict->kind == Value::Kind::kDict, what_, ": ", where, " is a ", KindName(dict->kind),
                ", expected a dict");
    for (const auto& [k, v] : dict->pairs) {
      if (k->kind == Value::Kind::kStr && k->s == key) return v;
    }
    return nullptr;
  }
  const Value* Field(const Value* dict, const char* key, const std::string& where) const {
    const Value* v = FieldOrNull(dict, key, where);
    TORCH_CHECK(v != nullptr, what_, ": ", where, " has no '", key, "'");
    return v;
  }
  const Value* Typed(const Value* v, Value::Kind kind, const std::string& where) const {
    TORCH_CHECK(v->kind == kind, what_, ": ", where, " is a ", KindName(v->kind), ", expected a ", KindName(kind));
    return v;
  }
  std::string Str(const Value* dict, const char* key, const std::string& where) const {
    return Typed(Field(dict, key, where), Value::Kind::kStr, absl::StrCat(where, ".", key))->s;
  }
  int64_t Int(const Value* dict, const char* key, const std::string& where) const {
    return Typed(Field(dict, key, where), Value::Kind::kInt, absl::StrCat(where, ".", key))->i;
  }
  const std::vector<Value*>& Items(const Value* v, const std::string& where) const {
    TORCH_CHECK(v->kind == Value::Kind::kList || v->kind == Value::Kind::kTuple, what_, ": ", where, " is a ",
                KindName(v->kind), ", expected a list");
    return v->items;
  }
  std::vector<std::vector<int64_t>> Sizes(const Value* dict, const char* key, const std::string& where) const {
    std::vector<std::vector<int64_t>> out;
    const std::string field = absl::StrCat(where, ".", key);
    for (const Value* shape : Items(Field(dict, key, where), field)) {
      out.emplace_back();
      for (const Value* d : Items(shape, field)) out.back().push_back(Typed(d, Value::Kind::kInt, field)->i);
    }
    return out;
  }
  std::vector<std::string> Strs(const Value* dict, const char* key, const std::string& where) const {
    std::vector<std::string> out;
    const std::string field = absl::StrCat(where, ".", key);
    for (const Value* s : Items(Field(dict, key, where), field)) out.push_back(Typed(s, Value::Kind::kStr, field)->s);
    return out;
  }

 private:
  const std::string& what_;
};

// pg_config ranks: the string "[0, 1, 2]" (as PyTorch writes it) or a list of ints.
std::vector<int> ParseRanks(const Value* v, const std::string& what, const std::string& where) {
  std::vector<int> ranks;
  if (v->kind == Value::Kind::kList || v->kind == Value::Kind::kTuple) {
    for (const Value* r : v->items) {
      TORCH_CHECK(r->kind == Value::Kind::kInt && r->i >= 0 && r->i <= INT32_MAX, what, ": ", where,
                  " holds a rank that is not a non-negative int");
      ranks.push_back(static_cast<int>(r->i));
    }
    return ranks;
  }
  TORCH_CHECK(v->kind == Value::Kind::kStr, what, ": ", where, " is a ", KindName(v->kind), ", expected '[0, 1, ...]'");
  const std::string& s = v->s;
  TORCH_CHECK(s.size() >= 2 && s.front() == '[' && s.back() == ']', what, ": ", where, " = '", s,
              "' is not a list of ranks");
  std::string body = s.substr(1, s.size() - 2);
  std::stringstream in(body);
  std::string token;
  while (std::getline(in, token, ',')) {
    const size_t b = token.find_first_not_of(' ');
    const size_t e = token.find_last_not_of(' ');
    TORCH_CHECK(b != std::string::npos, what, ": ", where, " = '", s, "' has an empty rank");
    token = token.substr(b, e - b + 1);
    TORCH_CHECK(!token.empty() && token.size() <= 9 && token.find_first_not_of("0123456789") == std::string::npos, what,
                ": ", where, " = '", s, "' holds '", token, "', not a rank");
    ranks.push_back(std::stoi(token));
  }
  return ranks;
}

}  // namespace

std::string FlightEntry::op() const {
  const size_t colon = profiling_name.rfind(':');
  std::string name = colon == std::string::npos ? profiling_name : profiling_name.substr(colon + 1);
  return name.substr(0, name.find(' '));
}

FlightDump ParseFlightDump(std::string_view bytes, int rank, const std::string& what) {
  Unpickler unpickler(bytes, what);
  const Value* root = unpickler.Parse();
  Reader r(what);
  FlightDump dump;
  dump.rank = rank;
  dump.version = r.Str(root, "version", "the dump");
  const Value* config = r.Typed(r.Field(root, "pg_config", "the dump"), Value::Kind::kDict, "pg_config");
  // Parsed once per value: a pickle may reference one ranks string from every group (memo).
  std::map<const Value*, std::vector<int>> parsed_ranks;
  size_t total_ranks = 0;
  for (const auto& [key, group] : config->pairs) {
    const std::string name = r.Typed(key, Value::Kind::kStr, "a pg_config key")->s;
    const std::string where = absl::StrCat("pg_config['", name, "']");
    FlightGroupConfig g;
    g.desc = r.Str(group, "desc", where);
    const Value* ranks = r.Field(group, "ranks", where);
    auto it = parsed_ranks.find(ranks);
    if (it == parsed_ranks.end()) it = parsed_ranks.emplace(ranks, ParseRanks(ranks, what, where + ".ranks")).first;
    g.ranks = it->second;
    total_ranks += g.ranks.size();
    TORCH_CHECK(total_ranks <= kMaxListedRanks, what, ": pg_config lists more than ", kMaxListedRanks,
                " ranks in all groups (a rank is in a few groups of at most the world)");
    dump.groups[name] = std::move(g);
  }
  const auto& entries = r.Items(r.Field(root, "entries", "the dump"), "entries");
  for (size_t k = 0; k < entries.size(); ++k) {
    const Value* e = entries[k];
    const std::string where = absl::StrCat("entries[", k, "]");
    FlightEntry entry;
    entry.record_id = r.Int(e, "record_id", where);
    const auto& pg = r.Items(r.Field(e, "process_group", where), where + ".process_group");
    TORCH_CHECK(pg.size() == 2, what, ": ", where, ".process_group has ", pg.size(), " items, expected (name, desc)");
    entry.group_name = r.Typed(pg[0], Value::Kind::kStr, where + ".process_group[0]")->s;
    entry.group_desc = r.Typed(pg[1], Value::Kind::kStr, where + ".process_group[1]")->s;
    entry.seq = r.Int(e, "collective_seq_id", where);
    entry.profiling_name = r.Str(e, "profiling_name", where);
    entry.input_sizes = r.Sizes(e, "input_sizes", where);
    entry.output_sizes = r.Sizes(e, "output_sizes", where);
    entry.input_dtypes = r.Strs(e, "input_dtypes", where);
    entry.output_dtypes = r.Strs(e, "output_dtypes", where);
    entry.state = r.Str(e, "state", where);
    entry.time_created_ns = r.Int(e, "time_created_ns", where);
    const Value* completed = r.Field(e, "time_discovered_completed_ns", where);
    if (completed->kind != Value::Kind::kNone) {
      entry.time_completed_ns = r.Typed(completed, Value::Kind::kInt, where + ".time_discovered_completed_ns")->i;
    }
    // Absent from PyTorch's dumps without stack traces.
    const Value* frames_value = r.FieldOrNull(e, "frames", where);
    static const std::vector<Value*> kNoFrames;
    const auto& frames = frames_value == nullptr ? kNoFrames : r.Items(frames_value, where + ".frames");
    for (size_t f = 0; f < frames.size(); ++f) {
      const std::string fw = absl::StrCat(where, ".frames[", f, "]");
      std::string frame = r.Str(frames[f], "name", fw);
      const std::string file = r.Str(frames[f], "filename", fw);
      if (!file.empty()) absl::StrAppend(&frame, " at ", file, ":", r.Int(frames[f], "line", fw));
      entry.frames.push_back(std::move(frame));
    }
    dump.entries.push_back(std::move(entry));
  }
  return dump;
}

std::vector<FlightDump> ReadFlightDumps(const std::string& dir, const std::string& prefix_in) {
  DIR* d = ::opendir(dir.c_str());
  TORCH_CHECK(d != nullptr, "fr_trace: cannot read directory ", dir, ": ", std::strerror(errno));
  std::vector<std::string> files;
  while (const dirent* ent = ::readdir(d)) {
    const std::string name = ent->d_name;
    if (name != "." && name != "..") files.push_back(name);
  }
  ::closedir(d);
  std::sort(files.begin(), files.end());
  // A dump's name is <prefix><rank>.
  auto split = [](const std::string& name) -> std::pair<std::string, std::string> {
    size_t k = name.size();
    while (k > 0 && std::isdigit(static_cast<unsigned char>(name[k - 1]))) --k;
    return {name.substr(0, k), name.substr(k)};
  };
  std::string prefix = prefix_in;
  if (prefix.empty()) {
    std::set<std::string> prefixes;
    for (const auto& f : files) {
      auto [p, digits] = split(f);
      if (!digits.empty()) prefixes.insert(p);
    }
    TORCH_CHECK(prefixes.size() == 1, "fr_trace: cannot infer the dump file prefix in ", dir, " (candidates: [",
                absl::StrJoin(prefixes, ", "), "]); pass --prefix");
    prefix = *prefixes.begin();
  }
  std::vector<FlightDump> dumps;
  for (const auto& f : files) {
    auto [p, digits] = split(f);
    if (p != prefix || digits.empty()) continue;
    TORCH_CHECK(digits.size() <= 9, "fr_trace: ", f, ": rank ", digits, " is out of range");
    const std::string path = dir + "/" + f;
    std::ifstream in(path, std::ios::binary);
    TORCH_CHECK(in.good(), "fr_trace: cannot open ", path);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    dumps.push_back(ParseFlightDump(bytes, std::stoi(digits), path));
  }
  TORCH_CHECK(!dumps.empty(), "fr_trace: no dump named ", prefix, "<rank> in ", dir);
  return dumps;
}

}  // namespace fsdp::tools
