#include "checkpoint/dcp_pickle.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace fsdp::checkpoint::internal {
namespace {

constexpr int kMaxDepth = 64;           // DCP's Metadata nests 8 deep
constexpr size_t kMaxGlobalName = 256;  // "torch.distributed.checkpoint.metadata" is 37

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
    // Surrogates are allowed: Python's pickle decodes with 'surrogatepass'.
    if (cp < kMin[len] || cp > 0x10FFFF) return false;
    i += len;
  }
  return true;
}

PyRef Make(PyValue::Kind kind) {
  auto v = std::make_shared<PyValue>();
  v->kind = kind;
  v->depth = kind == PyValue::Kind::kTuple || kind == PyValue::Kind::kList || kind == PyValue::Kind::kDict ||
                     kind == PyValue::Kind::kObject
                 ? 1
                 : 0;
  return v;
}

class Unpickler {
 public:
  Unpickler(std::string_view in, const std::string& source, const GlobalAllowList& allowed)
      : in_(in), what_(source + " is not a valid DCP metadata file: "), allowed_(allowed) {}

  PyRef Run() {
    TORCH_CHECK(Byte() == 0x80, where(), "does not start with a pickle PROTO opcode");
    const int protocol = Byte();
    TORCH_CHECK(protocol >= 2 && protocol <= 5, where(), "pickle protocol ", protocol, " (2 to 5 are read)");
    while (Step()) {
    }
    TORCH_CHECK(stack_.size() == 1 && marks_.empty(), where(), "the pickle ends with ", stack_.size(), " values and ",
                marks_.size(), " marks on its stack instead of one value");
    TORCH_CHECK(pos_ == in_.size(), where(), in_.size() - pos_, " bytes follow the pickle's STOP");
    return stack_.back();
  }

 private:
  std::string where() const { return absl::StrCat(what_, "byte ", op_pos_, ": "); }

  uint8_t Byte() {
    TORCH_CHECK(pos_ < in_.size(), what_, "it ends at byte ", in_.size(), " inside an opcode (truncated)");
    return static_cast<uint8_t>(in_[pos_++]);
  }
  std::string_view Bytes(uint64_t n) {
    TORCH_CHECK(n <= in_.size() - pos_, where(), "an operand of ", n, " bytes runs past the end (", in_.size() - pos_,
                " bytes left; truncated?)");
    std::string_view out = in_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  uint64_t Le(int n) {
    uint64_t v = 0;
    const std::string_view b = Bytes(n);
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(b[i])) << (8 * i);
    return v;
  }
  std::string Line() {
    const size_t nl = in_.find('\n', pos_);
    TORCH_CHECK(nl != std::string_view::npos && nl - pos_ <= kMaxGlobalName, where(), "a GLOBAL name is not a line");
    std::string out(in_.substr(pos_, nl - pos_));
    pos_ = nl + 1;
    return out;
  }
  PyRef Text(uint64_t n) {
    PyRef v = Make(PyValue::Kind::kStr);
    v->str = std::string(Bytes(n));
    TORCH_CHECK(IsUtf8(v->str), where(), "a str is not valid UTF-8");
    return v;
  }

