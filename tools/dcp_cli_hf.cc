// The `dcp` tool's Hugging Face subcommands (dcp_cli_lib.h): ls of a Hugging Face directory,
// from-hf and to-hf. Both conversions stream: at most kStreamBytes of tensor data are in
// memory at a time (rows of a larger tensor are read and written in pieces).
#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/dcp_metadata.h"
#include "checkpoint/dcp_storage.h"
#include "checkpoint/file_io.h"
#include "checkpoint/hf_checkpoint.h"
#include "tools/dcp_cli_lib.h"

namespace dcp_cli {
namespace {

using fsdp::checkpoint::DcpEntry;
using fsdp::checkpoint::DcpPathElement;
using fsdp::checkpoint::HfCheckpointReader;
using fsdp::checkpoint::HfTensor;
using fsdp::checkpoint::JoinPath;

// Rows of a tensor per piece: at most kStreamBytes (at least one row).
int64_t RowsPerPiece(const std::vector<int64_t>& size, at::ScalarType dtype) {
  if (size.empty()) return 1;
  int64_t row = static_cast<int64_t>(c10::elementSize(dtype));
  for (size_t d = 1; d < size.size(); ++d) row *= size[d];
  return std::max<int64_t>(1, kStreamBytes / std::max<int64_t>(row, 1));
}

// Calls fn(row offset, rows) for each piece of a tensor of `size` (one call for a 0-d or empty
// tensor).
template <class Fn>
void ForEachPiece(const std::vector<int64_t>& size, at::ScalarType dtype, Fn&& fn) {
  if (size.empty() || size[0] == 0) return fn(int64_t{0}, size.empty() ? int64_t{1} : int64_t{0});
  const int64_t per = RowsPerPiece(size, dtype);
  for (int64_t r = 0; r < size[0]; r += per) fn(r, std::min(per, size[0] - r));
}

at::Tensor EmptyPiece(const std::vector<int64_t>& size, at::ScalarType dtype, int64_t rows) {
  std::vector<int64_t> shape = size;
  if (!shape.empty()) shape[0] = rows;
  return at::empty(shape, at::TensorOptions().dtype(dtype));
}

std::vector<int64_t> RowOffsets(size_t dims, int64_t row) {
  std::vector<int64_t> o(dims, 0);
  if (dims > 0) o[0] = row;
  return o;
}

}  // namespace

bool IsHuggingFaceDir(const std::string& dir) {
  std::error_code ec;
  if (std::filesystem::exists(JoinPath(dir, ".metadata"), ec)) return false;
  if (std::filesystem::exists(JoinPath(dir, fsdp::checkpoint::kHfIndexFile), ec)) return true;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (absl::EndsWith(e.path().filename().string(), ".safetensors")) return true;
  }
  return false;
}

at::ScalarType ParseDtype(const std::string& name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "bf16" || n == "bfloat16") return at::kBFloat16;
  if (n == "f16" || n == "fp16" || n == "float16" || n == "half") return at::kHalf;
  if (n == "f32" || n == "fp32" || n == "float32" || n == "float") return at::kFloat;
  if (n == "f64" || n == "fp64" || n == "float64" || n == "double") return at::kDouble;
  TORCH_CHECK(false, "--dtype: '", name, "' is not a floating-point dtype (bf16, f16, f32, f64)");
  return at::kFloat;  // unreachable: TORCH_CHECK(false) throws
}

void ListHuggingFace(const std::string& dir, std::ostream& out) {
  const HfCheckpointReader reader(dir, "ls");
  int64_t bytes = 0;
  for (const HfTensor& t : reader.tensors()) {
    int64_t n = static_cast<int64_t>(c10::elementSize(t.dtype));
    for (int64_t s : t.size) n *= s;
    bytes += n;
  }
  out << Printable(dir) << ": Hugging Face checkpoint, " << reader.tensors().size() << " tensors (" << bytes
      << " bytes) in " << reader.files().size() << (reader.files().size() == 1 ? " file\n" : " files\n");
  for (const HfTensor& t : reader.tensors()) {
    out << Printable(t.name) << ": " << fsdp::checkpoint::SafetensorsDtypeName(t.dtype) << " "
        << c10::str(c10::IntArrayRef(t.size));
    const auto file = [&](size_t f) {
      return Printable(std::filesystem::path(reader.files()[f]->source()).filename().string());
    };
    if (t.chunks.size() == 1) {
      out << ", " << file(t.chunks[0].file) << "\n";
      continue;
    }
    out << ", " << t.chunks.size() << " chunks\n";
    for (const auto& c : t.chunks) {
      out << "  offsets " << c10::str(c10::IntArrayRef(c.offsets)) << " sizes "
          << c10::str(c10::IntArrayRef(c.entry->shape)) << ": " << file(c.file) << "\n";
    }
  }
}

