// SerializeDcpMetadata: our DcpMetadata as the pickle Python's FileSystemReader.read_metadata
// loads (protocol 2: NEWOBJ + BUILD of the classes of torch/distributed/checkpoint/metadata.py
// and filesystem.py, in the field order PyTorch 2.15 pickles them). The reader and the
// validation are in dcp_metadata.cc.
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <vector>

#include "checkpoint/dcp_metadata.h"
#include "pickle/pickler.h"

namespace fsdp::checkpoint {
namespace {

// The modules of the classes written (the reader's allow-list names the same).

void WriteSize(pickle::Pickler& p, const std::vector<int64_t>& v) {
  p.Global("torch", "Size");
  p.Mark();
  p.Mark();
  for (int64_t x : v) p.Int(x);
  p.Tuple();
  p.Tuple();
  p.Reduce();
}

void NewObject(pickle::Pickler& p, const char* module, const char* cls) {
  p.Global(module, cls);
  p.EmptyTuple();
  p.NewObj();
}

void WriteOptStr(pickle::Pickler& p, const std::optional<std::string>& s) {
  if (s) {
    p.Str(*s);
  } else {
    p.None();
  }
}

void WriteEntry(pickle::Pickler& p, const DcpEntry& e) {
  if (e.is_bytes) {
    NewObject(p, internal::kDcpMetadataModule, "BytesStorageMetadata");  // no state, as Python pickles it
    return;
  }
  NewObject(p, internal::kDcpMetadataModule, "TensorStorageMetadata");
  p.EmptyDict();
  p.Mark();
  p.Str("properties");
  NewObject(p, internal::kDcpMetadataModule, "TensorProperties");
  p.Mark();
  p.Global("torch", DcpDtypeName(e.properties.dtype));
  p.Global("torch.serialization", "_get_layout");
  p.Mark();
  p.Str("torch.strided");
  p.Tuple();
  p.Reduce();
  p.Bool(e.properties.requires_grad);
  p.Global(internal::kDcpMetadataModule, "_MEM_FORMAT_ENCODING");
  p.Mark();
  p.Int(e.properties.memory_format);
  p.Tuple();
  p.Reduce();
  p.Bool(e.properties.pin_memory);
  if (e.properties.strides) {
    p.Mark();
    for (int64_t s : *e.properties.strides) p.Int(s);
    p.Tuple();
  } else {
    p.None();
  }
  p.Tuple();
  p.Build();
  p.Str("size");
  WriteSize(p, e.size);
  p.Str("chunks");
  p.EmptyList();
  p.Mark();
  for (const DcpChunk& c : e.chunks) {
    NewObject(p, internal::kDcpMetadataModule, "ChunkStorageMetadata");
    p.EmptyDict();
    p.Mark();
    p.Str("offsets");
    WriteSize(p, c.offsets);
    p.Str("sizes");
    WriteSize(p, c.sizes);
    p.SetItems();
    p.Build();
  }
  p.Appends();
  p.SetItems();
  p.Build();
}

// One storage_data item: MetadataIndex(fqn, offsets, index) -> _StorageInfo. A bytes entry's
// index has no offset and index None, as planner_helpers.py _create_write_item_for_bytesio.
void WriteStorageItem(pickle::Pickler& p, const std::string& fqn, const std::vector<int64_t>* offsets, int64_t index,
                      const DcpStorageInfo& s) {
  NewObject(p, internal::kDcpMetadataModule, "MetadataIndex");
  p.EmptyDict();
  p.Mark();
  p.Str("fqn");
  p.Str(fqn);
  p.Str("index");
  if (offsets) {
    p.Int(index);
    p.Str("offset");
    WriteSize(p, *offsets);
  } else {
    p.None();
  }
  p.SetItems();
  p.Build();
  NewObject(p, internal::kDcpFilesystemModule, "_StorageInfo");
  p.EmptyDict();
  p.Mark();
  p.Str("relative_path");
  p.Str(s.relative_path);
  p.Str("offset");
  p.Int(s.offset);
  p.Str("length");
  p.Int(s.length);
  p.SetItems();
  p.Build();
}

}  // namespace

std::vector<char> SerializeDcpMetadata(const DcpMetadata& m) {
  ValidateDcpMetadata(m, "SerializeDcpMetadata: ");
  pickle::Pickler p("DCP metadata");
  NewObject(p, internal::kDcpMetadataModule, "Metadata");
  p.EmptyDict();
  p.Mark();
  p.Str("state_dict_metadata");
  p.EmptyDict();
  p.Mark();
  for (const DcpEntry& e : m.entries) {
    p.Str(e.fqn);
    WriteEntry(p, e);
  }
  p.SetItems();
  p.Str("planner_data");
  if (m.has_planner_data) {
    p.EmptyDict();
    p.Mark();
    for (const DcpEntry& e : m.entries) {
      p.Str(e.fqn);
      p.Mark();
      if (e.object_path.empty()) p.Str(e.fqn);
      for (const DcpPathElement& x : e.object_path) {
        if (const auto* s = std::get_if<std::string>(&x)) {
          p.Str(*s);
        } else {
          p.Int(std::get<int64_t>(x));
        }
      }
      p.Tuple();
    }
    p.SetItems();
  } else {
    p.None();
  }
  p.Str("storage_data");
  p.EmptyDict();
  p.Mark();
  for (const DcpEntry& e : m.entries) {
    if (e.is_bytes) WriteStorageItem(p, e.fqn, nullptr, 0, e.bytes_storage);
    for (size_t c = 0; c < e.chunks.size(); ++c) {
      WriteStorageItem(p, e.fqn, &e.chunks[c].offsets, static_cast<int64_t>(c), e.chunks[c].storage);
    }
  }
  p.SetItems();
  p.Str("storage_meta");
  if (m.storage_meta) {
    NewObject(p, internal::kDcpMetadataModule, "StorageMeta");
    p.EmptyDict();
    p.Mark();
    p.Str("checkpoint_id");
    WriteOptStr(p, m.storage_meta->checkpoint_id);
    p.Str("save_id");
    WriteOptStr(p, m.storage_meta->save_id);
    p.Str("load_id");
    WriteOptStr(p, m.storage_meta->load_id);
    p.Str("modules");
    p.EmptyList();
    p.Mark();
    for (const std::string& s : m.storage_meta->modules) p.Str(s);
    p.Appends();
    p.SetItems();
    p.Build();
  } else {
    p.None();
  }
  p.Str("version");
  WriteOptStr(p, m.version);
  p.SetItems();
  p.Build();
  return p.Finish();
}

}  // namespace fsdp::checkpoint
