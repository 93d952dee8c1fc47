// Pickler: the one pickle writer of the tree (torch.save's data.pkl, DCP's `.metadata`, the
// flight recorder's dumps), protocol 2, opcode by opcode. Python's pickle.load reads it, and
// so does PickleMachine (pickle_machine.h).
//
// Contract: the caller emits a well-formed opcode sequence (a MARK before each Tuple /
// Appends / SetItems, a dict's keys and values alternating); Finish() once, last. Errors
// (a str that is not UTF-8, which Python could not read back) are c10::Errors that start with
// the caller's `what`. Not thread-safe.
#ifndef FSDP_PICKLE_PICKLER_H_
#define FSDP_PICKLE_PICKLER_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "pickle/opcodes.h"

namespace fsdp::pickle {

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
  void Tuple() { Op(op::kTuple); }    // the values since the Mark
  void Tuple2() { Op(op::kTuple2); }  // the two values on top
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

}  // namespace fsdp::pickle

#endif  // FSDP_PICKLE_PICKLER_H_
