// The value model of distributed-checkpoint metadata (dcp_metadata.h) on the pickle machine
// (pickle/pickle_machine.h), internal to //checkpoint: the protocol 2-5 pickles Python's
// pickle.dump writes for plain dataclass objects, as a tree of plain Python values
// (pickle/py_value.h) and *uncalled* objects.
//
// Unlike torch.save's model (torch_pickle.h, which makes IValues), `cls(*args)` (REDUCE),
// `cls.__new__(cls, *args)` (NEWOBJ) and their BUILD state are kept as data for a schema
// (dcp_metadata.cc) to validate. Nothing is ever called. Every global must be in the caller's
// allow-list, for the use it is put to; anything else is an error naming it. The writer of
// these pickles is pickle/pickler.h's Pickler (dcp_metadata_writer.cc).
//
// Untrusted input: the machine's checks (pickle/pickle_machine.h), and every str is UTF-8. Errors are
// c10::Errors that start with "<source> is not a valid DCP metadata file: byte <offset>: ".
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
#include "pickle/py_value.h"

namespace fsdp::checkpoint::internal {

using pickle::Describe;
using pickle::PyRef;
using pickle::PyValue;

// The kinds of use a global may be put to.
enum GlobalUse : unsigned {
  kUseAsValue = 1,  // e.g. torch.float32, a dtype stored as is
  kUseToCall = 2,   // REDUCE: torch.Size((2, 3)), an Enum by value
  kUseToNew = 4,    // NEWOBJ: a dataclass instance, filled by BUILD
};
using GlobalAllowList = absl::flat_hash_map<std::string, unsigned>;  // "module.name" -> GlobalUse bits

// The value pickled in `data[0, size)`. Reads PROTO 2-5, FRAME, the int / float / str / None /
// bool opcodes, tuples, lists, dicts, the memo, GLOBAL / STACK_GLOBAL, REDUCE, NEWOBJ and
// BUILD; any other opcode (bytes, sets, persistent ids, NEWOBJ_EX, ...) is an error naming it,
// as are bytes after STOP.
PyRef Unpickle(const char* data, size_t size, const std::string& source, const GlobalAllowList& allowed);

}  // namespace fsdp::checkpoint::internal

#endif  // FSDP_CHECKPOINT_DCP_PICKLE_H_
