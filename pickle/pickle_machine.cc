#include "pickle/pickle_machine.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cstring>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fsdp::pickle {

// ---------------------------------------------------------------------------- the model's defaults
PickleRef PickleModel::StackGlobal(const PickleRef&, const PickleRef&) { machine().Unsupported(op::kStackGlobal); }
PickleRef PickleModel::NewObj(const PickleRef&, const PickleRef&) { machine().Unsupported(op::kNewObj); }
PickleRef PickleModel::PersistentId(const PickleRef&) { machine().Unsupported(op::kBinPersId); }

// ---------------------------------------------------------------------------- the machine
PickleMachine::PickleMachine(std::string_view pickle, const PickleFormat& format, PickleModel& model)
    : in_(pickle), format_(format), model_(model) {
  model_.machine_ = this;
}

PickleMachine::~PickleMachine() { model_.machine_ = nullptr; }

PickleRef PickleMachine::Run() {
  TORCH_CHECK(Byte() == op::kProto, where(), "does not start with a pickle PROTO opcode");
  const int protocol = Byte();
  TORCH_CHECK(protocol >= format_.min_protocol && protocol <= format_.max_protocol, where(), "pickle protocol ",
              protocol, " (", format_.protocols, ")");
  while (Step()) {
  }
  TORCH_CHECK(stack_.size() == 1 && marks_.empty(), where(), "the pickle ends with ", stack_.size(), " values and ",
              marks_.size(), " marks on its stack instead of one value");
  TORCH_CHECK(!format_.nothing_after_stop || pos_ == in_.size(), where(), in_.size() - pos_,
              " bytes follow the pickle's STOP");
  return stack_.back();
}

std::string PickleMachine::where() const {
  return absl::StrCat(format_.what, format_.stream, format_.stream.empty() ? "" : " ", "byte ", op_pos_, ": ");
}

void PickleMachine::Adopt(PickleNode& parent, const PickleRef& child) {
  TORCH_CHECK(!parent.sealed, where(), "the pickle modifies a ", format_.noun,
              " after putting it into another (recursive structures are not read)");
  TORCH_CHECK(child.get() != &parent, where(), "the pickle puts a ", format_.noun, " into itself");
  const int depth = std::max(parent.depth, child->depth + 1);
  TORCH_CHECK(depth <= kMaxPickleDepth, where(), format_.noun, "s nest ", depth, " deep, more than ", kMaxPickleDepth);
  parent.depth = depth;
  child->sealed = true;
}

void PickleMachine::Unsupported(uint8_t code) const {
  TORCH_CHECK(false, where(), "unsupported pickle opcode ", absl::StrCat("0x", absl::Hex(code)), " ('",
              std::isprint(code) ? std::string(1, static_cast<char>(code)) : std::string("?"), "')");
}

// Operands: each read checked against the end of the pickle.
uint8_t PickleMachine::Byte() {
  TORCH_CHECK(pos_ < in_.size(), format_.what, format_.stream.empty() ? "it" : format_.stream, " ends at byte ",
              in_.size(), " inside an opcode (truncated)");
  return static_cast<uint8_t>(in_[pos_++]);
}

std::string_view PickleMachine::Bytes(uint64_t n) {
  TORCH_CHECK(n <= in_.size() - pos_, where(), "an operand of ", n, " bytes runs past the end",
              format_.stream.empty() ? "" : " of ", format_.stream, " (", in_.size() - pos_,
              " bytes left; truncated?)");
  std::string_view out = in_.substr(pos_, n);
  pos_ += n;
  return out;
}

uint64_t PickleMachine::Le(int n) {
  uint64_t v = 0;
  const std::string_view b = Bytes(n);
  for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(b[i])) << (8 * i);
  return v;
}

int64_t PickleMachine::Long1() {  // n little-endian two's-complement bytes
  const int n = Byte();
  TORCH_CHECK(n <= 8, where(), "an integer of ", n, " bytes does not fit int64");
  uint64_t bits = Le(n);
  if (n > 0 && n < 8 && ((bits >> (8 * n - 1)) & 1)) bits |= ~uint64_t{0} << (8 * n);
  return static_cast<int64_t>(bits);
}

double PickleMachine::BinFloat() {  // big-endian
  uint64_t bits = 0;
  for (char c : Bytes(8)) bits = (bits << 8) | static_cast<uint8_t>(c);
  return std::bit_cast<double>(bits);
}

