// checkpoint_reader.h: a torch.save archive's zip layer (checkpoint_zip.h), its byte order
// and its pickle (torch_unpickler.h), in memory or located in ranges.
#include "checkpoint/checkpoint_reader.h"

#include <c10/util/Exception.h>

#include <string>
#include <string_view>

#include "checkpoint/checkpoint_zip.h"
#include "checkpoint/torch_unpickler.h"

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

c10::IValue Read(const char* data, size_t size, const std::string& source, internal::StorageMode mode) {
  const std::string what = source + " is not a valid checkpoint: ";
  const internal::CheckpointZip zip(data, size, what);
  return internal::UnpickleTorchSave(Pickle(zip, what), zip, what, mode).value;
}
}  // namespace

c10::IValue ReadCheckpoint(const char* data, size_t size, const std::string& source) {
  return Read(data, size, source, internal::StorageMode::kCopy);
}

c10::IValue ReadCheckpointAliasing(const char* data, size_t size, const std::string& source) {
  return Read(data, size, source, internal::StorageMode::kAlias);
}

LocatedTensor LocateCheckpointTensor(uint64_t size, const internal::CheckpointZip::Fetch& fetch,
                                     const std::string& source) {
  LocatedTensor out{.what = source + " is not a valid checkpoint: "};
  const internal::CheckpointZip zip(size, fetch, out.what);
  const internal::Unpickled unpickled =
      internal::UnpickleTorchSave(Pickle(zip, out.what), zip, out.what, internal::StorageMode::kLocate);
  const c10::IValue& value = unpickled.value;
  TORCH_CHECK(value.isTensor(), out.what, "it holds a ", value.tagKind(), ", not a tensor");
  out.meta = value.toTensor();
  auto it = unpickled.located.find(out.meta.storage().unsafeGetStorageImpl());
  if (it != unpickled.located.end()) {
    const internal::CheckpointZip::Record& r = zip.Find(it->second);
    out.record = it->second;
    out.record_offset = r.offset;
    out.record_size = r.size;
    out.crc = r.crc;
  }
  return out;
}

}  // namespace fsdp::checkpoint
