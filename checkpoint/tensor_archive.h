// A streaming writer of the torch.save archive of one tensor: what a DCP data file holds per
// tensor chunk (filesystem.py _write_item torch.save's each one). WriteCheckpoint (LibTorch's
// torch::jit::pickle_save) builds the whole archive in memory, its data copied and CRC'ed by
// LibTorch's table CRC-32 (slow: docs/design/measured-choices.md); this writes the header,
// then the tensor's bytes straight from its memory in blocks, each CRC'ed (crc32.h) on the
// way, then the rest: the layout
// LibTorch's PyTorchStreamWriter gives (caffe2/serialize/inline_container.cc at v2.15.0:
// records data/0, data.pkl, version, byteorder, .data/serialization_id, each aligned to 64
// bytes by an "FB" extra field, flags 0x0808 with a data descriptor, a zip64 end record), and
// data.pkl's pickle byte for byte.
#ifndef FSDP_CHECKPOINT_TENSOR_ARCHIVE_H_
#define FSDP_CHECKPOINT_TENSOR_ARCHIVE_H_

#include <ATen/core/Tensor.h>

#include "checkpoint/file_io.h"

namespace fsdp::checkpoint {

// Appends the archive of `t` to `out` and returns true, when `t` is a contiguous CPU tensor
// whose storage is exactly its elements (offset 0), of a dtype torch.save names a storage
// for, and smaller than 4 GiB (beyond that the records need zip64 sizes). Otherwise writes
// nothing and returns false: the caller writes WriteCheckpoint(t) instead. Write errors are
// AtomicFile's.
bool WriteTensorArchive(AtomicFile& out, const at::Tensor& t);

// The storage class torch.save names for a dtype ("FloatStorage": torch/storage.py's legacy
// <Type>Storage, which torch.load's weights_only unpickler allows), or null for a dtype it has
// none for here (the dtypes checkpoint_reader.h reads).
const char* TorchStorageName(at::ScalarType dtype);

}  // namespace fsdp::checkpoint

#endif  // FSDP_CHECKPOINT_TENSOR_ARCHIVE_H_
