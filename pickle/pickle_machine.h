// PickleMachine: the one validating pickle reader of the tree. It runs the opcodes of an
// untrusted pickle through a value model (PickleModel) that says what each opcode makes.
//
// The models: torch.save's data.pkl as c10::IValues (checkpoint/torch_pickle.h), DCP's
// `.metadata` as a tree of uncalled Python objects (checkpoint/dcp_pickle.h), and plain data
// (dicts, lists, str, numbers; plain_pickle.h) for flight recorder dumps. The machine does what
// does not depend on what a value means; a model says what each opcode makes: atoms,
// containers, and GLOBAL / STACK_GLOBAL / REDUCE / NEWOBJ / BUILD / BINPERSID, which only it
// can check against what its format allows.
//
// Untrusted input: every operand length, memo id, MARK and stack access is checked; FRAME,
// SHORT_BINUNICODE, BINUNICODE8, STACK_GLOBAL and MEMOIZE (protocol 4) are read only where the
// format reads protocol 4. Shared references (the memo) are allowed, cycles are not: a list,
// dict or object cannot change once it is put into another value (Adopt). Values nest at most
// kMaxPickleDepth deep. So the result is a DAG of bounded depth, whose destruction cannot
// overflow the stack.
//
// Errors: c10::Errors that start with the caller's PickleFormat::what, then the stream's name
// and the opcode's offset. Thread-safety: a machine is used by one thread; separate machines
// share nothing.
#ifndef FSDP_PICKLE_PICKLE_MACHINE_H_
#define FSDP_PICKLE_PICKLE_MACHINE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "pickle/opcodes.h"

namespace fsdp::pickle {

// Limits on untrusted input: values nest at most this deep (PyTorch state dicts nest a few
// levels, DCP's Metadata 8), and a global's module or name is at most this long
// ("torch.distributed.checkpoint.metadata" is 37).
inline constexpr int kMaxPickleDepth = 64;
inline constexpr size_t kMaxGlobalName = 256;

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
  std::string what;    // starts every error, chosen by the caller: "<source> is not a valid checkpoint: "
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

}  // namespace fsdp::pickle

#endif  // FSDP_PICKLE_PICKLE_MACHINE_H_
