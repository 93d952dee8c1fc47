// checkpoint_reader.h: a torch.save archive's zip layer (checkpoint_zip.h), its byte order
// and its pickle (torch_pickle.h), whose storages are read here from the archive's records:
// copied, or only located.
#include "checkpoint/checkpoint_reader.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <string>
#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_zip.h"
#include "checkpoint/torch_pickle.h"

namespace fsdp::checkpoint {

namespace {
// The archive's pickle, its byte order checked.
std::string_view Pickle(const internal::CheckpointZip& zip, const std::string& what) {
  const std::string byteorder = zip.archive() + "/byteorder";
  if (zip.Has(byteorder)) {
    const std::string_view order = zip.Read(byteorder);
    TORCH_CHECK(order == "little", what, "it was written on a '", std::string(order.substr(0, 16)),
                "' byte-order machine (only little-endian checkpoints are read)");
  }
  const std::string pickle = zip.archive() + "/data.pkl";
  TORCH_CHECK(zip.Has(pickle), what, "it has no record '", pickle, "'");
  return zip.Read(pickle);
}

// The record of storage `key` (none is needed for an empty storage, as LibTorch reads it),
// its size checked against the persistent id's.
std::string Record(const internal::CheckpointZip& zip, const std::string& key, at::ScalarType dtype, int64_t numel,
                   const std::string& where) {
  const std::string record = absl::StrCat(zip.archive(), "/data/", key);
  if (numel == 0) return record;
  TORCH_CHECK(zip.Has(record), where, "storage '", key, "' has no record '", record, "'");
  const uint64_t size = zip.Find(record).size, bytes = numel * c10::elementSize(dtype);
  TORCH_CHECK(size == bytes, where, "storage '", key, "' is declared as ", numel, " ", c10::toString(dtype),
              " elements (", bytes, " bytes) but its record '", record, "' holds ", size, " bytes");
  return record;
}
}  // namespace

c10::IValue ReadCheckpoint(const char* data, size_t size, const std::string& source) {
  const std::string what = source + " is not a valid checkpoint: ";
  const internal::CheckpointZip zip(data, size, what);
  auto copy = [&](const std::string& key, at::ScalarType dtype, int64_t numel, const std::string& where) {
    const std::string record = Record(zip, key, dtype, numel, where);
    at::Tensor t = at::empty({numel}, at::TensorOptions(dtype));  // numel's bytes fit int64: checked
    if (numel == 0) return t;
    const std::string_view bytes = zip.Read(record);
    if (dtype == at::kBool) {
      for (size_t i = 0; i < bytes.size(); ++i) {
        TORCH_CHECK(static_cast<uint8_t>(bytes[i]) <= 1, where, "bool storage '", key, "' holds byte ",
                    static_cast<int>(static_cast<uint8_t>(bytes[i])), " at element ", i);
      }
    }
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    return t;
  };
  return internal::UnpickleTorchSave(Pickle(zip, what), what, copy);
}

LocatedTensor LocateCheckpointTensor(uint64_t size, const internal::CheckpointZip::Fetch& fetch,
                                     const std::string& source) {
  LocatedTensor out{.what = source + " is not a valid checkpoint: "};
  const internal::CheckpointZip zip(size, fetch, out.what);
  // A meta tensor per storage, its record checked and remembered by the storage, for the caller to read.
  absl::flat_hash_map<const c10::StorageImpl*, std::string> located;
  auto locate = [&](const std::string& key, at::ScalarType dtype, int64_t numel, const std::string& where) {
    const std::string record = Record(zip, key, dtype, numel, where);
    at::Tensor t = at::empty({numel}, at::TensorOptions(dtype).device(at::kMeta));
    if (numel > 0) located.emplace(t.storage().unsafeGetStorageImpl(), record);
    return t;
  };
  const c10::IValue value = internal::UnpickleTorchSave(Pickle(zip, out.what), out.what, locate);
  TORCH_CHECK(value.isTensor(), out.what, "it holds a ", value.tagKind(), ", not a tensor");
  out.meta = value.toTensor();
  auto it = located.find(out.meta.storage().unsafeGetStorageImpl());
  if (it != located.end()) {
    const internal::CheckpointZip::Record& r = zip.Find(it->second);
    out.record = it->second;
    out.record_offset = r.offset;
    out.record_size = r.size;
    out.crc = r.crc;
  }
  return out;
}

}  // namespace fsdp::checkpoint
