// PyTorch's distributed-checkpoint (DCP) metadata, the `.metadata` file of a checkpoint
// directory: what torch.distributed.checkpoint.save writes (torch/distributed/checkpoint/
// filesystem.py, _FileSystemWriter.finish: pickle.dump of a metadata.py `Metadata`) and
// FileSystemReader.read_metadata / dcp.load read, at the pinned PyTorch (v2.15.0).
//
// Python's Metadata holds `state_dict_metadata` (FQN -> TensorStorageMetadata(properties,
// size, chunks) or BytesStorageMetadata), `storage_data` (MetadataIndex(fqn, offset, index)
// -> filesystem.py's _StorageInfo(relative_path, offset, length)), `planner_data` (the
// default planner's FQN -> object path in the nested state dict), `storage_meta` and
// `version`. Here a chunk carries its own _StorageInfo, and a bytes entry its own: the
// storage_data key (fqn, chunk offsets) names exactly one chunk, so the reader joins the two
// maps (each chunk must have exactly one storage entry, each storage entry must name a chunk)
// and the writer splits them again (index = the chunk's position, as DCP's
// create_default_global_save_plan rewrites the hints).
//
// Contracts:
//  * ParseDcpMetadata reads a pickle of protocol 2-5 (Python writes 4) with an allow-list of
//    exactly DCP's metadata classes, torch.Size, the torch dtypes DCP files hold (those of
//    checkpoint_reader.h), torch.strided (via torch.serialization._get_layout) and
//    pathlib.PosixPath (storage_meta.checkpoint_id). Anything else is a c10::Error naming
//    `source` and the global. Every value is validated: an unknown attribute, a wrong type,
//    a negative size or offset, a chunk outside its tensor, two chunks of a tensor that
//    overlap, a storage range whose end overflows, a relative_path that leaves the directory,
//    stream transforms (compression), a missing or dangling storage entry are all errors
//    "<source> is not a valid DCP metadata file: <what, with the value>".
//  * SerializeDcpMetadata(m) is a protocol-2 pickle that Python's pickle.load turns into the
//    Metadata dcp.load uses, and that ParseDcpMetadata reads back equal to `m` (except that an
//    empty object_path reads back as {fqn}). It validates `m` as the reader does (errors
//    start with "SerializeDcpMetadata: ").
//  * The model does not require the chunks to cover their tensor (a reader of part of a
//    tensor needs only the chunks it overlaps); dcp_storage.h's WriteMetadata does.
#ifndef FSDP_CHECKPOINT_DCP_METADATA_H_
#define FSDP_CHECKPOINT_DCP_METADATA_H_

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace fsdp::checkpoint {
namespace internal {
// The Python modules of DCP's metadata classes, as `.metadata`'s pickle names them.
inline constexpr char kDcpMetadataModule[] = "torch.distributed.checkpoint.metadata";
inline constexpr char kDcpFilesystemModule[] = "torch.distributed.checkpoint.filesystem";
}  // namespace internal

// Where one item's bytes lie: filesystem.py's _StorageInfo. `relative_path` is a file name in
// the checkpoint directory (no '/', not "." or ".."); [offset, offset + length) of that file.
struct DcpStorageInfo {
  std::string relative_path;
  int64_t offset = 0;
  int64_t length = 0;
  bool operator==(const DcpStorageInfo&) const = default;
};

// One stored box of a tensor (metadata.py ChunkStorageMetadata) and where its bytes are.
struct DcpChunk {
  std::vector<int64_t> offsets;  // into the global tensor, one per dimension
  std::vector<int64_t> sizes;
  DcpStorageInfo storage;
  bool operator==(const DcpChunk&) const = default;
};

// metadata.py TensorProperties. Layout is always torch.strided (DCP stores nothing else);
// `memory_format` is its _MEM_FORMAT_ENCODING (0 contiguous, 1 channels_last, 2 preserve).
// The fields after dtype are deprecated in PyTorch and kept only to round-trip them.
struct DcpTensorProperties {
  at::ScalarType dtype = at::kFloat;
  bool requires_grad = false;
  int64_t memory_format = 0;
  bool pin_memory = false;
  std::optional<std::vector<int64_t>> strides;  // of the saving rank's local tensor
  bool operator==(const DcpTensorProperties&) const = default;
};

// One path element of planner_data: a str key of a nested dict or an int index of a list.
using DcpPathElement = std::variant<std::string, int64_t>;

// One state_dict_metadata entry: a tensor (TensorStorageMetadata) or a bytes object
// (BytesStorageMetadata: a non-tensor value, torch.save'd by DCP as BYTE_IO).
struct DcpEntry {
  std::string fqn;
  bool is_bytes = false;
  // Tensors:
  DcpTensorProperties properties;
  std::vector<int64_t> size;  // global shape
  std::vector<DcpChunk> chunks;
  // Bytes:
  DcpStorageInfo bytes_storage;
  // planner_data's object path of this FQN (e.g. {"nested", "b"} for "nested.b"); empty when
  // the file has no planner_data entry for it. The writer writes {fqn} for an empty path,
  // what DCP's flatten_state_dict gives a top-level key.
  std::vector<DcpPathElement> object_path;
  bool operator==(const DcpEntry&) const = default;
};

// metadata.py StorageMeta. checkpoint_id is a str here (Python writes a pathlib.PosixPath,
// read as its '/'-joined path).
struct DcpStorageMeta {
  std::optional<std::string> checkpoint_id, save_id, load_id;
  std::vector<std::string> modules;
  bool operator==(const DcpStorageMeta&) const = default;
};

struct DcpMetadata {
  std::vector<DcpEntry> entries;  // state_dict_metadata, in its order; FQNs unique
  bool has_planner_data = true;   // planner_data is a dict (false: None)
  std::optional<DcpStorageMeta> storage_meta;
  std::optional<std::string> version;  // filesystem.py CURRENT_DCP_VERSION, "1.0.0"

  // The entry named `fqn`, or nullptr.
  const DcpEntry* Find(const std::string& fqn) const;
  bool operator==(const DcpMetadata&) const = default;
};

// The version DCP's FileSystemWriter writes (filesystem.py CURRENT_DCP_VERSION).
inline constexpr char kDcpVersion[] = "1.0.0";

// The metadata pickled in `data[0, size)`; `source` names it in errors (e.g. "'dir/.metadata'").
DcpMetadata ParseDcpMetadata(const char* data, size_t size, const std::string& source);

// The `.metadata` bytes of `metadata`.
std::vector<char> SerializeDcpMetadata(const DcpMetadata& metadata);

// The checks ParseDcpMetadata makes of a model (unique FQNs, sizes, chunks inside their tensor
// and not overlapping, storage ranges and file names); errors start with `what`.
void ValidateDcpMetadata(const DcpMetadata& metadata, const std::string& what);

// The torch dtype name DCP pickles for `dtype` ("float32", ...); an error for a dtype DCP files
// here cannot hold.
std::string DcpDtypeName(at::ScalarType dtype);

}  // namespace fsdp::checkpoint

#endif  // FSDP_CHECKPOINT_DCP_METADATA_H_
