#include "checkpoint/torch_pickle.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pickle/pickle_machine.h"

namespace fsdp::checkpoint::internal {
namespace {

using pickle::PickleFormat;
using pickle::PickleMachine;
using pickle::PickleModel;
using pickle::PickleNode;
using pickle::PickleRef;

constexpr size_t kMaxDims = 64;  // tensor dimensions (as c10's SizesAndStrides handles them)

struct StorageType {
  const char* name;
  at::ScalarType dtype;
};
constexpr StorageType kStorageTypes[] = {{"FloatStorage", at::kFloat},
                                         {"DoubleStorage", at::kDouble},
                                         {"HalfStorage", at::kHalf},
                                         {"BFloat16Storage", at::kBFloat16},
                                         {"LongStorage", at::kLong},
                                         {"IntStorage", at::kInt},
                                         {"ShortStorage", at::kShort},
                                         {"CharStorage", at::kChar},
                                         {"ByteStorage", at::kByte},
                                         {"BoolStorage", at::kBool},
                                         {"ComplexFloatStorage", at::kComplexFloat},
                                         {"ComplexDoubleStorage", at::kComplexDouble}};

// The globals read: what torch.save names for tensors and state dicts, and the wrappers of
// torch.jit._pickle that LibTorch's torch::pickle_save wrote (older files of ours).
enum class TorchGlobal { kRebuildTensor, kRebuildParameter, kOrderedDict, kRestoreTypeTag, kBuildList, kStorageType };

using Shape = PickleNode::Shape;

// A value on the stack: an IValue (lists and dicts are mutable ones), or what only exists
// while unpickling (a tuple that may hold the others, a global, a storage).
struct TorchValue : PickleNode {
  enum class Kind { kIValue, kTuple, kGlobal, kStorage };
  TorchValue(Kind k, Shape s) : PickleNode(s), kind(k) {}
  const Kind kind;
  c10::IValue iv;                // kIValue; kStorage: a 1-D tensor over the whole storage
  std::vector<PickleRef> items;  // kTuple
  c10::IValue converted;         // kTuple: its IValue, made once however often it is referenced
  TorchGlobal global = TorchGlobal::kOrderedDict;
  at::ScalarType dtype = at::kFloat;  // kGlobal kStorageType
};

TorchValue& V(const PickleRef& v) { return static_cast<TorchValue&>(*v); }
TorchValue& V(PickleNode& v) { return static_cast<TorchValue&>(v); }

PickleRef Of(c10::IValue iv, Shape shape = Shape::kAtom) {
  auto v = std::make_shared<TorchValue>(TorchValue::Kind::kIValue, shape);
  v->iv = std::move(iv);
  return v;
}
bool IsIValue(const PickleRef& v) { return V(v).kind == TorchValue::Kind::kIValue; }

class TorchModel : public PickleModel {
 public:
  explicit TorchModel(const StorageLoader& load) : load_(load) {}

  c10::IValue ToIValue(const PickleRef& v);

  PickleRef None() override { return Of(c10::IValue()); }
  PickleRef Bool(bool v) override { return Of(v); }
  PickleRef Int(int64_t v) override { return Of(v); }
  PickleRef Float(double v) override { return Of(v); }
  PickleRef Str(std::string_view bytes) override { return Of(std::string(bytes)); }
  PickleRef Tuple(std::vector<PickleRef> items) override {
    auto t = std::make_shared<TorchValue>(TorchValue::Kind::kTuple, Shape::kTuple);
    t->items = std::move(items);
    return t;
  }
  PickleRef EmptyList() override { return Of(c10::impl::GenericList(c10::AnyType::get()), Shape::kList); }
  PickleRef EmptyDict() override {
    return Of(c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get()), Shape::kDict);
  }
  void Append(PickleNode& list, PickleRef item) override { V(list).iv.toList().push_back(ToIValue(item)); }
  void SetItem(PickleNode& dict, PickleRef key, PickleRef value) override {
    const c10::IValue& k = V(key).iv;
    TORCH_CHECK(IsIValue(key) && (k.isString() || k.isInt() || k.isDouble() || k.isBool()), where(),
                "a dict key is not a str, int, float or bool");
    V(dict).iv.toGenericDict().insert_or_assign(k, ToIValue(value));
  }
  PickleRef Global(const std::string& module, const std::string& name) override;
  PickleRef Reduce(const PickleRef& callable, const PickleRef& args) override;
  // Only an OrderedDict's attributes (state_dict()'s _metadata), dropped.
  void Build(PickleNode& object, PickleRef state) override {
    TORCH_CHECK(
        object.shape == Shape::kDict && IsIValue(state) && (V(state).iv.isGenericDict() || V(state).iv.isNone()),
        where(), "BUILD of something other than a dict's attributes");
  }
  PickleRef PersistentId(const PickleRef& pid) override;

