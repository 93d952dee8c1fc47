#include "pickle/py_value.h"

#include <c10/util/Exception.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace fsdp::pickle {
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

}  // namespace

PyValue::PyValue(Kind k) : PickleNode(ShapeOf(k)), kind(k) {}

const char* Describe(Kind kind) {
  switch (kind) {
    case Kind::kNone: return "None";
    case Kind::kBool: return "a bool";
    case Kind::kInt: return "an int";
    case Kind::kFloat: return "a float";
    case Kind::kStr: return "a str";
    case Kind::kTuple: return "a tuple";
    case Kind::kList: return "a list";
    case Kind::kDict: return "a dict";
    case Kind::kGlobal: return "a global";
    case Kind::kObject: return "an object";
  }
  return "an unknown value";
}

std::string Describe(const PyRef& v) {
  if (v->kind == Kind::kGlobal) return absl::StrCat("the global '", v->str, "'");
  if (v->kind == Kind::kObject) return absl::StrCat("a '", v->str, "'");
  return Describe(v->kind);
}

PickleRef PyValueModel::None() { return Make(Kind::kNone); }

PickleRef PyValueModel::Bool(bool v) {
  PyRef r = Make(Kind::kBool);
  r->b = v;
  return r;
}

PickleRef PyValueModel::Int(int64_t v) {
  PyRef r = Make(Kind::kInt);
  r->i = v;
  return r;
}

PickleRef PyValueModel::Float(double v) {
  PyRef r = Make(Kind::kFloat);
  r->f = v;
  return r;
}

PickleRef PyValueModel::Str(std::string_view bytes) {
  TORCH_CHECK(IsUtf8(bytes), machine().where(), "a str is not valid UTF-8");
  PyRef r = Make(Kind::kStr);
  r->str = std::string(bytes);
  return r;
}

PickleRef PyValueModel::Tuple(std::vector<PickleRef> items) {
  PyRef t = Make(Kind::kTuple);
  for (PickleRef& item : items) t->items.push_back(AsPyValue(std::move(item)));
  return t;
}

PickleRef PyValueModel::EmptyList() { return Make(Kind::kList); }
PickleRef PyValueModel::EmptyDict() { return Make(Kind::kDict); }

void PyValueModel::Append(PickleNode& list, PickleRef item) {
  AsPyValue(list).items.push_back(AsPyValue(std::move(item)));
}

void PyValueModel::SetItem(PickleNode& dict, PickleRef key, PickleRef value) {
  TORCH_CHECK(key->shape != PickleNode::Shape::kList && key->shape != PickleNode::Shape::kDict, machine().where(),
              "a dict key is a list or dict (unhashable)");
  AsPyValue(dict).items.push_back(AsPyValue(std::move(key)));
  AsPyValue(dict).items.push_back(AsPyValue(std::move(value)));
}

PickleRef PyValueModel::Global(const std::string&, const std::string&) { machine().Unsupported(op::kGlobal); }
PickleRef PyValueModel::Reduce(const PickleRef&, const PickleRef&) { machine().Unsupported(op::kReduce); }
void PyValueModel::Build(PickleNode&, PickleRef) { machine().Unsupported(op::kBuild); }

PyRef UnpicklePlainData(std::string_view pickle, const std::string& what) {
  const PickleFormat format{.what = what,
                            .stream = "",
                            .min_protocol = 2,
                            .max_protocol = 5,
                            .protocols = "2 to 5 are read",
                            .noun = "value",
                            .nothing_after_stop = false};
  PyValueModel model;
  PickleMachine machine(pickle, format, model);
  return AsPyValue(machine.Run());
}

}  // namespace fsdp::pickle
