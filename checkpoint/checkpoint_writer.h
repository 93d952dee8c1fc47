// The writer of checkpoint files: the zip archive that Python's torch.load and our reader
// (checkpoint_reader.h) read, `<archive>/data.pkl` (a protocol-2 pickle) plus one record per
// tensor storage, as torch::pickle_save writes it (torch/serialization.py's _save layout,
// v2.15.0).
#ifndef FSDP_CHECKPOINT_CHECKPOINT_WRITER_H_
#define FSDP_CHECKPOINT_CHECKPOINT_WRITER_H_

#include <ATen/core/ivalue.h>

#include <vector>

namespace fsdp::checkpoint {

// The bytes of a checkpoint holding `value` (None, bool, int, float, str, tuples, lists,
// str/int-keyed dicts and CPU tensors, nested). A tensor not on the CPU is an error naming its
// device: callers move tensors to the CPU first (they know whether to detach, cast, ...).
std::vector<char> WriteCheckpoint(const c10::IValue& value);

}  // namespace fsdp::checkpoint

#endif  // FSDP_CHECKPOINT_CHECKPOINT_WRITER_H_
