// The pickle layer of checkpoint files, internal to //checkpoint: one opcode table, one
// validating opcode reader (PickleMachine) that both files' value models drive, and one
// protocol-2 writer (Pickler).
//
// The value models: torch.save's data.pkl as c10::IValues (torch_pickle.h) and DCP's
// `.metadata` as a tree of uncalled Python objects (dcp_pickle.h). The machine does what does
// not depend on what a value means; a model says what each opcode makes: atoms, containers,
// and GLOBAL / STACK_GLOBAL / REDUCE / NEWOBJ / BUILD / BINPERSID, which only it can check
// against what its format allows.
//
// Untrusted input: every operand length, memo id, MARK and stack access is checked; FRAME,
// SHORT_BINUNICODE, BINUNICODE8, STACK_GLOBAL and MEMOIZE (protocol 4) are read only where the
// format reads protocol 4. Shared references (the memo) are allowed, cycles are not: a list,
// dict or object cannot change once it is put into another value (Adopt). Values nest at most
// 64 deep. So the result is a DAG of bounded depth, whose destruction cannot overflow the
// stack. Errors are c10::Errors that start with PickleFormat::what and the opcode's offset.
#ifndef FSDP_CHECKPOINT_PICKLE_H_
#define FSDP_CHECKPOINT_PICKLE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace fsdp::checkpoint::internal {

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

// Limits on untrusted input: values nest at most this deep (PyTorch state dicts nest a few
// levels, DCP's Metadata 8), and a global's module or name is at most this long
// ("torch.distributed.checkpoint.metadata" is 37).
inline constexpr int kMaxPickleDepth = 64;
inline constexpr size_t kMaxGlobalName = 256;

// Whether `s` is UTF-8 as Python's pickle decodes str (surrogates allowed: 'surrogatepass').
bool IsUtf8(std::string_view s);

// A value on the machine's stack. Each value model derives its values from this; the machine
// keeps the bookkeeping that makes the result acyclic and bounded.
struct PickleNode {
  enum class Shape : uint8_t { kAtom, kTuple, kList, kDict, kObject };
  explicit PickleNode(Shape s) : shape(s), depth(s == Shape::kAtom ? 0 : 1) {}
  virtual ~PickleNode() = default;
  const Shape shape;
  int depth;            // containers nested in it, itself included (0: an atom)
  bool sealed = false;  // put into another value: it cannot change any more
};
using PickleRef = std::shared_ptr<PickleNode>;

// How a file's pickle is read, and how its errors read.
struct PickleFormat {
  std::string what;    // starts every error: "<source> is not a valid checkpoint: "
  std::string stream;  // the pickle's name after `what` ("data.pkl"), or "" where the file is the pickle
  int min_protocol, max_protocol;
  const char* protocols;    // the protocols read, in words, for the error naming another
  const char* noun;         // what nests, in errors: "container" or "value"
  bool nothing_after_stop;  // bytes after STOP are an error
};

class PickleMachine;

// What the opcodes make. The machine has checked the operands' shapes and adopted (sealed,
// depth-checked) the items before Append / SetItem are called; a model checks the rest (dict
// keys, globals, what REDUCE / NEWOBJ / BUILD / BINPERSID apply to) and errors with where().
class PickleModel {
 public:
  virtual ~PickleModel() = default;
  virtual PickleRef None() = 0;
  virtual PickleRef Bool(bool v) = 0;
  virtual PickleRef Int(int64_t v) = 0;
  virtual PickleRef Float(double v) = 0;
  virtual PickleRef Str(std::string_view bytes) = 0;  // unchecked bytes
  virtual PickleRef Tuple(std::vector<PickleRef> items) = 0;
  virtual PickleRef EmptyList() = 0;  // Shape::kList
  virtual PickleRef EmptyDict() = 0;  // Shape::kDict
  virtual void Append(PickleNode& list, PickleRef item) = 0;
  virtual void SetItem(PickleNode& dict, PickleRef key, PickleRef value) = 0;
  virtual PickleRef Global(const std::string& module, const std::string& name) = 0;
  virtual PickleRef Reduce(const PickleRef& callable, const PickleRef& args) = 0;
  virtual void Build(PickleNode& object, PickleRef state) = 0;  // `object`: the value below the state
  // Opcodes not every format has: by default an unsupported-opcode error.
  virtual PickleRef StackGlobal(const PickleRef& module, const PickleRef& name);
  virtual PickleRef NewObj(const PickleRef& cls, const PickleRef& args);
  virtual PickleRef PersistentId(const PickleRef& pid);

