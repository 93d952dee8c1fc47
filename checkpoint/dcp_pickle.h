// The pickle layer of distributed-checkpoint metadata (dcp_metadata.h), internal to it: a
// validating unpickler for the protocol 2-5 pickles Python's pickle.dump writes for plain
// dataclass objects, and the pickler that writes ours.
//
// Unlike checkpoint_reader.h's unpickler (torch.save's data.pkl, turned into IValues), this
// one returns a tree of plain Python values and *uncalled* objects: `cls(*args)` (REDUCE),
// `cls.__new__(cls, *args)` (NEWOBJ) and their BUILD state are kept as data for a schema
// (dcp_metadata.cc) to validate. Nothing is ever called. Every global must be in the caller's
// allow-list, for the use it is put to; anything else is an error naming it.
//
// Untrusted input: every length, memo id and stack access is checked; containers nest at most
// 64 deep; shared references are allowed (the memo), cycles are not (a list, dict or object
// cannot be changed once it was put into another value), so the tree is a DAG of bounded depth
// whose destruction cannot overflow the stack. Errors are c10::Errors that start with
// "<source> is not a valid DCP metadata file: byte <offset>: ".
#ifndef FSDP_CHECKPOINT_DCP_PICKLE_H_
#define FSDP_CHECKPOINT_DCP_PICKLE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace fsdp::checkpoint::internal {

struct PyValue;
using PyRef = std::shared_ptr<PyValue>;

struct PyValue {
  enum class Kind { kNone, kBool, kInt, kFloat, kStr, kTuple, kList, kDict, kGlobal, kObject };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  // kStr: the text (UTF-8 bytes). kGlobal: "module.name". kObject: its class / callable.
  std::string str;
  // kTuple, kList: the items. kDict: key, value, key, value, ... in insertion order.
  std::vector<PyRef> items;
  PyRef args;            // kObject: the argument tuple of REDUCE / NEWOBJ
  PyRef state;           // kObject: BUILD's state, or null when none was given
  bool reduced = false;  // kObject: made by REDUCE (a call), not NEWOBJ (cls.__new__)
  // Bookkeeping of the unpickler: nesting depth, and whether it was put into another value.
  int depth = 1;
  bool sealed = false;
};

// What `v` is, for error messages: "an int", "a 'torch.Size'", "the global 'torch.float32'".
std::string Describe(const PyRef& v);

// The kinds of use a global may be put to.
enum GlobalUse : unsigned {
  kUseAsValue = 1,  // e.g. torch.float32, a dtype stored as is
  kUseToCall = 2,   // REDUCE: torch.Size((2, 3)), an Enum by value
  kUseToNew = 4,    // NEWOBJ: a dataclass instance, filled by BUILD
};
using GlobalAllowList = absl::flat_hash_map<std::string, unsigned>;  // "module.name" -> GlobalUse bits

// The value pickled in `data[0, size)`. Reads PROTO 2-5, FRAME, the int / float / str / None /
// bool opcodes, tuples, lists, dicts, the memo, GLOBAL / STACK_GLOBAL, REDUCE, NEWOBJ and
// BUILD; any other opcode (bytes, sets, persistent ids, NEWOBJ_EX, ...) is an error naming it.
PyRef Unpickle(const char* data, size_t size, const std::string& source, const GlobalAllowList& allowed);

// A protocol-2 pickle, written opcode by opcode (Python's pickle.load reads any protocol).
// Globals are written once and then fetched from the memo.
class Pickler {
 public:
  Pickler();
  void None() { Op('N'); }
  void Bool(bool v) { Op(v ? 0x88 : 0x89); }
  void Int(int64_t v);
  // Errors (c10::Error) if `v` is not valid UTF-8: Python could not read it back.
  void Str(std::string_view v);
  void Global(std::string_view module, std::string_view name);
  void Mark() { Op('('); }
  void EmptyTuple() { Op(')'); }
  void Tuple() { Op('t'); }  // the values since the Mark
  void EmptyList() { Op(']'); }
  void EmptyDict() { Op('}'); }
  void Appends() { Op('e'); }   // the values since the Mark onto the list below it
  void SetItems() { Op('u'); }  // the key/value pairs since the Mark into the dict below it
  void Reduce() { Op('R'); }    // callable, args tuple -> callable(*args)
  void NewObj() { Op(0x81); }   // cls, args tuple -> cls.__new__(cls, *args)
  void Build() { Op('b'); }     // object, state -> object with its state set
  // Writes STOP and returns the bytes; the pickler is empty afterwards.
  std::vector<char> Finish();

 private:
  void Op(uint8_t op) { out_.push_back(static_cast<char>(op)); }
  void Le(uint64_t v, int n);

  std::vector<char> out_;
  absl::flat_hash_map<std::string, uint32_t> memo_;  // "module\nname" -> memo id
};

}  // namespace fsdp::checkpoint::internal

#endif  // FSDP_CHECKPOINT_DCP_PICKLE_H_