 private:
  std::string where() const { return machine().where(); }
  const std::vector<PickleRef>& TupleArgs(const PickleRef& v, size_t min, size_t max, const char* of);
  int64_t IntOf(const PickleRef& v, const char* what);
  std::vector<int64_t> Ints(const PickleRef& v, const char* what);
  std::string StrOf(const PickleRef& v, const char* what);
  PickleRef RebuildTensor(const PickleRef& args);
  void CheckExtent(const at::Tensor& storage, int64_t offset, const std::vector<int64_t>& sizes,
                   const std::vector<int64_t>& strides);

  const StorageLoader& load_;
  absl::flat_hash_map<std::string, at::Tensor> storages_;
};

c10::IValue TorchModel::ToIValue(const PickleRef& v) {
  const TorchValue& t = V(v);
  switch (t.kind) {
    case TorchValue::Kind::kIValue: return t.iv;
    case TorchValue::Kind::kTuple: {
      c10::IValue& cached = V(v).converted;
      if (cached.isNone()) {
        std::vector<c10::IValue> items;
        items.reserve(t.items.size());
        for (const PickleRef& item : t.items) items.push_back(ToIValue(item));
        cached = c10::ivalue::Tuple::create(std::move(items));
      }
      return cached;
    }
    case TorchValue::Kind::kGlobal: TORCH_CHECK(false, where(), "a global (class or function) is used as a value");
    case TorchValue::Kind::kStorage:
      TORCH_CHECK(false, where(), "a bare storage is used as a value (only tensors of storages are read)");
  }
  TORCH_CHECK(false, where(), "unknown value");
}

const std::vector<PickleRef>& TorchModel::TupleArgs(const PickleRef& v, size_t min, size_t max, const char* of) {
  TORCH_CHECK(V(v).kind == TorchValue::Kind::kTuple, where(), of, " is not called with a tuple of arguments");
  const size_t n = V(v).items.size();
  TORCH_CHECK(n >= min && n <= max, where(), of, " takes ", min, min == max ? "" : absl::StrCat(" to ", max),
              " arguments, got ", n);
  return V(v).items;
}

int64_t TorchModel::IntOf(const PickleRef& v, const char* what) {
  TORCH_CHECK(IsIValue(v) && V(v).iv.isInt(), where(), what, " is not an int");
  return V(v).iv.toInt();
}

std::vector<int64_t> TorchModel::Ints(const PickleRef& v, const char* what) {
  TORCH_CHECK(V(v).kind == TorchValue::Kind::kTuple, where(), what, " is not a tuple");
  TORCH_CHECK(V(v).items.size() <= kMaxDims, where(), what, " has ", V(v).items.size(), " dimensions, more than ",
              kMaxDims);
  std::vector<int64_t> out;
  for (const PickleRef& item : V(v).items) out.push_back(IntOf(item, what));
  return out;
}

std::string TorchModel::StrOf(const PickleRef& v, const char* what) {
  TORCH_CHECK(IsIValue(v) && V(v).iv.isString(), where(), what, " is not a str");
  return V(v).iv.toStringRef();
}

PickleRef TorchModel::Global(const std::string& module, const std::string& name) {
  auto v = std::make_shared<TorchValue>(TorchValue::Kind::kGlobal, Shape::kAtom);
  if (module == "torch._utils" && name == "_rebuild_tensor_v2") {
    v->global = TorchGlobal::kRebuildTensor;
  } else if (module == "torch._utils" && name == "_rebuild_parameter") {
    v->global = TorchGlobal::kRebuildParameter;
  } else if (module == "collections" && name == "OrderedDict") {
    v->global = TorchGlobal::kOrderedDict;
  } else if (module == "torch.jit._pickle" && name == "restore_type_tag") {
    v->global = TorchGlobal::kRestoreTypeTag;
  } else if (module == "torch.jit._pickle" && (name == "build_intlist" || name == "build_doublelist" ||
                                               name == "build_boollist" || name == "build_tensorlist")) {
    v->global = TorchGlobal::kBuildList;
  } else {
    const StorageType* s = std::find_if(std::begin(kStorageTypes), std::end(kStorageTypes),
                                        [&](const StorageType& s) { return module == "torch" && name == s.name; });
    TORCH_CHECK(s != std::end(kStorageTypes), where(), "unsupported global '", module, ".", name,
                "' (checkpoints are read as tensors and plain containers only)");
    v->global = TorchGlobal::kStorageType;
    v->dtype = s->dtype;
  }
  return v;
}

// BINPERSID ('storage', <Type>Storage, key, location, numel): a storage, loaded once per key.
PickleRef TorchModel::PersistentId(const PickleRef& pid) {
  const auto& a = TupleArgs(pid, 5, 5, "a persistent id");
  const std::string kind = StrOf(a[0], "a persistent id's kind");
  TORCH_CHECK(kind == "storage", where(), "persistent id of kind '", kind, "' (only 'storage' is read)");
  TORCH_CHECK(V(a[1]).kind == TorchValue::Kind::kGlobal && V(a[1]).global == TorchGlobal::kStorageType, where(),
              "a storage's type is not a torch.<dtype>Storage");
  const at::ScalarType dtype = V(a[1]).dtype;
  const std::string key = StrOf(a[2], "a storage key");
  StrOf(a[3], "a storage location");  // any device: loaded to the CPU
  const int64_t numel = IntOf(a[4], "a storage's element count");
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_CHECK(numel >= 0 && numel <= INT64_MAX / item, where(), "storage '", key, "' has ", numel, " elements");
  auto it = storages_.find(key);
  if (it != storages_.end()) {
    const at::Tensor& t = it->second;
    TORCH_CHECK(t.scalar_type() == dtype && t.numel() == numel, where(), "storage '", key, "' is declared as ", numel,
                " ", c10::toString(dtype), " elements, and earlier as ", t.numel(), " ",
                c10::toString(t.scalar_type()));
  } else {
    it = storages_.emplace(key, load_(key, dtype, numel, where())).first;
  }
  auto v = std::make_shared<TorchValue>(TorchValue::Kind::kStorage, Shape::kAtom);
  v->iv = it->second;
  return v;
}

// Every element the view addresses lies inside its storage.
void TorchModel::CheckExtent(const at::Tensor& storage, int64_t offset, const std::vector<int64_t>& sizes,
                             const std::vector<int64_t>& strides) {
  const std::string shape = absl::StrCat("[", absl::StrJoin(sizes, ", "), "]");
  const std::string stride = absl::StrCat("[", absl::StrJoin(strides, ", "), "]");
  TORCH_CHECK(sizes.size() == strides.size(), where(), "a tensor has size ", shape, " but stride ", stride);
  TORCH_CHECK(offset >= 0 && offset <= storage.numel(), where(), "a tensor's storage offset ", offset,
              " is outside its storage of ", storage.numel(), " elements");
  int64_t extent = 1;  // the product of the sizes, zeros counted as ones: must fit int64
  bool empty = false;
  for (size_t d = 0; d < sizes.size(); ++d) {
    TORCH_CHECK(sizes[d] >= 0 && strides[d] >= 0, where(), "a tensor has size ", shape, " and stride ", stride,
                " (negative)");
    TORCH_CHECK(!__builtin_mul_overflow(extent, std::max<int64_t>(sizes[d], 1), &extent), where(), "a tensor of size ",
                shape, " has more elements than int64 counts");
    empty = empty || sizes[d] == 0;
  }
  if (empty) return;
  int64_t last = offset;  // the highest element the tensor addresses
  for (size_t d = 0; d < sizes.size(); ++d) {
    int64_t reach = 0;
    TORCH_CHECK(
        !__builtin_mul_overflow(sizes[d] - 1, strides[d], &reach) && !__builtin_add_overflow(last, reach, &last),
        where(), "a tensor of size ", shape, " and stride ", stride, " overflows int64");
  }
  TORCH_CHECK(last < storage.numel(), where(), "a tensor of size ", shape, ", stride ", stride, " and storage offset ",
              offset, " reaches element ", last, " of a storage of ", storage.numel(), " elements");
}

// _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata]).
PickleRef TorchModel::RebuildTensor(const PickleRef& args) {
  const auto& a = TupleArgs(args, 6, 7, "_rebuild_tensor_v2");
  TORCH_CHECK(V(a[0]).kind == TorchValue::Kind::kStorage, where(),
              "_rebuild_tensor_v2's first argument is not a storage");
  const at::Tensor& storage = V(a[0]).iv.toTensor();
  const int64_t offset = IntOf(a[1], "a tensor's storage offset");
  const std::vector<int64_t> sizes = Ints(a[2], "a tensor's size");
  const std::vector<int64_t> strides = Ints(a[3], "a tensor's stride");
  TORCH_CHECK(IsIValue(a[4]) && V(a[4]).iv.isBool(), where(), "a tensor's requires_grad is not a bool");
  CheckExtent(storage, offset, sizes, strides);
  at::Tensor t = at::empty({0}, storage.options());
  t.set_(storage.storage(), offset, sizes, strides);
  if (V(a[4]).iv.toBool()) {
    TORCH_CHECK(at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()), where(), "a ",
                c10::toString(t.scalar_type()), " tensor is saved with requires_grad");
    t.set_requires_grad(true);
  }
  return Of(t);
}