void FromHuggingFace(const std::string& hf_dir, const std::string& dir, const std::string& prefix, std::ostream& out) {
  const HfCheckpointReader reader(hf_dir, "from-hf");
  // Pieces of at most kStreamBytes go to data files of about that size, each written before
  // the next is read; the metadata lists every piece as a chunk of its tensor.
  std::vector<fsdp::checkpoint::DcpFragment> fragments;
  std::vector<fsdp::checkpoint::DcpTensorItem> pending;
  int64_t pending_bytes = 0, tensors = 0, data_bytes = 0;
  const auto flush = [&] {
    if (pending.empty()) return;
    fragments.push_back(fsdp::checkpoint::WriteRankData(dir, static_cast<int64_t>(fragments.size()), pending));
    pending.clear();
    pending_bytes = 0;
  };
  for (const HfTensor& t : reader.tensors()) {
    const std::string fqn = prefix + t.name;
    ForEachPiece(t.size, t.dtype, [&](int64_t row, int64_t rows) {
      int64_t n = rows * static_cast<int64_t>(c10::elementSize(t.dtype));
      for (size_t d = 1; d < t.size.size(); ++d) n *= t.size[d];
      if (pending_bytes + n > kStreamBytes) flush();  // before this piece is allocated
      at::Tensor piece = EmptyPiece(t.size, t.dtype, rows);
      const std::vector<int64_t> offsets = RowOffsets(t.size.size(), row);
      if (piece.numel() > 0) reader.ReadInto(t.name, offsets, piece);
      pending.push_back({fqn, t.size, t.dtype, offsets, piece});
      pending_bytes += n;
      data_bytes += n;
    });
    ++tensors;
  }
  flush();
  // One entry per tensor, in the reader's order, its chunks from every file; the object path
  // nests "model.<fqn>" as {"model": {fqn: ...}} (get_model_state_dict's nesting).
  fsdp::checkpoint::DcpFragment merged;
  absl::flat_hash_map<std::string, size_t> index;
  for (auto& f : fragments) {
    for (DcpEntry& e : f.entries) {
      auto [it, added] = index.emplace(e.fqn, merged.entries.size());
      if (added) {
        merged.entries.push_back(std::move(e));
        continue;
      }
      DcpEntry& into = merged.entries[it->second];
      for (auto& c : e.chunks) into.chunks.push_back(std::move(c));
    }
  }
  for (DcpEntry& e : merged.entries) {
    const std::string name = e.fqn.substr(prefix.size());
    if (prefix == "model.") {
      e.object_path = {DcpPathElement(std::string("model")), DcpPathElement(name)};
    } else {
      e.object_path = {DcpPathElement(e.fqn)};
    }
  }
  fsdp::checkpoint::WriteMetadata(dir, {merged});
  out << "wrote '" << Printable(dir) << "': " << fragments.size() << " data files and .metadata, " << tensors
      << " tensors (" << data_bytes << " bytes) under '" << Printable(prefix) << "<key>'\n";
}

void ToHuggingFace(const std::string& dir, const std::string& hf_dir, const std::string& prefix,
                   std::optional<at::ScalarType> dtype, int64_t max_shard_size, std::ostream& out) {
  const fsdp::checkpoint::DcpMetadata md = fsdp::checkpoint::ReadMetadata(dir);
  std::vector<fsdp::checkpoint::HfExportTensor> exported;
  std::vector<const DcpEntry*> entries;
  for (const DcpEntry& e : md.entries) {
    if (e.is_bytes || !absl::StartsWith(e.fqn, prefix)) continue;
    const at::ScalarType stored = e.properties.dtype;
    exported.push_back({e.fqn.substr(prefix.size()), dtype && at::isFloatingType(stored) ? *dtype : stored, e.size});
    entries.push_back(&e);
  }
  TORCH_CHECK(!entries.empty(), "'", dir, "' has no tensor under '", prefix,
              "' (--prefix chooses the keys exported; '' exports every tensor)");
  const fsdp::checkpoint::HfExportLayout layout(exported, max_shard_size);
  std::error_code ec;
  std::filesystem::create_directories(hf_dir, ec);
  TORCH_CHECK(!ec, "to-hf: cannot create '", hf_dir, "' (", ec.message(), ")");
  const std::string index_path = JoinPath(hf_dir, fsdp::checkpoint::kHfIndexFile);
  std::filesystem::remove(index_path, ec);  // an export being overwritten is incomplete until the end
  for (size_t f = 0; f < layout.file_count(); ++f) layout.CreateFile(hf_dir, f, "to-hf");
  fsdp::checkpoint::DcpReader reader(dir, md, "to-hf");
  {
    fsdp::checkpoint::HfExportWriter writer(layout, hf_dir, "to-hf");
    for (size_t i = 0; i < entries.size(); ++i) {
      const DcpEntry& e = *entries[i];
      ForEachPiece(e.size, e.properties.dtype, [&](int64_t row, int64_t rows) {
        at::Tensor piece = EmptyPiece(e.size, e.properties.dtype, rows);
        if (piece.numel() == 0) return;
        const std::vector<int64_t> offsets = RowOffsets(e.size.size(), row);
        reader.ReadInto(e.fqn, offsets, piece);
        writer.Write(exported[i].name, offsets, piece);
      });
    }
    writer.Sync();
  }
  const std::string index = layout.IndexJson();
  fsdp::checkpoint::WriteFileAtomically(index_path, std::vector<char>(index.begin(), index.end()), "to-hf");
  out << "wrote '" << Printable(hf_dir) << "': " << layout.file_count() << " safetensors files and "
      << fsdp::checkpoint::kHfIndexFile << ", " << entries.size() << " tensors (" << layout.total_size() << " bytes)\n";
}

}  // namespace dcp_cli