  PyRef Pop() {
    TORCH_CHECK(!stack_.empty(), where(), "the opcode needs a value but the stack is empty");
    PyRef v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  PyRef& Top() {
    TORCH_CHECK(!stack_.empty(), where(), "the opcode needs a value but the stack is empty");
    return stack_.back();
  }
  size_t PopMark() {
    TORCH_CHECK(!marks_.empty(), where(), "the opcode needs a MARK but there is none");
    const size_t mark = marks_.back();
    marks_.pop_back();
    TORCH_CHECK(mark <= stack_.size(), where(), "its MARK at stack depth ", mark, " lies above the stack (",
                stack_.size(), " values)");
    return mark;
  }
  std::vector<PyRef> TakeFrom(size_t start) {
    std::vector<PyRef> items(std::make_move_iterator(stack_.begin() + start), std::make_move_iterator(stack_.end()));
    stack_.resize(start);
    return items;
  }

  void CheckDepth(int depth) const {
    TORCH_CHECK(depth <= kMaxDepth, where(), "values nest ", depth, " deep, more than ", kMaxDepth);
  }
  // Puts `child` into the mutable `parent` (a list, dict or object not yet put anywhere);
  // `child` cannot change afterwards, which keeps the tree acyclic and its depths right.
  void Adopt(PyValue& parent, const PyRef& child) {
    TORCH_CHECK(!parent.sealed, where(),
                "the pickle modifies a value after putting it into another (recursive structures are not read)");
    TORCH_CHECK(child.get() != &parent, where(), "the pickle puts a value into itself");
    const int depth = std::max(parent.depth, child->depth + 1);
    CheckDepth(depth);
    parent.depth = depth;
    child->sealed = true;
  }
  PyRef MakeTuple(std::vector<PyRef> items) {
    PyRef t = Make(PyValue::Kind::kTuple);
    for (const PyRef& item : items) Adopt(*t, item);
    t->items = std::move(items);
    t->sealed = true;
    return t;
  }
  PyValue& Expect(const PyRef& v, PyValue::Kind kind, const char* opcode, const char* what) {
    TORCH_CHECK(v->kind == kind, where(), opcode, " applies to something that is not ", what);
    return *v;
  }
  void SetItem(PyValue& dict, PyRef key, PyRef value) {
    TORCH_CHECK(key->kind != PyValue::Kind::kList && key->kind != PyValue::Kind::kDict, where(),
                "a dict key is a list or dict (unhashable)");
    Adopt(dict, key);
    Adopt(dict, value);
    dict.items.push_back(std::move(key));
    dict.items.push_back(std::move(value));
  }

  PyRef GlobalNamed(const std::string& module, const std::string& name) {
    PyRef v = Make(PyValue::Kind::kGlobal);
    v->str = absl::StrCat(module, ".", name);
    TORCH_CHECK(allowed_.contains(v->str), where(), "unsupported global '", v->str,
                "' (only the classes of DCP's metadata, torch.Size and torch dtypes are read)");
    v->sealed = true;
    return v;
  }
  // REDUCE / NEWOBJ: an uncalled object of the allowed global `callable`.
  PyRef Instance(const PyRef& callable, const PyRef& args, unsigned use, const char* opcode) {
    TORCH_CHECK(callable->kind == PyValue::Kind::kGlobal, where(), opcode, " of something that is not a global");
    TORCH_CHECK(allowed_.at(callable->str) & use, where(), opcode, " of '", callable->str,
                "', which is not read that way");
    TORCH_CHECK(args->kind == PyValue::Kind::kTuple, where(), opcode, " of '", callable->str,
                "' without a tuple of arguments");
    PyRef obj = Make(PyValue::Kind::kObject);
    obj->str = callable->str;
    obj->reduced = use == kUseToCall;
    Adopt(*obj, args);
    obj->args = args;
    return obj;
  }

  bool Step() {
    op_pos_ = pos_;
    const uint8_t op = Byte();
    switch (op) {
      case '.': return false;  // STOP
      case 0x95: {             // FRAME: a length prefix for buffering; the opcodes follow as usual
        const uint64_t n = Le(8);
        TORCH_CHECK(n <= in_.size() - pos_, where(), "a FRAME of ", n, " bytes runs past the end (", in_.size() - pos_,
                    " bytes left; truncated?)");
        break;
      }
      case '(': marks_.push_back(stack_.size()); break;  // MARK
      case ')': stack_.push_back(MakeTuple({})); break;
      case ']': stack_.push_back(Make(PyValue::Kind::kList)); break;
      case '}': stack_.push_back(Make(PyValue::Kind::kDict)); break;
      case 'N': stack_.push_back(Make(PyValue::Kind::kNone)); break;
      case 0x88:
      case 0x89: {
        PyRef v = Make(PyValue::Kind::kBool);
        v->b = op == 0x88;
        stack_.push_back(std::move(v));
        break;
      }
      case 'K':
      case 'M':
      case 'J':
      case 0x8a: {  // BININT1, BININT2 (unsigned), BININT (int32), LONG1 (n-byte two's complement)
        PyRef v = Make(PyValue::Kind::kInt);
        if (op == 0x8a) {
          const int n = Byte();
          TORCH_CHECK(n <= 8, where(), "an integer of ", n, " bytes does not fit int64");
          uint64_t bits = Le(n);
          if (n > 0 && n < 8 && ((bits >> (8 * n - 1)) & 1)) bits |= ~uint64_t{0} << (8 * n);
          v->i = static_cast<int64_t>(bits);
        } else if (op == 'J') {
          v->i = static_cast<int32_t>(Le(4));
        } else {
          v->i = static_cast<int64_t>(Le(op == 'K' ? 1 : 2));
        }
        stack_.push_back(std::move(v));
        break;
      }
      case 'G': {  // BINFLOAT, big-endian
        uint64_t bits = 0;
        for (char c : Bytes(8)) bits = (bits << 8) | static_cast<uint8_t>(c);
        PyRef v = Make(PyValue::Kind::kFloat);
        std::memcpy(&v->f, &bits, 8);
        stack_.push_back(std::move(v));
        break;
      }
      case 0x8c: stack_.push_back(Text(Le(1))); break;  // SHORT_BINUNICODE
      case 'X': stack_.push_back(Text(Le(4))); break;   // BINUNICODE
      case 0x8d: stack_.push_back(Text(Le(8))); break;  // BINUNICODE8
      case 'q':
      case 'r': memo_[Le(op == 'q' ? 1 : 4)] = Top(); break;  // BINPUT, LONG_BINPUT
      case 0x94: {                                            // MEMOIZE: the next free id
        const uint64_t id = memo_.size();
        memo_[id] = Top();
        break;
      }
      case 'h':
      case 'j': {  // BINGET, LONG_BINGET
        const uint64_t id = Le(op == 'h' ? 1 : 4);
        auto it = memo_.find(id);
        TORCH_CHECK(it != memo_.end(), where(), "BINGET of memo entry ", id, ", which was never stored");
        stack_.push_back(it->second);
        break;
      }
      case 't': stack_.push_back(MakeTuple(TakeFrom(PopMark()))); break;
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        const size_t n = op - 0x84;
        TORCH_CHECK(stack_.size() >= n, where(), "TUPLE", n, " with ", stack_.size(), " values on the stack");
        stack_.push_back(MakeTuple(TakeFrom(stack_.size() - n)));
        break;
      }
      case 'l': {  // LIST
        std::vector<PyRef> items = TakeFrom(PopMark());
        PyRef list = Make(PyValue::Kind::kList);
        for (const PyRef& item : items) Adopt(*list, item);
        list->items = std::move(items);
        stack_.push_back(std::move(list));
        break;
      }
      case 'd': {  // DICT
        std::vector<PyRef> items = TakeFrom(PopMark());
        TORCH_CHECK(items.size() % 2 == 0, where(), "DICT of an odd number (", items.size(), ") of keys and values");
        PyRef dict = Make(PyValue::Kind::kDict);
        for (size_t i = 0; i < items.size(); i += 2) SetItem(*dict, items[i], items[i + 1]);
        stack_.push_back(std::move(dict));
        break;
      }
      case 'a': {  // APPEND
        PyRef item = Pop();
        PyValue& list = Expect(Top(), PyValue::Kind::kList, "APPEND", "a list");
        Adopt(list, item);
        list.items.push_back(std::move(item));
        break;
      }
      case 'e': {  // APPENDS
        std::vector<PyRef> items = TakeFrom(PopMark());
        PyValue& list = Expect(Top(), PyValue::Kind::kList, "APPENDS", "a list");
        for (PyRef& item : items) {
          Adopt(list, item);
          list.items.push_back(std::move(item));
        }
        break;
      }
      case 's': {  // SETITEM
        PyRef value = Pop(), key = Pop();
        SetItem(Expect(Top(), PyValue::Kind::kDict, "SETITEM", "a dict"), std::move(key), std::move(value));
        break;
      }
      case 'u': {  // SETITEMS
        std::vector<PyRef> items = TakeFrom(PopMark());
        PyValue& dict = Expect(Top(), PyValue::Kind::kDict, "SETITEMS", "a dict");
        TORCH_CHECK(items.size() % 2 == 0, where(), "SETITEMS of an odd number (", items.size(),
                    ") of keys and values");
        for (size_t i = 0; i < items.size(); i += 2) SetItem(dict, items[i], items[i + 1]);
        break;
      }
      case 'c': {  // GLOBAL module\nname\n
        const std::string module = Line();
        const std::string name = Line();
        stack_.push_back(GlobalNamed(module, name));
        break;
      }
      case 0x93: {  // STACK_GLOBAL: module, name from the stack
        PyRef name = Pop(), module = Pop();
        TORCH_CHECK(module->kind == PyValue::Kind::kStr && name->kind == PyValue::Kind::kStr, where(),
                    "STACK_GLOBAL of values that are not str");
        TORCH_CHECK(module->str.size() <= kMaxGlobalName && name->str.size() <= kMaxGlobalName, where(),
                    "a STACK_GLOBAL name of more than ", kMaxGlobalName, " bytes");
        stack_.push_back(GlobalNamed(module->str, name->str));
        break;
      }
      case 'R': {  // REDUCE
        PyRef args = Pop(), callable = Pop();
        stack_.push_back(Instance(callable, args, kUseToCall, "REDUCE"));
        break;
      }
      case 0x81: {  // NEWOBJ
        PyRef args = Pop(), cls = Pop();
        stack_.push_back(Instance(cls, args, kUseToNew, "NEWOBJ"));
        break;
      }
      case 'b': {  // BUILD: once per object
        PyRef state = Pop();
        PyValue& obj = Expect(Top(), PyValue::Kind::kObject, "BUILD", "an object");
        TORCH_CHECK(obj.state == nullptr, where(), "a second BUILD of a '", obj.str, "'");
        Adopt(obj, state);
        obj.state = std::move(state);
        break;
      }
      default:
        TORCH_CHECK(false, where(), "unsupported pickle opcode ", absl::StrCat("0x", absl::Hex(op)), " ('",
                    std::isprint(op) ? std::string(1, static_cast<char>(op)) : std::string("?"), "')");
    }
    return true;
  }

