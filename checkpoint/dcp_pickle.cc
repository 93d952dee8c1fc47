#include "checkpoint/dcp_pickle.h"

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace fsdp::checkpoint::internal {
namespace {

using pickle::AsPyValue;
using pickle::kMaxGlobalName;
using pickle::PickleMachine;
using pickle::PickleNode;
using pickle::PickleRef;
using Kind = PyValue::Kind;

PyRef Make(Kind kind) { return std::make_shared<PyValue>(kind); }

// Plain data, and the allowed globals, kept uncalled.
class DcpModel : public pickle::PyValueModel {
 public:
  explicit DcpModel(const GlobalAllowList& allowed) : allowed_(allowed) {}

  PickleRef Global(const std::string& module, const std::string& name) override {
    PyRef v = Make(Kind::kGlobal);
    v->str = absl::StrCat(module, ".", name);
    TORCH_CHECK(allowed_.contains(v->str), machine().where(), "unsupported global '", v->str,
                "' (only the classes of DCP's metadata, torch.Size and torch dtypes are read)");
    v->sealed = true;
    return v;
  }
  PickleRef StackGlobal(const PickleRef& module, const PickleRef& name) override {
    const PyValue &m = AsPyValue(*module), &n = AsPyValue(*name);
    TORCH_CHECK(m.kind == Kind::kStr && n.kind == Kind::kStr, machine().where(),
                "STACK_GLOBAL of values that are not str");
    TORCH_CHECK(m.str.size() <= kMaxGlobalName && n.str.size() <= kMaxGlobalName, machine().where(),
                "a STACK_GLOBAL name of more than ", kMaxGlobalName, " bytes");
    return Global(m.str, n.str);
  }
  PickleRef Reduce(const PickleRef& callable, const PickleRef& args) override {
    return Instance(callable, args, kUseToCall, "REDUCE");
  }
  PickleRef NewObj(const PickleRef& cls, const PickleRef& args) override {
    return Instance(cls, args, kUseToNew, "NEWOBJ");
  }
  // Once per object.
  void Build(PickleNode& object, PickleRef state) override {
    TORCH_CHECK(object.shape == PickleNode::Shape::kObject, machine().where(),
                "BUILD applies to something that is not an object");
    PyValue& obj = AsPyValue(object);
    TORCH_CHECK(obj.state == nullptr, machine().where(), "a second BUILD of a '", obj.str, "'");
    machine().Adopt(obj, state);
    obj.state = AsPyValue(std::move(state));
  }

 private:
  // REDUCE / NEWOBJ: an uncalled object of the allowed global `callable`.
  PickleRef Instance(const PickleRef& callable, const PickleRef& args, unsigned use, const char* opcode) {
    const PyValue& c = AsPyValue(*callable);
    TORCH_CHECK(c.kind == Kind::kGlobal, machine().where(), opcode, " of something that is not a global");
    TORCH_CHECK(allowed_.at(c.str) & use, machine().where(), opcode, " of '", c.str, "', which is not read that way");
    TORCH_CHECK(args->shape == PickleNode::Shape::kTuple, machine().where(), opcode, " of '", c.str,
                "' without a tuple of arguments");
    PyRef obj = Make(Kind::kObject);
    obj->str = c.str;
    obj->reduced = use == kUseToCall;
    machine().Adopt(*obj, args);
    obj->args = AsPyValue(args);
    return obj;
  }

  const GlobalAllowList& allowed_;
};

}  // namespace

PyRef Unpickle(const char* data, size_t size, const std::string& source, const GlobalAllowList& allowed) {
  const pickle::PickleFormat format{.what = source + " is not a valid DCP metadata file: ",
                                    .stream = "",
                                    .min_protocol = 2,
                                    .max_protocol = 5,
                                    .protocols = "2 to 5 are read",
                                    .noun = "value",
                                    .nothing_after_stop = true};
  DcpModel model(allowed);
  PickleMachine machine(std::string_view(data, size), format, model);
  return AsPyValue(machine.Run());
}

}  // namespace fsdp::checkpoint::internal
