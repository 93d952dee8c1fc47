#include "checkpoint/torch_unpickler.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp::checkpoint {
namespace {

constexpr int kMaxDepth = 64;    // container nesting (PyTorch state dicts nest a few levels)
constexpr size_t kMaxDims = 64;  // tensor dimensions (as c10's SizesAndStrides handles them)

// ---------------------------------------------------------------------------- pickle
enum class Global { kRebuildTensor, kRebuildParameter, kOrderedDict, kRestoreTypeTag, kBuildList, kStorageType };

struct TupleData;
// A value on the unpickler's stack: an IValue, or what only exists while unpickling (a
// tuple that may hold the others, a global, a storage).
struct Value {
  enum class Kind { kIValue, kTuple, kGlobal, kStorage } kind = Kind::kIValue;
  c10::IValue iv;                    // kIValue; kStorage: a 1-D tensor over the whole storage
  std::shared_ptr<TupleData> tuple;  // kTuple (shared: a memo reference copies no elements)
  Global global = Global::kOrderedDict;
  at::ScalarType dtype = at::kFloat;  // kGlobal kStorageType
};

struct TupleData {
  std::vector<Value> items;
  int depth = 1;
  c10::IValue converted;  // its IValue, made once however often it is referenced
};

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

class Unpickler {
 public:
  Unpickler(std::string_view pickle, const internal::CheckpointZip& zip, const std::string& what,
            internal::StorageMode mode)
      : in_(pickle), zip_(zip), what_(what), mode_(mode) {}

  // kLocate: the record of each storage read, by the storage's (meta) TensorImpl.
  const absl::flat_hash_map<const c10::StorageImpl*, std::string>& located() const { return located_; }

  c10::IValue Run() {
    TORCH_CHECK(Byte() == 0x80, where(), "does not start with a pickle PROTO opcode");
    const int protocol = Byte();
    TORCH_CHECK(protocol == 2, where(), "pickle protocol ", protocol, " (only 2, torch.save's default, is read)");
    while (Step()) {
    }
    TORCH_CHECK(stack_.size() == 1 && marks_.empty(), where(), "the pickle ends with ", stack_.size(), " values and ",
                marks_.size(), " marks on its stack instead of one value");
    return ToIValue(stack_.back());
  }

 private:
  // Prefix of every error: the source, the pickle and the opcode's offset in it.
  std::string where() const { return absl::StrCat(what_, "data.pkl byte ", op_pos_, ": "); }

  uint8_t Byte() {
    TORCH_CHECK(pos_ < in_.size(), what_, "data.pkl ends at byte ", in_.size(), " inside an opcode (truncated)");
    return static_cast<uint8_t>(in_[pos_++]);
  }
  std::string_view Bytes(uint64_t n) {
    TORCH_CHECK(n <= in_.size() - pos_, where(), "an operand of ", n, " bytes runs past the end of data.pkl (",
                in_.size() - pos_, " bytes left)");
    std::string_view out = in_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  uint64_t Le(int n) {
    uint64_t v = 0;
    const std::string_view b = Bytes(n);
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(b[i])) << (8 * i);
    return v;
  }
  std::string Line() {
    const size_t nl = in_.find('\n', pos_);
    TORCH_CHECK(nl != std::string_view::npos && nl - pos_ <= 256, where(), "a GLOBAL name is not a line");
    std::string out(in_.substr(pos_, nl - pos_));
    pos_ = nl + 1;
    return out;
  }