  std::string_view in_;
  const std::string what_;
  const GlobalAllowList& allowed_;
  size_t pos_ = 0, op_pos_ = 0;
  std::vector<PyRef> stack_;
  std::vector<size_t> marks_;
  absl::flat_hash_map<uint64_t, PyRef> memo_;
};

}  // namespace

std::string Describe(const PyRef& v) {
  switch (v->kind) {
    case PyValue::Kind::kNone: return "None";
    case PyValue::Kind::kBool: return "a bool";
    case PyValue::Kind::kInt: return "an int";
    case PyValue::Kind::kFloat: return "a float";
    case PyValue::Kind::kStr: return "a str";
    case PyValue::Kind::kTuple: return "a tuple";
    case PyValue::Kind::kList: return "a list";
    case PyValue::Kind::kDict: return "a dict";
    case PyValue::Kind::kGlobal: return absl::StrCat("the global '", v->str, "'");
    case PyValue::Kind::kObject: return absl::StrCat("a '", v->str, "'");
  }
  return "an unknown value";
}

PyRef Unpickle(const char* data, size_t size, const std::string& source, const GlobalAllowList& allowed) {
  return Unpickler(std::string_view(data, size), source, allowed).Run();
}

Pickler::Pickler() {
  Op(0x80);
  Op(2);
}

