// torch.save's data.pkl, internal to //checkpoint: the value model that reads it into a
// c10::IValue on the pickle machine (pickle/pickle_machine.h), and the storage classes it names, which the
// writer (checkpoint_writer.h) names too. checkpoint_reader.h states what is read and the
// checks made on untrusted bytes.
#ifndef FSDP_CHECKPOINT_TORCH_PICKLE_H_
#define FSDP_CHECKPOINT_TORCH_PICKLE_H_

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace fsdp::checkpoint::internal {

// The storage class torch.save names for a dtype ("FloatStorage": torch/storage.py's legacy
// <Type>Storage, which torch/_weights_only_unpickler.py allows), or null for a dtype it has
// none for here.
const char* TorchStorageName(at::ScalarType dtype);

// The storage a persistent id ('storage', torch.<Type>Storage, key, location, numel) names:
// `numel` elements of `dtype` (numel >= 0, numel elements' bytes fit int64), as a 1-D tensor
// over all of it. Called once per key; errors start with `where`.
using StorageLoader =
    std::function<at::Tensor(const std::string& key, at::ScalarType dtype, int64_t numel, const std::string& where)>;

// The value pickled in `pickle` (protocol 2), its storages from `load`. Errors start with
// `what` + "data.pkl byte <offset of the opcode>: ".
c10::IValue UnpickleTorchSave(std::string_view pickle, const std::string& what, const StorageLoader& load);

}  // namespace fsdp::checkpoint::internal

#endif  // FSDP_CHECKPOINT_TORCH_PICKLE_H_