std::string PickleMachine::Line() {
  const size_t nl = in_.find('\n', pos_);
  TORCH_CHECK(nl != std::string_view::npos && nl - pos_ <= kMaxGlobalName, where(), "a GLOBAL name is not a line");
  std::string out(in_.substr(pos_, nl - pos_));
  pos_ = nl + 1;
  return out;
}

// The stack and the MARKs.
PickleRef PickleMachine::Pop() {
  PickleRef v = std::move(Top());
  stack_.pop_back();
  return v;
}

PickleRef& PickleMachine::Top() {
  TORCH_CHECK(!stack_.empty(), where(), "the opcode needs a value but the stack is empty");
  return stack_.back();
}

size_t PickleMachine::PopMark() {
  TORCH_CHECK(!marks_.empty(), where(), "the opcode needs a MARK but there is none");
  const size_t mark = marks_.back();
  marks_.pop_back();
  TORCH_CHECK(mark <= stack_.size(), where(), "its MARK at stack depth ", mark, " lies above the stack (",
              stack_.size(), " values)");
  return mark;
}

std::vector<PickleRef> PickleMachine::TakeFrom(size_t start) {
  std::vector<PickleRef> items(std::make_move_iterator(stack_.begin() + start), std::make_move_iterator(stack_.end()));
  stack_.resize(start);
  return items;
}

// Containers: shapes checked, items adopted, then the model fills them.
PickleRef PickleMachine::MakeTuple(std::vector<PickleRef> items) {
  PickleRef t = model_.Tuple(items);
  for (const PickleRef& item : items) Adopt(*t, item);
  t->sealed = true;
  return t;
}

PickleNode& PickleMachine::Expect(PickleNode& v, PickleNode::Shape shape, const char* opcode, const char* what) {
  TORCH_CHECK(v.shape == shape, where(), opcode, " applies to something that is not ", what);
  return v;
}

void PickleMachine::AppendTo(PickleNode& list, PickleRef item, const char* opcode) {
  Adopt(Expect(list, PickleNode::Shape::kList, opcode, "a list"), item);
  model_.Append(list, std::move(item));
}

void PickleMachine::SetItemOf(PickleNode& dict, PickleRef key, PickleRef value, const char* opcode) {
  Expect(dict, PickleNode::Shape::kDict, opcode, "a dict");
  Adopt(dict, key);
  Adopt(dict, value);
  model_.SetItem(dict, std::move(key), std::move(value));
}

bool PickleMachine::Step() {
  op_pos_ = pos_;
  const uint8_t code = Byte();
  const bool protocol4 = format_.max_protocol >= 4;
  switch (code) {
    case op::kStop: return false;
    case op::kFrame: {  // a length prefix for buffering; the opcodes follow as usual
      if (!protocol4) Unsupported(code);
      const uint64_t n = Le(8);
      TORCH_CHECK(n <= in_.size() - pos_, where(), "a FRAME of ", n, " bytes runs past the end (", in_.size() - pos_,
                  " bytes left; truncated?)");
      return true;
    }
    case op::kMark: marks_.push_back(stack_.size()); return true;
    case op::kShortBinUnicode:
    case op::kBinUnicode8:
      if (!protocol4) Unsupported(code);
      [[fallthrough]];
    case op::kNone:
    case op::kNewTrue:
    case op::kNewFalse:
    case op::kBinInt1:
    case op::kBinInt2:
    case op::kBinInt:
    case op::kLong1:
    case op::kBinFloat:
    case op::kBinUnicode: StepAtom(code); return true;
    case op::kMemoize:
      if (!protocol4) Unsupported(code);
      [[fallthrough]];
    case op::kBinPut:
    case op::kLongBinPut:
    case op::kBinGet:
    case op::kLongBinGet: StepMemo(code); return true;
    case op::kEmptyTuple:
    case op::kTuple:
    case op::kTuple1:
    case op::kTuple2:
    case op::kTuple3:
    case op::kEmptyList:
    case op::kList:
    case op::kAppend:
    case op::kAppends:
    case op::kEmptyDict:
    case op::kDict:
    case op::kSetItem:
    case op::kSetItems: StepContainer(code); return true;
    case op::kStackGlobal:
      if (!protocol4) Unsupported(code);
      [[fallthrough]];
    case op::kGlobal:
    case op::kReduce:
    case op::kNewObj:
    case op::kBuild:
    case op::kBinPersId: StepCall(code); return true;
    default: Unsupported(code);
  }
}

