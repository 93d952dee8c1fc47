// The unpickler of a torch.save archive's data.pkl (protocol 2), internal to the checkpoint
// reader: checkpoint_reader.h states what it reads and the checks it makes on untrusted bytes.
// Tensors' storages come from the archive's records (`zip`); errors start with `what`.
#ifndef FSDP_CHECKPOINT_TORCH_UNPICKLER_H_
#define FSDP_CHECKPOINT_TORCH_UNPICKLER_H_

#include <ATen/core/ivalue.h>

#include <string>
#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "checkpoint/checkpoint_zip.h"

namespace fsdp::checkpoint::internal {

// What a storage's tensor is: a copy of its record, a view of the record's bytes in the
// caller's buffer (ReadCheckpointAliasing), or a meta tensor whose record is only located
// (LocateCheckpointTensor).
enum class StorageMode { kCopy, kAlias, kLocate };

struct Unpickled {
  c10::IValue value;
  // kLocate: the record of each storage, by the storage's (meta) StorageImpl.
  absl::flat_hash_map<const c10::StorageImpl*, std::string> located;
};

Unpickled UnpickleTorchSave(std::string_view pickle, const CheckpointZip& zip, const std::string& what,
                            StorageMode mode);

}  // namespace fsdp::checkpoint::internal

#endif  // FSDP_CHECKPOINT_TORCH_UNPICKLER_H_
