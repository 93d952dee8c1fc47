#include "checkpoint/dcp_metadata.h"

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/dcp_pickle.h"

namespace fsdp::checkpoint {
namespace {

using internal::PyRef;
using internal::PyValue;
using Kind = PyValue::Kind;

constexpr size_t kMaxDims = 64;
// The modules of the classes torch/distributed/checkpoint/metadata.py and filesystem.py define.

struct DtypeName {
  at::ScalarType dtype;
  const char* name;
};
// The dtypes checkpoint_reader.h reads (what a .distcp item may hold), by their torch names.
// clang-format off
constexpr DtypeName kDtypes[] = {
    {at::kFloat, "float32"}, {at::kDouble, "float64"}, {at::kHalf, "float16"}, {at::kBFloat16, "bfloat16"},
    {at::kLong, "int64"}, {at::kInt, "int32"}, {at::kShort, "int16"}, {at::kChar, "int8"}, {at::kByte, "uint8"},
    {at::kBool, "bool"}, {at::kComplexFloat, "complex64"}, {at::kComplexDouble, "complex128"}};
// clang-format on

const char* FindDtypeName(at::ScalarType dtype) {
  for (const DtypeName& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  return nullptr;
}

const internal::GlobalAllowList& AllowList() {
  static const auto* allowed = [] {
    auto* a = new internal::GlobalAllowList;
    for (const char* cls : {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                            "ChunkStorageMetadata", "MetadataIndex", "StorageMeta"}) {
      (*a)[absl::StrCat(internal::kDcpMetadataModule, ".", cls)] = internal::kUseToNew;
    }
    (*a)[absl::StrCat(internal::kDcpFilesystemModule, "._StorageInfo")] = internal::kUseToNew;
    (*a)[absl::StrCat(internal::kDcpMetadataModule, "._MEM_FORMAT_ENCODING")] =
        internal::kUseToCall;  // an Enum, by value
    (*a)["torch.Size"] = internal::kUseToCall;
    (*a)["torch.serialization._get_layout"] = internal::kUseToCall;  // how torch.layout pickles
    (*a)["pathlib.PosixPath"] = internal::kUseToCall;                // StorageMeta.checkpoint_id
    for (const DtypeName& d : kDtypes) (*a)[absl::StrCat("torch.", d.name)] = internal::kUseAsValue;
    return a;
  }();
  return *allowed;
}

// Bounds and overflow checks of one entry, shared by the reader and the writer; `what` is the
// error prefix.
void ValidateStorage(const DcpStorageInfo& s, const std::string& what, const std::string& item) {
  const std::string& p = s.relative_path;
  TORCH_CHECK(
      !p.empty() && p != "." && p != ".." && p.find('/') == std::string::npos && p.find('\0') == std::string::npos,
      what, item, " is stored in '", p, "', which is not a file name inside the checkpoint directory");
  int64_t end = 0;
  TORCH_CHECK(s.offset >= 0 && s.length >= 0 && !__builtin_add_overflow(s.offset, s.length, &end), what, item,
              " is stored at offset ", s.offset, " with length ", s.length, " of '", p, "'");
}

bool Overlap(const DcpChunk& a, const DcpChunk& b) {
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    if (a.offsets[d] >= b.offsets[d] + b.sizes[d] || b.offsets[d] >= a.offsets[d] + a.sizes[d]) return false;
  }
  return true;
}

void ValidateTensor(const DcpEntry& e, const std::string& what, bool storage) {
  const std::string name = absl::StrCat("tensor '", e.fqn, "'");
  TORCH_CHECK(FindDtypeName(e.properties.dtype) != nullptr, what, name, " is ", c10::toString(e.properties.dtype),
              ", a dtype DCP files here do not hold");
  TORCH_CHECK(e.properties.memory_format >= 0 && e.properties.memory_format <= 2, what, name,
              " has memory-format encoding ", e.properties.memory_format, " (0, 1 or 2)");
  TORCH_CHECK(e.size.size() <= kMaxDims, what, name, " has ", e.size.size(), " dimensions, more than ", kMaxDims);
  int64_t numel = 1;
  for (int64_t s : e.size) {
    TORCH_CHECK(s >= 0, what, name, " has size ", c10::str(c10::IntArrayRef(e.size)), " (negative)");
    TORCH_CHECK(!__builtin_mul_overflow(numel, s, &numel), what, name, " of size ", c10::str(c10::IntArrayRef(e.size)),
                " has more elements than int64 counts");
  }
  int64_t bytes = 0;
  TORCH_CHECK(!__builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(e.properties.dtype)), &bytes), what,
              name, " of size ", c10::str(c10::IntArrayRef(e.size)), " has more bytes than int64 counts");
  if (e.properties.strides) {
    TORCH_CHECK(e.properties.strides->size() <= kMaxDims, what, name, " has ", e.properties.strides->size(),
                " strides");
    for (int64_t s : *e.properties.strides) TORCH_CHECK(s >= 0, what, name, " has a negative stride ", s);
  }
  std::set<std::vector<int64_t>> starts;
  for (size_t c = 0; c < e.chunks.size(); ++c) {
    const DcpChunk& k = e.chunks[c];
    const std::string chunk =
        absl::StrCat("the chunk of '", e.fqn, "' at offsets ", c10::str(c10::IntArrayRef(k.offsets)), " of size ",
                     c10::str(c10::IntArrayRef(k.sizes)));
    TORCH_CHECK(k.offsets.size() == e.size.size() && k.sizes.size() == e.size.size(), what, chunk,
                " does not have the tensor's ", e.size.size(), " dimensions");
    for (size_t d = 0; d < e.size.size(); ++d) {
      int64_t end = 0;
      TORCH_CHECK(k.offsets[d] >= 0 && k.sizes[d] >= 0 && !__builtin_add_overflow(k.offsets[d], k.sizes[d], &end) &&
                      end <= e.size[d],
                  what, chunk, " lies outside the tensor's size ", c10::str(c10::IntArrayRef(e.size)));
    }
    TORCH_CHECK(starts.insert(k.offsets).second, what, name, " has two chunks at offsets ",
                c10::str(c10::IntArrayRef(k.offsets)));
    if (storage) ValidateStorage(k.storage, what, chunk);
  }
  // Overlap: sweep along the largest dimension, as DCP's _validate_global_plan
  // (torch/distributed/checkpoint/default_planner.py); empty chunks overlap nothing.
  if (e.chunks.size() < 2 || e.size.empty()) return;
  const size_t sweep = std::max_element(e.size.begin(), e.size.end()) - e.size.begin();
  std::vector<size_t> order;
  for (size_t c = 0; c < e.chunks.size(); ++c) {
    const auto& sizes = e.chunks[c].sizes;
    if (std::find(sizes.begin(), sizes.end(), 0) == sizes.end()) order.push_back(c);
  }
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return e.chunks[a].offsets[sweep] < e.chunks[b].offsets[sweep]; });
  std::vector<size_t> active;
  for (size_t c : order) {
    const DcpChunk& k = e.chunks[c];
    std::erase_if(active,
                  [&](size_t o) { return e.chunks[o].offsets[sweep] + e.chunks[o].sizes[sweep] <= k.offsets[sweep]; });
    for (size_t o : active) {
      TORCH_CHECK(!Overlap(k, e.chunks[o]), what, name, " has overlapping chunks at offsets ",
                  c10::str(c10::IntArrayRef(e.chunks[o].offsets)), " (size ",
                  c10::str(c10::IntArrayRef(e.chunks[o].sizes)), ") and ", c10::str(c10::IntArrayRef(k.offsets)),
                  " (size ", c10::str(c10::IntArrayRef(k.sizes)), ")");
    }
    active.push_back(c);
  }
}

