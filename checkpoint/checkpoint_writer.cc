#include "checkpoint/checkpoint_writer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "checkpoint/torch_pickle.h"
#include "checkpoint/zip_writer.h"
#include "pickle/pickle_machine.h"
#include "pickle/pickler.h"

namespace fsdp::checkpoint {
namespace {

constexpr char kArchive[] = "archive/";  // torch.save's directory for an archive written to a buffer

}  // namespace

struct TorchSaveWriter::State {
  State(Sink sink, std::string caller_name) : zip(std::move(sink)), caller(std::move(caller_name)), pickler(caller) {}

  // A storage pickled: its record's key and its dtype (one storage, one dtype: torch.save's too).
  struct Known {
    std::string key;
    at::ScalarType dtype;
  };
  std::string NewKey() { return std::to_string(next_key++); }
  const char* StorageName(const at::Tensor& t) const;
  const Known& KeyOf(const at::Tensor& t);
  void Pickle(const c10::IValue& v, int depth);
  void PickleTensor(const at::Tensor& t);
  void PickleInts(c10::IntArrayRef values);

  internal::ZipWriter zip;
  const std::string caller;
  pickle::Pickler pickler;
  int64_t next_key = 0;
  absl::flat_hash_map<const c10::StorageImpl*, Known> known;
  std::vector<at::Tensor> stand_ins;                      // alive, so that no storage reuses their address
  std::vector<std::pair<std::string, at::Storage>> todo;  // met by Finish: written after data.pkl
  bool finished = false;
};

const char* TorchSaveWriter::State::StorageName(const at::Tensor& t) const {
  TORCH_CHECK(t.defined(), caller, ": an undefined tensor");
  const char* name = internal::TorchStorageName(t.scalar_type());
  TORCH_CHECK(name != nullptr, caller, ": cannot write a ", c10::toString(t.scalar_type()), " tensor");
  return name;
}

// The key of t's storage; a storage met first is written after data.pkl.
const TorchSaveWriter::State::Known& TorchSaveWriter::State::KeyOf(const at::Tensor& t) {
  const c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  auto it = known.find(impl);
  if (it == known.end()) {
    TORCH_CHECK(t.device().is_cpu(), caller, ": a tensor is on ", t.device(), "; move it to the CPU first");
    it = known.emplace(impl, Known{NewKey(), t.scalar_type()}).first;
    todo.emplace_back(it->second.key, t.storage());
  }
  TORCH_CHECK(it->second.dtype == t.scalar_type(), caller, ": two tensors view one storage as ",
              c10::toString(it->second.dtype), " and ", c10::toString(t.scalar_type()),
              " (torch.save cannot save that either)");
  return it->second;
}

void TorchSaveWriter::State::PickleInts(c10::IntArrayRef values) {
  if (values.empty()) return pickler.EmptyTuple();
  pickler.Mark();
  for (int64_t v : values) pickler.Int(v);
  pickler.Tuple();
}

// _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, OrderedDict()),
// the storage a persistent id ('storage', torch.<Type>Storage, key, location, numel)
// (torch/serialization.py _save's persistent_id).
void TorchSaveWriter::State::PickleTensor(const at::Tensor& t) {
  const char* storage_name = StorageName(t);
  const Known& storage = KeyOf(t);
  const size_t item = t.element_size(), nbytes = t.storage().nbytes();
  TORCH_CHECK(nbytes % item == 0, caller, ": a ", c10::toString(t.scalar_type()), " tensor's storage holds ", nbytes,
              " bytes, not whole elements");
  pickler.Global("torch._utils", "_rebuild_tensor_v2");
  pickler.Mark();
  pickler.Mark();
  pickler.Str("storage");
  pickler.Global("torch", storage_name);
  pickler.Str(storage.key);
  pickler.Str("cpu");
  pickler.Int(static_cast<int64_t>(nbytes / item));
  pickler.Tuple();
  pickler.BinPersId();
  pickler.Int(t.storage_offset());
  PickleInts(t.sizes());
  PickleInts(t.strides());
  pickler.Bool(t.requires_grad());
  pickler.Global("collections", "OrderedDict");
  pickler.EmptyTuple();
  pickler.Reduce();
  pickler.Tuple();
  pickler.Reduce();
}

// `v`, inside `depth` containers.
void TorchSaveWriter::State::Pickle(const c10::IValue& v, int depth) {
  const bool container = v.isTuple() || v.isList() || v.isGenericDict();
  TORCH_CHECK(!container || depth < pickle::kMaxPickleDepth, caller, ": the value nests deeper than ",
              pickle::kMaxPickleDepth, " containers");
  if (v.isNone()) {
    pickler.None();
  } else if (v.isBool()) {
    pickler.Bool(v.toBool());
  } else if (v.isInt()) {
    pickler.Int(v.toInt());
  } else if (v.isDouble()) {
    pickler.Float(v.toDouble());
  } else if (v.isString()) {
    pickler.Str(v.toStringRef());
  } else if (v.isTensor()) {
    PickleTensor(v.toTensor());
  } else if (v.isTuple()) {
    const auto& items = v.toTupleRef().elements();
    if (items.empty()) return pickler.EmptyTuple();
    pickler.Mark();
    for (const c10::IValue& item : items) Pickle(item, depth + 1);
    pickler.Tuple();
  } else if (v.isList()) {
    pickler.EmptyList();
    if (v.toListRef().empty()) return;
    pickler.Mark();
    for (const c10::IValue& item : v.toListRef()) Pickle(item, depth + 1);
    pickler.Appends();
  } else if (v.isGenericDict()) {
    pickler.EmptyDict();
    if (v.toGenericDict().empty()) return;
    pickler.Mark();
    for (const auto& item : v.toGenericDict()) {
      const c10::IValue& key = item.key();
      TORCH_CHECK(key.isString() || key.isInt() || key.isDouble() || key.isBool(), caller, ": a dict key is a ",
                  key.tagKind(), ", not a str, int, float or bool");
      Pickle(key, depth + 1);
      Pickle(item.value(), depth + 1);
    }
    pickler.SetItems();
  } else {
    TORCH_CHECK(false, caller, ": cannot write a ", v.tagKind());
  }
}

TorchSaveWriter::TorchSaveWriter(Sink sink, std::string caller)
    : state_(std::make_unique<State>(std::move(sink), std::move(caller))) {}

TorchSaveWriter::~TorchSaveWriter() = default;

at::Tensor TorchSaveWriter::Add(const at::Tensor& t) {
  State& s = *state_;
  TORCH_CHECK(!s.finished, s.caller, ": Add after Finish");
  s.StorageName(t);
  TORCH_CHECK(t.device().is_cpu(), s.caller, ": a tensor is on ", t.device(), "; move it to the CPU first");
  const at::Tensor data = t.detach().contiguous();
  const std::string key = s.NewKey();
  s.zip.Add(kArchive + ("data/" + key), static_cast<const char*>(data.const_data_ptr()), data.nbytes());
  at::Tensor stand_in = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()).device(at::kMeta));
  s.known.emplace(stand_in.storage().unsafeGetStorageImpl(), State::Known{key, t.scalar_type()});
  s.stand_ins.push_back(stand_in);
  return stand_in;
}

void TorchSaveWriter::Finish(const c10::IValue& root) {
  State& s = *state_;
  TORCH_CHECK(!s.finished, s.caller, ": Finish called twice");
  s.finished = true;
  s.Pickle(root, 0);
  const std::vector<char> pickle = s.pickler.Finish();
  s.zip.Add(std::string(kArchive) + "data.pkl", pickle.data(), pickle.size());
  s.zip.Add(std::string(kArchive) + "byteorder", "little");  // torch.load reads storages in this order
  for (const auto& [key, storage] : s.todo) {
    s.zip.Add(kArchive + ("data/" + key), static_cast<const char*>(storage.data()), storage.nbytes());
  }
  // The file format version LibTorch's reader requires (caffe2/serialize/inline_container.h
  // kProducedFileFormatVersion, as torch.save writes it).
  s.zip.Add(std::string(kArchive) + "version", "3\n");
  s.zip.Finish();
}

std::vector<char> WriteCheckpoint(const c10::IValue& value) {
  std::vector<char> out;
  TorchSaveWriter writer([&out](const char* data, size_t size) { out.insert(out.end(), data, data + size); },
                         "WriteCheckpoint");
  writer.Finish(value);
  return out;
}

}  // namespace fsdp::checkpoint
