// PyValue: a pickled Python value as data, and PyValueModel, the value model (pickle_machine.h)
// that makes it from plain data: None, bool, int, float, str, tuple, list and dict. Nothing is
// ever called: GLOBAL, REDUCE, NEWOBJ, BUILD and persistent ids are errors here; a format that
// reads some (DCP's metadata: checkpoint/dcp_pickle.h) derives a model that keeps them as
// kGlobal / kObject values for its schema to check.
//
// Untrusted input: the machine's checks, every str is UTF-8 and no dict key is a list or dict
// (unhashable), as for Python's pickle.load. Errors are c10::Errors that start with the
// caller's `what`. Thread-safety: values are not changed after the read; share them freely.
#ifndef FSDP_PICKLE_PY_VALUE_H_
#define FSDP_PICKLE_PY_VALUE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "pickle/pickle_machine.h"

namespace fsdp::pickle {

struct PyValue;
using PyRef = std::shared_ptr<PyValue>;

struct PyValue : PickleNode {
  enum class Kind { kNone, kBool, kInt, kFloat, kStr, kTuple, kList, kDict, kGlobal, kObject };
  explicit PyValue(Kind k);
  const Kind kind;
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
};

// What `v` is, for error messages: "an int", "a 'torch.Size'", "the global 'torch.float32'".
std::string Describe(const PyRef& v);
// What a value of `kind` is: "an int", "a dict", "a global", "an object".
const char* Describe(PyValue::Kind kind);

// The value of a PyValue node the machine hands a model.
inline PyValue& AsPyValue(PickleNode& v) { return static_cast<PyValue&>(v); }
inline PyRef AsPyValue(PickleRef v) { return std::static_pointer_cast<PyValue>(std::move(v)); }

// Plain data. A derived model overrides Global / Reduce / Build (and the protocol-2+ opcodes
// of PickleModel) to read more.
class PyValueModel : public PickleModel {
 public:
  PickleRef None() override;
  PickleRef Bool(bool v) override;
  PickleRef Int(int64_t v) override;
  PickleRef Float(double v) override;
  PickleRef Str(std::string_view bytes) override;
  PickleRef Tuple(std::vector<PickleRef> items) override;
  PickleRef EmptyList() override;
  PickleRef EmptyDict() override;
  void Append(PickleNode& list, PickleRef item) override;
  void SetItem(PickleNode& dict, PickleRef key, PickleRef value) override;
  PickleRef Global(const std::string& module, const std::string& name) override;
  PickleRef Reduce(const PickleRef& callable, const PickleRef& args) override;
  void Build(PickleNode& object, PickleRef state) override;
};

// The plain-data value pickled in `pickle` (protocols 2 to 5; bytes after STOP are ignored,
// as pickle.load ignores them). `what` starts every error ("rank0.dump: ").
PyRef UnpicklePlainData(std::string_view pickle, const std::string& what);

}  // namespace fsdp::pickle

#endif  // FSDP_PICKLE_PY_VALUE_H_