 protected:
  // The machine running this model (set while it runs): its where() and Adopt.
  PickleMachine& machine() const { return *machine_; }

 private:
  friend class PickleMachine;
  PickleMachine* machine_ = nullptr;
};

// Runs the opcodes of one pickle through a model.
class PickleMachine {
 public:
  PickleMachine(std::string_view pickle, const PickleFormat& format, PickleModel& model);
  PickleMachine(const PickleMachine&) = delete;
  PickleMachine& operator=(const PickleMachine&) = delete;
  ~PickleMachine();

  // The pickled value: PROTO, the opcodes up to STOP, exactly one value left.
  PickleRef Run();

  // The prefix of an error about the current opcode: what, stream, its offset.
  std::string where() const;
  // Puts `child` into `parent`, a container not yet put anywhere: seals `child` and checks
  // the nesting depth.
  void Adopt(PickleNode& parent, const PickleRef& child);
  [[noreturn]] void Unsupported(uint8_t code) const;

 private:
  bool Step();
  void StepAtom(uint8_t code);
  void StepMemo(uint8_t code);
  void StepContainer(uint8_t code);
  void StepCall(uint8_t code);
  uint8_t Byte();
  std::string_view Bytes(uint64_t n);
  uint64_t Le(int n);
  int64_t Long1();
  double BinFloat();
  std::string Line();
  void Push(PickleRef v) { stack_.push_back(std::move(v)); }
  PickleRef Pop();
  PickleRef& Top();
  size_t PopMark();
  std::vector<PickleRef> TakeFrom(size_t start);
  PickleRef MakeTuple(std::vector<PickleRef> items);
  void AppendTo(PickleNode& list, PickleRef item, const char* opcode);
  void SetItemOf(PickleNode& dict, PickleRef key, PickleRef value, const char* opcode);
  PickleNode& Expect(PickleNode& v, PickleNode::Shape shape, const char* opcode, const char* what);

  std::string_view in_;
  const PickleFormat& format_;
  PickleModel& model_;
  size_t pos_ = 0, op_pos_ = 0;
  std::vector<PickleRef> stack_;
  std::vector<size_t> marks_;
  absl::flat_hash_map<uint64_t, PickleRef> memo_;
};

// A protocol-2 pickle, written opcode by opcode (Python's pickle.load reads any protocol).
// Globals are written once and then fetched from the memo.
class Pickler {
 public:
  // Errors are c10::Errors that start with "<what>: ".
  explicit Pickler(std::string what);
  void None() { Op(op::kNone); }
  void Bool(bool v) { Op(v ? op::kNewTrue : op::kNewFalse); }
  void Int(int64_t v);
  void Float(double v);
  // Errors if `v` is not valid UTF-8: Python could not read it back.
  void Str(std::string_view v);
  void Global(std::string_view module, std::string_view name);
  void Mark() { Op(op::kMark); }
  void EmptyTuple() { Op(op::kEmptyTuple); }
  void Tuple() { Op(op::kTuple); }  // the values since the Mark
  void EmptyList() { Op(op::kEmptyList); }
  void EmptyDict() { Op(op::kEmptyDict); }
  void Appends() { Op(op::kAppends); }      // the values since the Mark onto the list below it
  void SetItems() { Op(op::kSetItems); }    // the key/value pairs since the Mark into the dict below it
  void Reduce() { Op(op::kReduce); }        // callable, args tuple -> callable(*args)
  void NewObj() { Op(op::kNewObj); }        // cls, args tuple -> cls.__new__(cls, *args)
  void Build() { Op(op::kBuild); }          // object, state -> object with its state set
  void BinPersId() { Op(op::kBinPersId); }  // id -> the unpickler's persistent_load(id)
  // Writes STOP and returns the bytes; the pickler is not used afterwards.
  std::vector<char> Finish();

 private:
  void Op(uint8_t code) { out_.push_back(static_cast<char>(code)); }
  void Le(uint64_t v, int n);

  const std::string what_;
  std::vector<char> out_;
  absl::flat_hash_map<std::string, uint32_t> memo_;  // "module\nname\n" -> memo id
};

}  // namespace fsdp::checkpoint::internal

#endif  // FSDP_CHECKPOINT_PICKLE_H_
