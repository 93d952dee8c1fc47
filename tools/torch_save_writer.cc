#include "tools/torch_save_writer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/strides.h>

#include <bit>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "checkpoint/tensor_archive.h"

namespace dcp_cli {
namespace {

static_assert(std::endian::native == std::endian::little, "storages are written in the machine's byte order");

// Pickle opcodes (Python's Lib/pickle.py names), protocol 2.
constexpr uint8_t kProto = 0x80, kStop = '.', kNone = 'N', kNewTrue = 0x88, kNewFalse = 0x89, kBinInt = 'J',
                  kLong1 = 0x8a, kBinFloat = 'G', kBinUnicode = 'X', kMark = '(', kTuple = 't', kEmptyTuple = ')',
                  kEmptyList = ']', kAppends = 'e', kEmptyDict = '}', kSetItems = 'u', kGlobal = 'c', kReduce = 'R',
                  kBinPersId = 'Q';

// Containers nest at most this deep (checkpoint_reader.h reads no deeper).
constexpr int kMaxDepth = 64;

}  // namespace

TorchSaveWriter::TorchSaveWriter(std::function<size_t(const void*, size_t)> sink) : zip_(std::move(sink)) {
  Op(kProto);
  Op(2);
}

std::string TorchSaveWriter::WriteStorage(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "TorchSaveWriter: a tensor is on ", t.device(), ", not the CPU");
  TORCH_CHECK(fsdp::checkpoint::TorchStorageName(t.scalar_type()) != nullptr, "TorchSaveWriter: cannot write a ",
              c10::toString(t.scalar_type()), " tensor");
  const at::Tensor data = t.detach().contiguous();
  std::string key = std::to_string(next_key_++);
  static const char kNothing = 0;  // the record of an empty tensor still needs a pointer
  const void* bytes = data.nbytes() > 0 ? data.const_data_ptr() : &kNothing;
  zip_.writeRecord("data/" + key, bytes, data.nbytes());
  return key;
}

at::Tensor TorchSaveWriter::Add(const at::Tensor& t) {
  std::string key = WriteStorage(t);
  at::Tensor stand_in = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()).device(at::kMeta));
  keys_.emplace(stand_in.unsafeGetTensorImpl(), std::move(key));
  stand_ins_.push_back(stand_in);
  return stand_in;
}

void TorchSaveWriter::Le(uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) pickle_.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void TorchSaveWriter::Int(int64_t v) {
  if (v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max()) {
    Op(kBinInt);  // a signed 4-byte int
    Le(static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
  } else {
    Op(kLong1);  // n little-endian two's-complement bytes
    Op(8);
    Le(static_cast<uint64_t>(v), 8);
  }
}

void TorchSaveWriter::Float(double v) {
  Op(kBinFloat);  // 8 bytes, big-endian
  const uint64_t bits = std::bit_cast<uint64_t>(v);
  for (int i = 7; i >= 0; --i) pickle_.push_back(static_cast<char>((bits >> (8 * i)) & 0xFF));
}

void TorchSaveWriter::Str(const std::string& s) {
  TORCH_CHECK(s.size() <= std::numeric_limits<uint32_t>::max(), "TorchSaveWriter: a string of ", s.size(),
              " bytes is too long for the pickle");
  Op(kBinUnicode);
  Le(s.size(), 4);
  pickle_ += s;
}

void TorchSaveWriter::Global(const char* module, const std::string& name) {
  Op(kGlobal);
  absl::StrAppend(&pickle_, module, "\n", name, "\n");
}

void TorchSaveWriter::IntTuple(c10::IntArrayRef values) {
  if (values.empty()) {
    Op(kEmptyTuple);
    return;
  }
  Op(kMark);
  for (int64_t v : values) Int(v);
  Op(kTuple);
}

// As Python's torch.save pickles a plain tensor (torch/_tensor.py Tensor.__reduce_ex__):
// _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks)
// with the storage a persistent id ('storage', <Type>Storage, key, location, numel)
// (torch/serialization.py _save's persistent_id).
void TorchSaveWriter::PickleTensor(const at::Tensor& t) {
  std::string key;
  if (auto it = keys_.find(t.unsafeGetTensorImpl()); it != keys_.end()) {
    key = it->second;
  } else {
    TORCH_CHECK(!t.is_meta(), "TorchSaveWriter: a meta tensor that Add did not return");
    key = WriteStorage(t);
  }
  Global("torch._utils", "_rebuild_tensor_v2");
  Op(kMark);
  Op(kMark);
  Str("storage");
  Global("torch", fsdp::checkpoint::TorchStorageName(t.scalar_type()));
  Str(key);
  Str("cpu");
  Int(t.numel());
  Op(kTuple);
  Op(kBinPersId);
  Int(0);
  IntTuple(t.sizes());
  IntTuple(c10::contiguous_strides(t.sizes()));
  Op(kNewFalse);  // requires_grad
  Global("collections", "OrderedDict");
  Op(kEmptyTuple);
  Op(kReduce);
  Op(kTuple);
  Op(kReduce);
}

void TorchSaveWriter::Pickle(const c10::IValue& v, int depth) {
  TORCH_CHECK(depth <= kMaxDepth, "TorchSaveWriter: the value nests deeper than ", kMaxDepth, " containers");
  if (v.isNone()) {
    Op(kNone);
  } else if (v.isBool()) {
    Op(v.toBool() ? kNewTrue : kNewFalse);
  } else if (v.isInt()) {
    Int(v.toInt());
  } else if (v.isDouble()) {
    Float(v.toDouble());
  } else if (v.isString()) {
    Str(v.toStringRef());
  } else if (v.isTensor()) {
    TORCH_CHECK(v.toTensor().defined(), "TorchSaveWriter: an undefined tensor");
    PickleTensor(v.toTensor());
  } else if (v.isTuple()) {
    const auto& items = v.toTupleRef().elements();
    Op(items.empty() ? kEmptyTuple : kMark);
    for (const auto& item : items) Pickle(item, depth + 1);
    if (!items.empty()) Op(kTuple);
  } else if (v.isList()) {
    Op(kEmptyList);
    if (v.toListRef().empty()) return;
    Op(kMark);
    for (const auto& item : v.toListRef()) Pickle(item, depth + 1);
    Op(kAppends);
  } else if (v.isGenericDict()) {
    Op(kEmptyDict);
    if (v.toGenericDict().empty()) return;
    Op(kMark);
    for (const auto& item : v.toGenericDict()) {
      Pickle(item.key(), depth + 1);
      Pickle(item.value(), depth + 1);
    }
    Op(kSetItems);
  } else {
    TORCH_CHECK(false, "TorchSaveWriter: cannot write a ", v.tagKind());
  }
}

void TorchSaveWriter::Finish(const c10::IValue& root) {
  Pickle(root, 0);
  Op(kStop);
  zip_.writeRecord("data.pkl", pickle_.data(), pickle_.size());
  // torch.load reads byteorder to know how to read the storages (written as torch.save does).
  static const std::string kByteOrder = "little";
  zip_.writeRecord("byteorder", kByteOrder.data(), kByteOrder.size());
  zip_.writeEndOfFile();
}

std::vector<char> TorchSaveBytes(const c10::IValue& value) {
  std::vector<char> out;
  TorchSaveWriter writer([&out](const void* data, size_t n) {
    out.insert(out.end(), static_cast<const char*>(data), static_cast<const char*>(data) + n);
    return n;
  });
  writer.Finish(value);
  return out;
}

}  // namespace dcp_cli
