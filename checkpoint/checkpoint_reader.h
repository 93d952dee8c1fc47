// A validating reader for checkpoint files as our writer (checkpoint_writer.h), Python's
// torch.save and LibTorch's torch::pickle_save write them: a zip archive holding
// `<archive>/data.pkl` (a protocol-2 pickle) and one record `<archive>/data/<key>` per tensor
// storage.
//
// Checkpoint files are input. Every size, offset, dtype and shape in one is checked before
// memory is touched; a truncated or corrupted file is a c10::Error that names `source` and
// the bad value, never a crash, a hang or an out-of-bounds read. LibTorch's reader
// (torch::pickle_load) is not used on such bytes: its unpickler indexes its stack and memo
// with unchecked values from the file, sizes its memo from a 32-bit id in it, and builds
// tensors whose storage size, offset, sizes and strides are taken from the file unchecked.
//
// Read: zip and zip64 archives of stored (uncompressed) records, each record's CRC-32
// checked (unless the writer stored none, torch.save with compute_crc32=False); pickle
// protocol 2; None, bool, int (64-bit), float, str, tuple, list, dict (str, int, float or bool
// keys), collections.OrderedDict (as a dict; its attributes, e.g. a state_dict()'s
// _metadata, are dropped), tensors (torch._utils._rebuild_tensor_v2 / _rebuild_parameter
// of float, double, half, bfloat16, int8/16/32/64, uint8, bool, complex64/128 storages,
// loaded to the CPU whatever location they were saved from), and the type-tag and list
// wrappers of torch.jit._pickle. Anything else (another global, i.e. an arbitrary Python
// object) is an error naming it. Containers nest at most 64 deep; shared references are
// allowed, cycles are not.
#ifndef FSDP_CHECKPOINT_CHECKPOINT_READER_H_
#define FSDP_CHECKPOINT_CHECKPOINT_READER_H_

#include <ATen/core/ivalue.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "checkpoint/checkpoint_zip.h"

namespace fsdp::checkpoint {

// The pickled value of the checkpoint in `data[0, size)`. Errors read
// "<source> is not a valid checkpoint: <what is wrong, with the offending value>".
c10::IValue ReadCheckpoint(const char* data, size_t size, const std::string& source);

// A checkpoint holding one tensor (a DCP chunk: filesystem.py torch.save's each item), located
// but not read: `meta` has its dtype, sizes, strides and storage offset (the meta device);
// its storage's bytes are [record_offset, record_offset + record_size) of the archive, with
// CRC-32 `crc` (0: none stored), for the caller to read and check (a bool storage's bytes must
// be 0 or 1). `record` is the storage's record name, empty for an empty storage. Only the
// archive's directory, its local headers and its pickle are fetched, every check of
// ReadCheckpoint made on them; errors read "<source> is not a valid checkpoint: ...", and
// `what` is that prefix, for the caller's own errors about the record.
struct LocatedTensor {
  std::string what;
  at::Tensor meta;
  std::string record;
  uint64_t record_offset = 0, record_size = 0;
  uint32_t crc = 0;
};
LocatedTensor LocateCheckpointTensor(uint64_t size, const internal::CheckpointZip::Fetch& fetch,
                                     const std::string& source);

}  // namespace fsdp::checkpoint

#endif  // FSDP_CHECKPOINT_CHECKPOINT_READER_H_