PickleRef TorchModel::Reduce(const PickleRef& callable, const PickleRef& args) {
  TORCH_CHECK(V(callable).kind == TorchValue::Kind::kGlobal, where(), "REDUCE calls something that is not a global");
  switch (V(callable).global) {
    case TorchGlobal::kRebuildTensor: return RebuildTensor(args);
    case TorchGlobal::kRebuildParameter: {  // (data, requires_grad, backward_hooks)
      const auto& a = TupleArgs(args, 3, 3, "_rebuild_parameter");
      TORCH_CHECK(IsIValue(a[0]) && V(a[0]).iv.isTensor(), where(), "_rebuild_parameter's data is not a tensor");
      return a[0];
    }
    case TorchGlobal::kOrderedDict: TupleArgs(args, 0, 0, "collections.OrderedDict"); return EmptyDict();
    case TorchGlobal::kRestoreTypeTag: {  // (value, type string): the value
      const auto& a = TupleArgs(args, 2, 2, "restore_type_tag");
      StrOf(a[1], "restore_type_tag's type");
      return a[0];
    }
    case TorchGlobal::kBuildList: {
      const auto& a = TupleArgs(args, 1, 1, "build_*list");
      TORCH_CHECK(IsIValue(a[0]) && V(a[0]).iv.isList(), where(), "build_*list of a non-list");
      return a[0];
    }
    case TorchGlobal::kStorageType: break;
  }
  TORCH_CHECK(false, where(), "REDUCE calls a storage type");
}

}  // namespace

const char* TorchStorageName(at::ScalarType dtype) {
  for (const StorageType& s : kStorageTypes) {
    if (s.dtype == dtype) return s.name;
  }
  return nullptr;
}

c10::IValue UnpickleTorchSave(std::string_view pickle, const std::string& what, const StorageLoader& load) {
  const PickleFormat format{.what = what,
                            .stream = "data.pkl",
                            .min_protocol = 2,
                            .max_protocol = 2,
                            .protocols = "only 2, torch.save's default, is read",
                            .noun = "container",
                            .nothing_after_stop = false};
  TorchModel model(load);
  PickleMachine machine(pickle, format, model);
  const PickleRef root = machine.Run();
  return model.ToIValue(root);
}

}  // namespace fsdp::checkpoint::internal