  Value Pop() {
    TORCH_CHECK(!stack_.empty(), where(), "opcode needs a value but the stack is empty");
    Value v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  size_t PopMark() {
    TORCH_CHECK(!marks_.empty(), where(), "opcode needs a MARK but there is none");
    const size_t mark = marks_.back();
    marks_.pop_back();
    TORCH_CHECK(mark <= stack_.size(), where(), "its MARK at stack depth ", mark, " lies above the stack (",
                stack_.size(), " values)");
    return mark;
  }
  static Value Of(c10::IValue iv) {
    Value v;
    v.iv = std::move(iv);
    return v;
  }

  // Every list and dict made while unpickling, kept alive until the end (so its address
  // names it), with its nesting depth and whether it was put into another container.
  struct Container {
    c10::IValue keep_alive;
    int depth = 1;
    bool sealed = false;
  };
  Container* Find(const Value& v) {
    if (v.kind != Value::Kind::kIValue || !(v.iv.isList() || v.iv.isGenericDict())) return nullptr;
    auto it = containers_.find(v.iv.internalToPointer());
    TORCH_CHECK(it != containers_.end(), where(), "unknown container");
    return &it->second;
  }
  int Depth(const Value& v) {
    if (v.kind == Value::Kind::kTuple) return v.tuple->depth;
    const Container* c = Find(v);
    return c ? c->depth : 0;
  }
  void CheckDepth(int depth) const {
    TORCH_CHECK(depth <= kMaxDepth, where(), "containers nest ", depth, " deep, more than ", kMaxDepth);
  }
  Value NewContainer(c10::IValue iv) {
    containers_[iv.internalToPointer()] = Container{iv};
    return Of(std::move(iv));
  }

  c10::IValue ToIValue(const Value& v) {
    switch (v.kind) {
      case Value::Kind::kIValue: return v.iv;
      case Value::Kind::kTuple: {
        if (v.tuple->converted.isNone()) {
          std::vector<c10::IValue> items;
          items.reserve(v.tuple->items.size());
          for (const Value& item : v.tuple->items) items.push_back(ToIValue(item));
          v.tuple->converted = c10::ivalue::Tuple::create(std::move(items));
        }
        return v.tuple->converted;
      }
      case Value::Kind::kGlobal: TORCH_CHECK(false, where(), "a global (class or function) is used as a value");
      case Value::Kind::kStorage:
        TORCH_CHECK(false, where(), "a bare storage is used as a value (only tensors of storages are read)");
    }
    TORCH_CHECK(false, where(), "unknown value");
  }

  // Puts `child` into the mutable container `parent` (`parent` != `child`); afterwards
  // `child` (if a container) is sealed: it can be shared but not mutated, so no cycle forms
  // and the depth computed here stays right.
  c10::IValue Adopt(const Value& parent, const Value& child) {
    Container* p = Find(parent);
    TORCH_CHECK(!p->sealed, where(),
                "the pickle modifies a container after putting it into another "
                "(recursive structures are not read)");
    TORCH_CHECK(Find(child) != p, where(), "the pickle puts a container into itself");
    const int depth = std::max(p->depth, Depth(child) + 1);
    CheckDepth(depth);
    p->depth = depth;
    Seal(child);
    return ToIValue(child);
  }
  void Seal(const Value& v) {
    if (Container* c = Find(v)) c->sealed = true;
  }

  Value MakeTuple(std::vector<Value> items) {
    auto t = std::make_shared<TupleData>();
    for (const Value& item : items) {
      t->depth = std::max(t->depth, Depth(item) + 1);
      Seal(item);
    }
    CheckDepth(t->depth);
    t->items = std::move(items);
    Value v;
    v.kind = Value::Kind::kTuple;
    v.tuple = std::move(t);
    return v;
  }
  std::vector<Value> TakeFrom(size_t start) {
    std::vector<Value> items(std::make_move_iterator(stack_.begin() + start), std::make_move_iterator(stack_.end()));
    stack_.resize(start);
    return items;
  }

  Value& ListAt(Value& v) {
    TORCH_CHECK(v.kind == Value::Kind::kIValue && v.iv.isList(), where(), "appends to something that is not a list");
    return v;
  }
  Value& DictAt(Value& v) {
    TORCH_CHECK(v.kind == Value::Kind::kIValue && v.iv.isGenericDict(), where(),
                "sets an item of something that is not a dict");
    return v;
  }
  void Append(Value& list, const Value& item) {
    c10::IValue iv = Adopt(list, item);
    list.iv.toList().push_back(std::move(iv));
  }
  void SetItem(Value& dict, const Value& key, const Value& value) {
    TORCH_CHECK(key.kind == Value::Kind::kIValue &&
                    (key.iv.isString() || key.iv.isInt() || key.iv.isDouble() || key.iv.isBool()),
                where(), "a dict key is not a str, int, float or bool");
    c10::IValue iv = Adopt(dict, value);
    dict.iv.toGenericDict().insert_or_assign(key.iv, std::move(iv));
  }

  const std::vector<Value>& TupleArgs(const Value& v, size_t min, size_t max, const char* of) {
    TORCH_CHECK(v.kind == Value::Kind::kTuple, where(), of, " is not called with a tuple of arguments");
    const size_t n = v.tuple->items.size();
    TORCH_CHECK(n >= min && n <= max, where(), of, " takes ", min, min == max ? "" : absl::StrCat(" to ", max),
                " arguments, got ", n);
    return v.tuple->items;
  }
  int64_t Int(const Value& v, const char* what) {
    TORCH_CHECK(v.kind == Value::Kind::kIValue && v.iv.isInt(), where(), what, " is not an int");
    return v.iv.toInt();
  }
  std::vector<int64_t> Ints(const Value& v, const char* what) {
    TORCH_CHECK(v.kind == Value::Kind::kTuple, where(), what, " is not a tuple");
    TORCH_CHECK(v.tuple->items.size() <= kMaxDims, where(), what, " has ", v.tuple->items.size(),
                " dimensions, more than ", kMaxDims);
    std::vector<int64_t> out;
    for (const Value& item : v.tuple->items) out.push_back(Int(item, what));
    return out;
  }
  std::string Str(const Value& v, const char* what) {
    TORCH_CHECK(v.kind == Value::Kind::kIValue && v.iv.isString(), where(), what, " is not a str");
    return v.iv.toStringRef();
  }

  Value GlobalNamed(const std::string& module, const std::string& name) {
    Value v;
    v.kind = Value::Kind::kGlobal;
    if (module == "torch._utils" && name == "_rebuild_tensor_v2") {
      v.global = Global::kRebuildTensor;
    } else if (module == "torch._utils" && name == "_rebuild_parameter") {
      v.global = Global::kRebuildParameter;
    } else if (module == "collections" && name == "OrderedDict") {
      v.global = Global::kOrderedDict;
    } else if (module == "torch.jit._pickle" && name == "restore_type_tag") {
      v.global = Global::kRestoreTypeTag;
    } else if (module == "torch.jit._pickle" && (name == "build_intlist" || name == "build_doublelist" ||
                                                 name == "build_boollist" || name == "build_tensorlist")) {
      v.global = Global::kBuildList;
    } else {
      bool found = false;
      for (const StorageType& s : kStorageTypes) {
        if (module == "torch" && name == s.name) {
          v.global = Global::kStorageType;
          v.dtype = s.dtype;
          found = true;
        }
      }
      TORCH_CHECK(found, where(), "unsupported global '", module, ".", name,
                  "' (checkpoints are read as tensors and plain containers only)");
    }
    return v;
  }

  // BINPERSID ('storage', <dtype>Storage, key, location, numel): the record data/<key>.
  Value LoadStorage(const Value& pid) {
    const auto& a = TupleArgs(pid, 5, 5, "a persistent id");
    TORCH_CHECK(Str(a[0], "a persistent id's kind") == "storage", where(), "persistent id of kind '",
                a[0].iv.toStringRef(), "' (only 'storage' is read)");
    TORCH_CHECK(a[1].kind == Value::Kind::kGlobal && a[1].global == Global::kStorageType, where(),
                "a storage's type is not a torch.<dtype>Storage");
    const at::ScalarType dtype = a[1].dtype;
    const std::string key = Str(a[2], "a storage key");
    Str(a[3], "a storage location");  // any device: loaded to the CPU
    const int64_t numel = Int(a[4], "a storage's element count");
    const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
    TORCH_CHECK(numel >= 0 && numel <= INT64_MAX / item, where(), "storage '", key, "' has ", numel, " elements");
    auto cached = storages_.find(key);
    if (cached != storages_.end()) {
      const at::Tensor& t = cached->second;
      TORCH_CHECK(t.scalar_type() == dtype && t.numel() == numel, where(), "storage '", key, "' is declared as ", numel,
                  " ", c10::toString(dtype), " elements, and earlier as ", t.numel(), " ",
                  c10::toString(t.scalar_type()));
      Value v = Of(t);
      v.kind = Value::Kind::kStorage;
      return v;
    }
    std::string_view bytes;
    const std::string record = absl::StrCat(zip_.archive(), "/data/", key);
    if (numel > 0 && mode_ == internal::StorageMode::kLocate) {  // checked here, read by the caller
      TORCH_CHECK(zip_.Has(record), where(), "storage '", key, "' has no record '", record, "'");
      const uint64_t size = zip_.Find(record).size;
      TORCH_CHECK(size == static_cast<uint64_t>(numel * item), where(), "storage '", key, "' is declared as ", numel,
                  " ", c10::toString(dtype), " elements (", numel * item, " bytes) but its record '", record,
                  "' holds ", size, " bytes");
    } else if (numel > 0) {  // as LibTorch: no record is needed for an empty storage
      TORCH_CHECK(zip_.Has(record), where(), "storage '", key, "' has no record '", record, "'");
      bytes = zip_.Read(record);
      TORCH_CHECK(static_cast<uint64_t>(bytes.size()) == static_cast<uint64_t>(numel * item), where(), "storage '", key,
                  "' is declared as ", numel, " ", c10::toString(dtype), " elements (", numel * item,
                  " bytes) but its record '", record, "' holds ", bytes.size(), " bytes");
      if (dtype == at::kBool) {
        for (size_t i = 0; i < bytes.size(); ++i) {
          TORCH_CHECK(static_cast<uint8_t>(bytes[i]) <= 1, where(), "bool storage '", key, "' holds byte ",
                      static_cast<int>(static_cast<uint8_t>(bytes[i])), " at element ", i);
        }
      }
    }
    at::Tensor t;
    if (mode_ == internal::StorageMode::kLocate) {
      t = at::empty({numel}, at::TensorOptions(dtype).device(at::kMeta));
      if (numel > 0) located_.emplace(t.storage().unsafeGetStorageImpl(), record);
    } else if (mode_ == internal::StorageMode::kAlias && numel > 0) {
      // ReadCheckpointAliasing: the caller keeps `data` alive.
      t = at::from_blob(const_cast<char*>(bytes.data()), {numel}, at::TensorOptions(dtype));
    } else {
      t = at::empty({numel}, at::TensorOptions(dtype));  // numel * item bytes: checked above
      if (numel > 0) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    }
    storages_.emplace(key, t);
    Value v = Of(t);
    v.kind = Value::Kind::kStorage;
    return v;
  }

  // _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata]).
  Value RebuildTensor(const Value& args) {
    const auto& a = TupleArgs(args, 6, 7, "_rebuild_tensor_v2");
    TORCH_CHECK(a[0].kind == Value::Kind::kStorage, where(), "_rebuild_tensor_v2's first argument is not a storage");
    const at::Tensor& storage = a[0].iv.toTensor();
    const int64_t offset = Int(a[1], "a tensor's storage offset");
    const std::vector<int64_t> sizes = Ints(a[2], "a tensor's size");
    const std::vector<int64_t> strides = Ints(a[3], "a tensor's stride");
    TORCH_CHECK(a[4].kind == Value::Kind::kIValue && a[4].iv.isBool(), where(),
                "a tensor's requires_grad is not a bool");
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
      TORCH_CHECK(!__builtin_mul_overflow(extent, std::max<int64_t>(sizes[d], 1), &extent), where(),
                  "a tensor of size ", shape, " has more elements than int64 counts");
      empty = empty || sizes[d] == 0;
    }
    int64_t last = offset;  // the highest element the tensor addresses
    if (!empty) {
      for (size_t d = 0; d < sizes.size(); ++d) {
        int64_t reach = 0;
        TORCH_CHECK(
            !__builtin_mul_overflow(sizes[d] - 1, strides[d], &reach) && !__builtin_add_overflow(last, reach, &last),
            where(), "a tensor of size ", shape, " and stride ", stride, " overflows int64");
      }
      TORCH_CHECK(last < storage.numel(), where(), "a tensor of size ", shape, ", stride ", stride,
                  " and storage offset ", offset, " reaches element ", last, " of a storage of ", storage.numel(),
                  " elements");
    }
    at::Tensor t = at::empty({0}, storage.options());
    t.set_(storage.storage(), offset, sizes, strides);
    if (a[4].iv.toBool()) {
      TORCH_CHECK(at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()), where(), "a ",
                  c10::toString(t.scalar_type()), " tensor is saved with requires_grad");
      t.set_requires_grad(true);
    }
    return Of(t);
  }

