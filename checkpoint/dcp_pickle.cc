#include "checkpoint/dcp_pickle.h"

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace fsdp::checkpoint::internal {
namespace {

using Kind = PyValue::Kind;

PickleNode::Shape ShapeOf(Kind kind) {
  switch (kind) {
    case Kind::kTuple: return PickleNode::Shape::kTuple;
    case Kind::kList: return PickleNode::Shape::kList;
    case Kind::kDict: return PickleNode::Shape::kDict;
    case Kind::kObject: return PickleNode::Shape::kObject;
    default: return PickleNode::Shape::kAtom;
  }
}

PyRef Make(Kind kind) { return std::make_shared<PyValue>(kind); }
PyValue& P(PickleNode& v) { return static_cast<PyValue&>(v); }
PyRef P(PickleRef v) { return std::static_pointer_cast<PyValue>(std::move(v)); }

class DcpModel : public PickleModel {
 public:
  explicit DcpModel(const GlobalAllowList& allowed) : allowed_(allowed) {}

  PickleRef None() override { return Make(Kind::kNone); }
  PickleRef Bool(bool v) override {
    PyRef r = Make(Kind::kBool);
    r->b = v;
    return r;
  }
  PickleRef Int(int64_t v) override {
    PyRef r = Make(Kind::kInt);
    r->i = v;
    return r;
  }
  PickleRef Float(double v) override {
    PyRef r = Make(Kind::kFloat);
    r->f = v;
    return r;
  }
  PickleRef Str(std::string_view bytes) override {
    TORCH_CHECK(IsUtf8(bytes), machine().where(), "a str is not valid UTF-8");
    PyRef r = Make(Kind::kStr);
    r->str = std::string(bytes);
    return r;
  }
  PickleRef Tuple(std::vector<PickleRef> items) override {
    PyRef t = Make(Kind::kTuple);
    for (PickleRef& item : items) t->items.push_back(P(std::move(item)));
    return t;
  }
  PickleRef EmptyList() override { return Make(Kind::kList); }
  PickleRef EmptyDict() override { return Make(Kind::kDict); }
  void Append(PickleNode& list, PickleRef item) override { P(list).items.push_back(P(std::move(item))); }
  void SetItem(PickleNode& dict, PickleRef key, PickleRef value) override {
    TORCH_CHECK(key->shape != PickleNode::Shape::kList && key->shape != PickleNode::Shape::kDict, machine().where(),
                "a dict key is a list or dict (unhashable)");
    P(dict).items.push_back(P(std::move(key)));
    P(dict).items.push_back(P(std::move(value)));
  }
  PickleRef Global(const std::string& module, const std::string& name) override {
    PyRef v = Make(Kind::kGlobal);
    v->str = absl::StrCat(module, ".", name);
    TORCH_CHECK(allowed_.contains(v->str), machine().where(), "unsupported global '", v->str,
                "' (only the classes of DCP's metadata, torch.Size and torch dtypes are read)");
    v->sealed = true;
    return v;
  }
  PickleRef StackGlobal(const PickleRef& module, const PickleRef& name) override {
    const PyValue &m = P(*module), &n = P(*name);
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
    PyValue& obj = P(object);
    TORCH_CHECK(obj.state == nullptr, machine().where(), "a second BUILD of a '", obj.str, "'");
    machine().Adopt(obj, state);
    obj.state = P(std::move(state));
  }

 private:
  // REDUCE / NEWOBJ: an uncalled object of the allowed global `callable`.
  PickleRef Instance(const PickleRef& callable, const PickleRef& args, unsigned use, const char* opcode) {
    const PyValue& c = P(*callable);
    TORCH_CHECK(c.kind == Kind::kGlobal, machine().where(), opcode, " of something that is not a global");
    TORCH_CHECK(allowed_.at(c.str) & use, machine().where(), opcode, " of '", c.str, "', which is not read that way");
    TORCH_CHECK(args->shape == PickleNode::Shape::kTuple, machine().where(), opcode, " of '", c.str,
                "' without a tuple of arguments");
    PyRef obj = Make(Kind::kObject);
    obj->str = c.str;
    obj->reduced = use == kUseToCall;
    machine().Adopt(*obj, args);
    obj->args = P(args);
    return obj;
  }

  const GlobalAllowList& allowed_;
};

}  // namespace

PyValue::PyValue(Kind k) : PickleNode(ShapeOf(k)), kind(k) {}

std::string Describe(const PyRef& v) {
  switch (v->kind) {
    case Kind::kNone: return "None";
    case Kind::kBool: return "a bool";
    case Kind::kInt: return "an int";
    case Kind::kFloat: return "a float";
    case Kind::kStr: return "a str";
    case Kind::kTuple: return "a tuple";
    case Kind::kList: return "a list";
    case Kind::kDict: return "a dict";
    case Kind::kGlobal: return absl::StrCat("the global '", v->str, "'");
    case Kind::kObject: return absl::StrCat("a '", v->str, "'");
  }
  return "an unknown value";
}

PyRef Unpickle(const char* data, size_t size, const std::string& source, const GlobalAllowList& allowed) {
  const PickleFormat format{.what = source + " is not a valid DCP metadata file: ",
                            .stream = "",
                            .min_protocol = 2,
                            .max_protocol = 5,
                            .protocols = "2 to 5 are read",
                            .noun = "value",
                            .nothing_after_stop = true};
  DcpModel model(allowed);
  PickleMachine machine(std::string_view(data, size), format, model);
  return P(machine.Run());
}

}  // namespace fsdp::checkpoint::internal
