#include "checkpoint/tensor_dict_file.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/file_io.h"

namespace fsdp::checkpoint {

std::vector<char> SerializeTensorDict(const TensorDict& dict) {
  c10::Dict<std::string, at::Tensor> out;
  for (const auto& item : dict) out.insert(item.key(), item.value().detach().cpu());
  return WriteCheckpoint(c10::IValue(out));
}

TensorDict DeserializeTensorDict(const std::vector<char>& bytes, const std::string& source, const std::string& caller) {
  const c10::IValue value = ReadCheckpoint(bytes.data(), bytes.size(), caller + ": " + source);
  TORCH_CHECK(value.isGenericDict(), caller, ": ", source, " holds a ", value.tagKind(), ", not a str -> Tensor dict");
  TensorDict out;
  for (const auto& item : value.toGenericDict()) {
    TORCH_CHECK(item.key().isString() && item.value().isTensor(), caller, ": ", source,
                " has an entry that is not str -> Tensor (", item.key().tagKind(), " -> ", item.value().tagKind(), ")");
    out.insert(item.key().toStringRef(), item.value().toTensor());
  }
  return out;
}

void SaveTensorDictAs(const TensorDict& dict, const std::string& path, const std::string& caller) {
  WriteFileAtomically(path, SerializeTensorDict(dict), caller);
}

TensorDict LoadTensorDictAs(const std::string& path, const std::string& caller) {
  return DeserializeTensorDict(ReadFile(path, caller), "'" + path + "'", caller);
}

void SaveTensorDict(const TensorDict& dict, const std::string& path) { SaveTensorDictAs(dict, path, "SaveTensorDict"); }

TensorDict LoadTensorDict(const std::string& path) { return LoadTensorDictAs(path, "LoadTensorDict"); }

}  // namespace fsdp::checkpoint