void Pickler::Le(uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void Pickler::Int(int64_t v) {
  if (v >= 0 && v < 256) {
    Op('K'), Le(v, 1);
  } else if (v >= 0 && v < 65536) {
    Op('M'), Le(v, 2);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    Op('J'), Le(static_cast<uint32_t>(v), 4);
  } else {
    Op(0x8a), Op(8), Le(static_cast<uint64_t>(v), 8);
  }
}

void Pickler::Str(std::string_view v) {
  TORCH_CHECK(IsUtf8(v), "DCP metadata: the str '", v.substr(0, 64), "' is not valid UTF-8");
  TORCH_CHECK(v.size() <= UINT32_MAX, "DCP metadata: a str of ", v.size(), " bytes");
  Op('X');
  Le(v.size(), 4);
  out_.insert(out_.end(), v.begin(), v.end());
}

void Pickler::Global(std::string_view module, std::string_view name) {
  const std::string key = std::string(module) + "\n" + std::string(name) + "\n";
  auto it = memo_.find(key);
  if (it != memo_.end()) {
    const uint32_t id = it->second;
    if (id < 256) {
      Op('h'), Le(id, 1);
    } else {
      Op('j'), Le(id, 4);
    }
    return;
  }
  Op('c');
  out_.insert(out_.end(), key.begin(), key.end());
  const uint32_t id = static_cast<uint32_t>(memo_.size());
  memo_.emplace(key, id);
  if (id < 256) {
    Op('q'), Le(id, 1);
  } else {
    Op('r'), Le(id, 4);
  }
}

std::vector<char> Pickler::Finish() {
  Op('.');
  std::vector<char> out = std::move(out_);
  out_.clear();
  memo_.clear();
  Op(0x80);
  Op(2);
  return out;
}

}  // namespace fsdp::checkpoint::internal