void PickleMachine::StepAtom(uint8_t code) {
  switch (code) {
    case op::kNone: Push(model_.None()); break;
    case op::kNewTrue: Push(model_.Bool(true)); break;
    case op::kNewFalse: Push(model_.Bool(false)); break;
    case op::kBinInt1: Push(model_.Int(static_cast<int64_t>(Le(1)))); break;
    case op::kBinInt2: Push(model_.Int(static_cast<int64_t>(Le(2)))); break;
    case op::kBinInt: Push(model_.Int(static_cast<int32_t>(Le(4)))); break;
    case op::kLong1: Push(model_.Int(Long1())); break;
    case op::kBinFloat: Push(model_.Float(BinFloat())); break;
    case op::kShortBinUnicode: Push(model_.Str(Bytes(Le(1)))); break;
    case op::kBinUnicode: Push(model_.Str(Bytes(Le(4)))); break;
    case op::kBinUnicode8: Push(model_.Str(Bytes(Le(8)))); break;
  }
}

void PickleMachine::StepMemo(uint8_t code) {
  if (code == op::kBinGet || code == op::kLongBinGet) {
    const uint64_t id = Le(code == op::kBinGet ? 1 : 4);
    auto it = memo_.find(id);
    TORCH_CHECK(it != memo_.end(), where(), "BINGET of memo entry ", id, ", which was never stored");
    Push(it->second);
    return;
  }
  // BINPUT, LONG_BINPUT, MEMOIZE (the next free id). Only ids stored cost memory.
  const uint64_t id = code == op::kMemoize ? memo_.size() : Le(code == op::kBinPut ? 1 : 4);
  memo_[id] = Top();
}

void PickleMachine::StepContainer(uint8_t code) {
  switch (code) {
    case op::kEmptyTuple: Push(MakeTuple({})); return;
    case op::kTuple: Push(MakeTuple(TakeFrom(PopMark()))); return;
    case op::kTuple1:
    case op::kTuple2:
    case op::kTuple3: {
      const size_t n = code - op::kTuple1 + 1;
      TORCH_CHECK(stack_.size() >= n, where(), "TUPLE", n, " with ", stack_.size(), " values on the stack");
      Push(MakeTuple(TakeFrom(stack_.size() - n)));
      return;
    }
    case op::kEmptyList: Push(model_.EmptyList()); return;
    case op::kEmptyDict: Push(model_.EmptyDict()); return;
    case op::kAppend: {
      PickleRef item = Pop();
      AppendTo(*Top(), std::move(item), "APPEND");
      return;
    }
    case op::kSetItem: {
      TORCH_CHECK(stack_.size() >= 3, where(), "SETITEM with ", stack_.size(), " values on the stack");
      PickleRef value = Pop(), key = Pop();
      SetItemOf(*Top(), std::move(key), std::move(value), "SETITEM");
      return;
    }
  }
  // LIST, APPENDS, DICT, SETITEMS: the values since the MARK, into a new container or the one below.
  std::vector<PickleRef> items = TakeFrom(PopMark());
  if (code == op::kList) Push(model_.EmptyList());
  if (code == op::kDict) Push(model_.EmptyDict());
  const char* name = code == op::kList      ? "LIST"
                     : code == op::kAppends ? "APPENDS"
                     : code == op::kDict    ? "DICT"
                                            : "SETITEMS";
  PickleNode& target = *Top();
  if (code == op::kList || code == op::kAppends) {
    for (PickleRef& item : items) AppendTo(target, std::move(item), name);
    return;
  }
  TORCH_CHECK(items.size() % 2 == 0, where(), name, " of an odd number (", items.size(), ") of keys and values");
  for (size_t i = 0; i < items.size(); i += 2) SetItemOf(target, std::move(items[i]), std::move(items[i + 1]), name);
}

void PickleMachine::StepCall(uint8_t code) {
  if (code == op::kGlobal) {  // module\nname\n
    const std::string module = Line();
    const std::string name = Line();
    Push(model_.Global(module, name));
    return;
  }
  if (code == op::kBinPersId) {
    PickleRef pid = Pop();
    Push(model_.PersistentId(pid));
    return;
  }
  PickleRef arg = Pop();  // STACK_GLOBAL's name, REDUCE's and NEWOBJ's arguments, BUILD's state
  if (code == op::kBuild) {
    model_.Build(*Top(), std::move(arg));
    return;
  }
  PickleRef callable = Pop();
  if (code == op::kStackGlobal) {
    Push(model_.StackGlobal(callable, arg));
  } else if (code == op::kReduce) {
    Push(model_.Reduce(callable, arg));
  } else {
    Push(model_.NewObj(callable, arg));
  }
}

}  // namespace fsdp::pickle