// The checks of ValidateDcpMetadata; `storage`: of the storage infos too.
void Validate(const DcpMetadata& m, const std::string& what, bool storage) {
  absl::flat_hash_set<std::string> fqns;
  for (const DcpEntry& e : m.entries) {
    TORCH_CHECK(fqns.insert(e.fqn).second, what, "two entries are named '", e.fqn, "'");
    if (e.is_bytes) {
      TORCH_CHECK(e.chunks.empty() && e.size.empty(), what, "bytes entry '", e.fqn, "' has a tensor size or chunks");
      if (storage) ValidateStorage(e.bytes_storage, what, absl::StrCat("bytes entry '", e.fqn, "'"));
    } else {
      ValidateTensor(e, what, storage);
    }
  }
}

// ------------------------------------------------------------------------- reading
class Reader {
 public:
  explicit Reader(const std::string& source) : what_(source + " is not a valid DCP metadata file: ") {}

  DcpMetadata Read(const PyRef& root) {
    DcpMetadata m;
    auto f =
        Fields(root, "Metadata", {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"},
               "the pickled value");
    TORCH_CHECK(f.count("state_dict_metadata") && f.count("storage_data"), what_,
                "Metadata has no state_dict_metadata or no storage_data");
    const PyValue& sd = Dict(f["state_dict_metadata"], "state_dict_metadata");
    for (size_t i = 0; i < sd.items.size(); i += 2) {
      DcpEntry e;
      e.fqn = Str(sd.items[i], "a state_dict_metadata key");
      ReadEntry(sd.items[i + 1], absl::StrCat("state_dict_metadata['", e.fqn, "']"), e);
      m.entries.push_back(std::move(e));
    }
    Validate(m, what_, /*storage=*/false);  // the join below relies on unique FQNs and offsets
    ReadStorageData(f["storage_data"], m);
    m.has_planner_data = f.count("planner_data") && f["planner_data"]->kind != Kind::kNone;
    if (m.has_planner_data) ReadPlannerData(f["planner_data"], m);
    if (f.count("storage_meta") && f["storage_meta"]->kind != Kind::kNone) {
      m.storage_meta = ReadStorageMeta(f["storage_meta"]);
    }
    if (f.count("version") && f["version"]->kind != Kind::kNone) {
      m.version = Str(f["version"], "version");
      TORCH_CHECK(*m.version == kDcpVersion, what_, "DCP version '", *m.version, "' (this reader knows ", kDcpVersion,
                  ")");
    }
    return m;
  }

 private:
  const PyValue& Expect(const PyRef& v, Kind kind, const char* type, const std::string& where) {
    TORCH_CHECK(v->kind == kind, what_, where, " is ", internal::Describe(v), ", not ", type);
    return *v;
  }
  std::string Str(const PyRef& v, const std::string& where) { return Expect(v, Kind::kStr, "a str", where).str; }
  int64_t Int(const PyRef& v, const std::string& where) { return Expect(v, Kind::kInt, "an int", where).i; }
  bool Bool(const PyRef& v, const std::string& where) { return Expect(v, Kind::kBool, "a bool", where).b; }
  const PyValue& Dict(const PyRef& v, const std::string& where) { return Expect(v, Kind::kDict, "a dict", where); }
  std::optional<std::string> OptStr(const PyRef* v, const std::string& where) {
    if (v == nullptr || (*v)->kind == Kind::kNone) return std::nullopt;
    return Str(*v, where);
  }
  // The arguments of an uncalled `cls(*args)`.
  const std::vector<PyRef>& Call(const PyRef& v, const std::string& cls, size_t n, const std::string& where) {
    TORCH_CHECK(v->kind == Kind::kObject && v->str == cls && v->reduced && !v->state, what_, where, " is ",
                internal::Describe(v), ", not a '", cls, "'");
    TORCH_CHECK(v->args->items.size() == n, what_, where, ": '", cls, "' with ", v->args->items.size(),
                " arguments, not ", n);
    return v->args->items;
  }
  std::vector<int64_t> Size(const PyRef& v, const std::string& where) {
    const PyValue& t = Expect(Call(v, "torch.Size", 1, where)[0], Kind::kTuple, "a tuple", where);
    TORCH_CHECK(t.items.size() <= kMaxDims, what_, where, " has ", t.items.size(), " dimensions, more than ", kMaxDims);
    std::vector<int64_t> out;
    for (const PyRef& d : t.items) out.push_back(Int(d, where));
    return out;
  }
  // The attributes of a DCP dataclass `cls` (NEWOBJ with no arguments, BUILD with a str-keyed
  // dict), each one of `known`.
  std::map<std::string, PyRef> Fields(const PyRef& v, const char* cls, std::initializer_list<const char*> known,
                                      const std::string& where, const char* module = internal::kDcpMetadataModule) {
    const std::string name = absl::StrCat(module, ".", cls);
    TORCH_CHECK(v->kind == Kind::kObject && v->str == name && !v->reduced && v->args->items.empty(), what_, where,
                " is ", internal::Describe(v), ", not a ", cls);
    std::map<std::string, PyRef> out;
    if (!v->state || v->state->kind == Kind::kNone) return out;
    const PyValue& d = Dict(v->state, absl::StrCat(where, "'s attributes"));
    for (size_t i = 0; i < d.items.size(); i += 2) {
      const std::string key = Str(d.items[i], absl::StrCat("an attribute name of ", where));
      TORCH_CHECK(std::find_if(known.begin(), known.end(), [&](const char* k) { return key == k; }) != known.end(),
                  what_, where, " (a ", cls, ") has an unknown attribute '", key, "'");
      TORCH_CHECK(out.emplace(key, d.items[i + 1]).second, what_, where, " sets '", key, "' twice");
    }
    return out;
  }

  void ReadEntry(const PyRef& v, const std::string& where, DcpEntry& e) {
    if (v->kind == Kind::kObject && v->str == absl::StrCat(internal::kDcpMetadataModule, ".BytesStorageMetadata")) {
      Fields(v, "BytesStorageMetadata", {}, where);  // no attribute is known
      e.is_bytes = true;
      return;
    }
    auto f = Fields(v, "TensorStorageMetadata", {"properties", "size", "chunks"}, where);
    TORCH_CHECK(f.size() == 3, what_, where, " lacks properties, size or chunks");
    e.size = Size(f["size"], where + ".size");
    ReadProperties(f["properties"], where + ".properties", e.properties);
    const PyValue& chunks = Expect(f["chunks"], Kind::kList, "a list", where + ".chunks");
    for (size_t c = 0; c < chunks.items.size(); ++c) {
      const std::string at = absl::StrCat(where, ".chunks[", c, "]");
      auto cf = Fields(chunks.items[c], "ChunkStorageMetadata", {"offsets", "sizes"}, at);
      TORCH_CHECK(cf.size() == 2, what_, at, " lacks offsets or sizes");
      DcpChunk chunk;
      chunk.offsets = Size(cf["offsets"], at + ".offsets");
      chunk.sizes = Size(cf["sizes"], at + ".sizes");
      e.chunks.push_back(std::move(chunk));
    }
  }

  // TensorProperties pickles its state as a tuple (metadata.py __getstate__): dtype, layout,
  // requires_grad, _MEM_FORMAT_ENCODING, pin_memory[, strides].
  void ReadProperties(const PyRef& v, const std::string& where, DcpTensorProperties& p) {
    TORCH_CHECK(v->kind == Kind::kObject && v->str == absl::StrCat(internal::kDcpMetadataModule, ".TensorProperties") &&
                    !v->reduced && v->args->items.empty() && v->state,
                what_, where, " is ", internal::Describe(v), ", not a TensorProperties");
    const PyValue& s = Expect(v->state, Kind::kTuple, "a tuple", where + "'s state");
    TORCH_CHECK(s.items.size() == 5 || s.items.size() == 6, what_, where, "'s state has ", s.items.size(),
                " fields, not 5 or 6");
    const PyRef& dtype = s.items[0];
    TORCH_CHECK(dtype->kind == Kind::kGlobal, what_, where, ".dtype is ", internal::Describe(dtype),
                ", not a torch dtype");
    bool found = false;
    for (const DtypeName& d : kDtypes) {
      if (dtype->str == absl::StrCat("torch.", d.name)) p.dtype = d.dtype, found = true;
    }
    TORCH_CHECK(found, what_, where, ".dtype is '", dtype->str, "', not a torch dtype");
    const PyRef& layout = Call(s.items[1], "torch.serialization._get_layout", 1, where + ".layout")[0];
    TORCH_CHECK(layout->kind == Kind::kStr && layout->str == "torch.strided", what_, where,
                ".layout is not torch.strided", layout->kind == Kind::kStr ? absl::StrCat(" but ", layout->str) : "");
    p.requires_grad = Bool(s.items[2], where + ".requires_grad");
    p.memory_format = Int(Call(s.items[3], absl::StrCat(internal::kDcpMetadataModule, "._MEM_FORMAT_ENCODING"), 1,
                               where + ".memory_format")[0],
                          where + ".memory_format");
    p.pin_memory = Bool(s.items[4], where + ".pin_memory");
    p.strides.reset();
    if (s.items.size() == 6 && s.items[5]->kind != Kind::kNone) {
      const PyValue& t = Expect(s.items[5], Kind::kTuple, "a tuple", where + ".strides");
      TORCH_CHECK(t.items.size() <= kMaxDims, what_, where, ".strides has ", t.items.size(), " dimensions");
      p.strides.emplace();
      for (const PyRef& x : t.items) p.strides->push_back(Int(x, where + ".strides"));
    }
  }

  // storage_data: MetadataIndex -> _StorageInfo, joined onto the chunks and bytes entries.
  void ReadStorageData(const PyRef& v, DcpMetadata& m) {
    const PyValue& d = Dict(v, "storage_data");
    using Key = std::tuple<std::string, bool, std::vector<int64_t>>;  // fqn, has offset, offset
    std::map<Key, DcpStorageInfo> storage;
    for (size_t i = 0; i < d.items.size(); i += 2) {
      const std::string at = absl::StrCat("storage_data key #", i / 2);
      auto kf = Fields(d.items[i], "MetadataIndex", {"fqn", "offset", "index"}, at);
      TORCH_CHECK(kf.count("fqn"), what_, at, " has no fqn");
      Key key{Str(kf["fqn"], at + ".fqn"), false, {}};
      if (kf.count("offset") && kf["offset"]->kind != Kind::kNone) {
        std::get<1>(key) = true;
        std::get<2>(key) = Size(kf["offset"], at + ".offset");
      }
      if (kf.count("index") && kf["index"]->kind != Kind::kNone) {  // a lookup hint: checked, not used
        TORCH_CHECK(Int(kf["index"], at + ".index") >= 0, what_, at, " has a negative index");
      }
      const std::string item =
          absl::StrCat("storage_data['", std::get<0>(key), "'",
                       std::get<1>(key) ? ", " + c10::str(c10::IntArrayRef(std::get<2>(key))) : "", "]");
      auto sf = Fields(d.items[i + 1], "_StorageInfo", {"relative_path", "offset", "length", "transform_descriptors"},
                       item, internal::kDcpFilesystemModule);
      TORCH_CHECK(sf.count("relative_path") && sf.count("offset") && sf.count("length"), what_, item,
                  " lacks relative_path, offset or length");
      if (sf.count("transform_descriptors") && sf["transform_descriptors"]->kind != Kind::kNone) {
        const PyValue& t = Expect(sf["transform_descriptors"], Kind::kList, "a list", item + ".transform_descriptors");
        TORCH_CHECK(t.items.empty(), what_, item,
                    " is stored through stream transforms (e.g. compression), which this reader does not undo");
      }
      DcpStorageInfo info{Str(sf["relative_path"], item + ".relative_path"), Int(sf["offset"], item + ".offset"),
                          Int(sf["length"], item + ".length")};
      TORCH_CHECK(storage.emplace(std::move(key), std::move(info)).second, what_, item, " appears twice");
    }
    for (DcpEntry& e : m.entries) {
      const auto take = [&](const Key& key, DcpStorageInfo& out, const std::string& item) {
        auto it = storage.find(key);
        TORCH_CHECK(it != storage.end(), what_, item, " has no storage_data entry");
        out = std::move(it->second);
        storage.erase(it);
        ValidateStorage(out, what_, item);
      };
      if (e.is_bytes) take({e.fqn, false, {}}, e.bytes_storage, absl::StrCat("bytes entry '", e.fqn, "'"));
      for (DcpChunk& c : e.chunks) {
        take({e.fqn, true, c.offsets}, c.storage,
             absl::StrCat("the chunk of '", e.fqn, "' at ", c10::str(c10::IntArrayRef(c.offsets))));
      }
    }
    if (!storage.empty()) {
      const Key& k = storage.begin()->first;
      TORCH_CHECK(false, what_, "storage_data['", std::get<0>(k), "'",
                  std::get<1>(k) ? ", " + c10::str(c10::IntArrayRef(std::get<2>(k))) : "",
                  "] names no chunk of state_dict_metadata");
    }
  }

  void ReadPlannerData(const PyRef& v, DcpMetadata& m) {
    const PyValue& d = Dict(v, "planner_data (DCP's default planner writes FQN -> object path)");
    absl::flat_hash_map<std::string, DcpEntry*> by_fqn;
    for (DcpEntry& e : m.entries) by_fqn[e.fqn] = &e;
    for (size_t i = 0; i < d.items.size(); i += 2) {
      const std::string fqn = Str(d.items[i], "a planner_data key");
      const std::string at = absl::StrCat("planner_data['", fqn, "']");
      auto it = by_fqn.find(fqn);
      TORCH_CHECK(it != by_fqn.end(), what_, at, " names no state_dict_metadata entry");
      const PyValue& path = Expect(d.items[i + 1], Kind::kTuple, "a tuple", at);
      TORCH_CHECK(!path.items.empty(), what_, at, " is an empty path");
      std::vector<DcpPathElement> out;
      for (const PyRef& p : path.items) {
        TORCH_CHECK(p->kind == Kind::kStr || p->kind == Kind::kInt, what_, at, " holds ", internal::Describe(p),
                    ", not a str or int");
        out.push_back(p->kind == Kind::kStr ? DcpPathElement(p->str) : DcpPathElement(p->i));
      }
      it->second->object_path = std::move(out);
    }
  }

  DcpStorageMeta ReadStorageMeta(const PyRef& v) {
    auto f = Fields(v, "StorageMeta", {"checkpoint_id", "save_id", "load_id", "modules"}, "storage_meta");
    DcpStorageMeta s;
    if (f.count("checkpoint_id") && f["checkpoint_id"]->kind == Kind::kObject) {
      const PyRef& p = f["checkpoint_id"];
      TORCH_CHECK(p->str == "pathlib.PosixPath" && p->reduced && !p->state, what_, "storage_meta.checkpoint_id is ",
                  internal::Describe(p), ", not a str or PosixPath");
      std::string path;  // PurePosixPath(*parts): the parts joined by '/' ('/' itself is a part)
      for (const PyRef& part : p->args->items) {
        const std::string text = Str(part, "a part of storage_meta.checkpoint_id");
        if (!path.empty() && path.back() != '/') path += '/';
        path += text;
      }
      s.checkpoint_id = path.empty() ? "." : path;
    } else {
      s.checkpoint_id = OptStr(f.count("checkpoint_id") ? &f["checkpoint_id"] : nullptr, "storage_meta.checkpoint_id");
    }
    s.save_id = OptStr(f.count("save_id") ? &f["save_id"] : nullptr, "storage_meta.save_id");
    s.load_id = OptStr(f.count("load_id") ? &f["load_id"] : nullptr, "storage_meta.load_id");
    if (f.count("modules")) {
      const PyValue& mods = Expect(f["modules"], Kind::kList, "a list", "storage_meta.modules");
      for (const PyRef& x : mods.items) s.modules.push_back(Str(x, "an element of storage_meta.modules"));
    }
    return s;
  }

  const std::string what_;
};

}  // namespace

const DcpEntry* DcpMetadata::Find(const std::string& fqn) const {
  for (const DcpEntry& e : entries) {
    if (e.fqn == fqn) return &e;
  }
  return nullptr;
}

std::string DcpDtypeName(at::ScalarType dtype) {
  const char* name = FindDtypeName(dtype);
  TORCH_CHECK(name != nullptr,
              "DCP files here hold float, double, half, bfloat16, int8/16/32/64, uint8, bool and "
              "complex tensors, not ",
              c10::toString(dtype));
  return name;
}

void ValidateDcpMetadata(const DcpMetadata& metadata, const std::string& what) {
  Validate(metadata, what, /*storage=*/true);
}

DcpMetadata ParseDcpMetadata(const char* data, size_t size, const std::string& source) {
  const PyRef root = internal::Unpickle(data, size, source, AllowList());
  return Reader(source).Read(root);
}

}  // namespace fsdp::checkpoint