  Value Reduce(const Value& callable, const Value& args) {
    TORCH_CHECK(callable.kind == Value::Kind::kGlobal, where(), "REDUCE calls something that is not a global");
    switch (callable.global) {
      case Global::kRebuildTensor: return RebuildTensor(args);
      case Global::kRebuildParameter: {  // (data, requires_grad, backward_hooks)
        const auto& a = TupleArgs(args, 3, 3, "_rebuild_parameter");
        TORCH_CHECK(a[0].kind == Value::Kind::kIValue && a[0].iv.isTensor(), where(),
                    "_rebuild_parameter's data is not a tensor");
        return a[0];
      }
      case Global::kOrderedDict:
        TupleArgs(args, 0, 0, "collections.OrderedDict");
        return NewContainer(c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get()));
      case Global::kRestoreTypeTag: {  // (value, type string): the value
        const auto& a = TupleArgs(args, 2, 2, "restore_type_tag");
        Str(a[1], "restore_type_tag's type");
        return a[0];
      }
      case Global::kBuildList: {
        const auto& a = TupleArgs(args, 1, 1, "build_*list");
        TORCH_CHECK(a[0].kind == Value::Kind::kIValue && a[0].iv.isList(), where(), "build_*list of a non-list");
        return a[0];
      }
      case Global::kStorageType: break;
    }
    TORCH_CHECK(false, where(), "REDUCE calls a storage type");
  }

  bool Step() {
    op_pos_ = pos_;
    const uint8_t op = Byte();
    switch (op) {
      case '.': return false;                            // STOP
      case '(': marks_.push_back(stack_.size()); break;  // MARK
      case ')': stack_.push_back(MakeTuple({})); break;
      case ']': stack_.push_back(NewContainer(c10::impl::GenericList(c10::AnyType::get()))); break;
      case '}': stack_.push_back(NewContainer(c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get()))); break;
      case 'N': stack_.push_back(Of(c10::IValue())); break;
      case 0x88: stack_.push_back(Of(true)); break;
      case 0x89: stack_.push_back(Of(false)); break;
      case 'K': stack_.push_back(Of(static_cast<int64_t>(Le(1)))); break;
      case 'M': stack_.push_back(Of(static_cast<int64_t>(Le(2)))); break;
      case 'J': stack_.push_back(Of(static_cast<int64_t>(static_cast<int32_t>(Le(4))))); break;
      case 0x8a: {  // LONG1: n little-endian two's-complement bytes
        const int n = Byte();
        TORCH_CHECK(n <= 8, where(), "an integer of ", n, " bytes does not fit int64");
        uint64_t v = Le(n);
        if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);
        stack_.push_back(Of(static_cast<int64_t>(v)));
        break;
      }
      case 'G': {  // BINFLOAT, big-endian
        uint64_t bits = 0;
        for (char c : Bytes(8)) bits = (bits << 8) | static_cast<uint8_t>(c);
        double d;
        std::memcpy(&d, &bits, 8);
        stack_.push_back(Of(d));
        break;
      }
      case 'X': {  // BINUNICODE
        const uint64_t n = Le(4);
        stack_.push_back(Of(std::string(Bytes(n))));
        break;
      }
      case 'q':
      case 'r': {  // BINPUT, LONG_BINPUT
        const uint64_t id = Le(op == 'q' ? 1 : 4);
        TORCH_CHECK(!stack_.empty(), where(), "BINPUT with an empty stack");
        memo_[id] = stack_.back();
        break;
      }
      case 'h':
      case 'j': {  // BINGET, LONG_BINGET
        const uint64_t id = Le(op == 'h' ? 1 : 4);
        auto it = memo_.find(id);
        TORCH_CHECK(it != memo_.end(), where(), "BINGET of memo entry ", id, ", which was never stored");
        stack_.push_back(it->second);
        break;
      }
      case 't': stack_.push_back(MakeTuple(TakeFrom(PopMark()))); break;
      case 0x85:
      case 0x86:
      case 0x87: {  // TUPLE1..3
        const size_t n = op - 0x84;
        TORCH_CHECK(stack_.size() >= n, where(), "TUPLE", n, " with ", stack_.size(), " values on the stack");
        stack_.push_back(MakeTuple(TakeFrom(stack_.size() - n)));
        break;
      }
      case 'l':
      case 'd': {  // LIST, DICT
        std::vector<Value> items = TakeFrom(PopMark());
        if (op == 'l') {
          Value list = NewContainer(c10::impl::GenericList(c10::AnyType::get()));
          for (const Value& item : items) Append(list, item);
          stack_.push_back(std::move(list));
        } else {
          TORCH_CHECK(items.size() % 2 == 0, where(), "DICT of an odd number (", items.size(), ") of keys and values");
          Value dict = NewContainer(c10::impl::GenericDict(c10::AnyType::get(), c10::AnyType::get()));
          for (size_t i = 0; i < items.size(); i += 2) SetItem(dict, items[i], items[i + 1]);
          stack_.push_back(std::move(dict));
        }
        break;
      }
      case 'a': {  // APPEND
        Value item = Pop();
        TORCH_CHECK(!stack_.empty(), where(), "APPEND without a list");
        Append(ListAt(stack_.back()), item);
        break;
      }
      case 'e':
      case 'u': {  // APPENDS, SETITEMS
        const size_t mark = PopMark();
        TORCH_CHECK(mark > 0, where(), "APPENDS / SETITEMS without a container below its MARK");
        std::vector<Value> items = TakeFrom(mark);
        Value& target = stack_.back();
        if (op == 'e') {
          ListAt(target);
          for (const Value& item : items) Append(target, item);
        } else {
          DictAt(target);
          TORCH_CHECK(items.size() % 2 == 0, where(), "SETITEMS of an odd number (", items.size(),
                      ") of keys and values");
          for (size_t i = 0; i < items.size(); i += 2) SetItem(target, items[i], items[i + 1]);
        }
        break;
      }
      case 's': {  // SETITEM
        TORCH_CHECK(stack_.size() >= 3, where(), "SETITEM with ", stack_.size(), " values on the stack");
        Value value = Pop(), key = Pop();
        SetItem(DictAt(stack_.back()), key, value);
        break;
      }
      case 'c': {  // GLOBAL
        const std::string module = Line();
        const std::string name = Line();
        stack_.push_back(GlobalNamed(module, name));
        break;
      }
      case 'R': {  // REDUCE
        Value args = Pop(), callable = Pop();
        stack_.push_back(Reduce(callable, args));
        break;
      }
      case 'b': {  // BUILD: only an OrderedDict's attributes (state_dict()'s _metadata), dropped
        Value state = Pop();
        TORCH_CHECK(!stack_.empty() && stack_.back().kind == Value::Kind::kIValue && stack_.back().iv.isGenericDict() &&
                        state.kind == Value::Kind::kIValue && (state.iv.isGenericDict() || state.iv.isNone()),
                    where(), "BUILD of something other than a dict's attributes");
        break;
      }
      case 'Q': {  // BINPERSID
        Value pid = Pop();
        stack_.push_back(LoadStorage(pid));
        break;
      }
      default:
        TORCH_CHECK(false, where(), "unsupported pickle opcode ", absl::StrCat("0x", absl::Hex(op)), " ('",
                    std::isprint(op) ? std::string(1, static_cast<char>(op)) : std::string("?"), "')");
    }
    return true;
  }

  std::string_view in_;
  const internal::CheckpointZip& zip_;
  const std::string& what_;
  const internal::StorageMode mode_;
  size_t pos_ = 0, op_pos_ = 0;
  std::vector<Value> stack_;
  std::vector<size_t> marks_;
  absl::flat_hash_map<uint64_t, Value> memo_;
  absl::flat_hash_map<const void*, Container> containers_;
  absl::flat_hash_map<std::string, at::Tensor> storages_;
  absl::flat_hash_map<const c10::StorageImpl*, std::string> located_;
};

}  // namespace

namespace internal {

Unpickled UnpickleTorchSave(std::string_view pickle, const CheckpointZip& zip, const std::string& what,
                            StorageMode mode) {
  Unpickler unpickler(pickle, zip, what, mode);
  Unpickled out;
  out.value = unpickler.Run();
  out.located = unpickler.located();
  return out;
}

}  // namespace internal
}  // namespace fsdp::checkpoint
