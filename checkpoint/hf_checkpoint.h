// Hugging Face checkpoint directories: the layouts transformers' save_pretrained writes
// (`model.safetensors`, or `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`)
// and the per-rank layout of PyTorch 2.15's HuggingFaceStorageWriter(save_distributed=True)
// (torch/distributed/checkpoint/hf_storage.py, _hf_utils.py): files
// `shard-<s>-model-<i>-of-<n>.safetensors` whose __metadata__ holds "DCP_SHARDING_INFO", a
// JSON object {"<key>": {"saved_offsets": [...]}} giving where each tensor of the file (a box
// of the global tensor) sits. No model, no collectives: //dcp builds on this.
//
// HfCheckpointReader(dir) reads every header first (files are untrusted; every
// SafetensorsReader check) and checks: with an index, that it is JSON with a "weight_map"
// object of key -> file name (a plain name in `dir`), each named file opens and holds the
// key; without one, that `dir` holds *.safetensors files (all are read, in name order). A
// DCP_SHARDING_INFO value must name every tensor of its file with non-negative offsets, one
// per dimension. A tensor's chunks (one per file holding it) must agree on dtype and
// dimensions; its global size is the largest extent of its chunks (as PyTorch's reader
// computes it), and they must tile it: no overlap, volumes summing to its element count.
// Errors are c10::Errors starting with the caller, naming the file and key and the bad value.
//
// ReadInto(key, dest_offsets, dest) fills `dest` (any dtype, strides or device: values are
// converted as Tensor::copy_ converts), the box of the global tensor at dest_offsets with
// dest's sizes, from the chunks that overlap it. Only the bytes of the overlap are read
// (pread): straight into dest when its part is contiguous CPU memory of the stored dtype and
// one byte range of the chunk, otherwise through a block of at most kBlockBytes (or one
// contiguous run of the overlap, when larger: a row of a column-sharded read). Const reads
// may run concurrently.
//
// HfExportLayout plans a consolidated export (what save_pretrained writes for a state dict,
// and _consolidate_hf_safetensors.py's output): tensors in the given order are split into
// files by huggingface_hub's rule (split_state_dict_into_shards_factory: a tensor that would
// take the current file over max_shard_size starts a new one; a tensor larger than it gets its
// own), named model-0000i-of-0000N.safetensors; each file's bytes are those of
// safetensors.torch.save_file(tensors, metadata={"format": "pt"}) (save_pretrained's call), so
// a file can be written in pieces by several ranks: its head first (CreateFile), then any
// part of any tensor (WritePart). IndexJson is model.safetensors.index.json as PyTorch's
// consolidation writes it (json.dump(indent=2) of {"metadata": {"total_size"}, "weight_map"}).
#ifndef FSDP_CHECKPOINT_HF_CHECKPOINT_H_
#define FSDP_CHECKPOINT_HF_CHECKPOINT_H_

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "checkpoint/safetensors.h"

namespace fsdp::checkpoint {

inline constexpr char kHfIndexFile[] = "model.safetensors.index.json";
inline constexpr char kHfShardedDir[] = "sharded";
inline constexpr char kHfShardingInfoKey[] = "DCP_SHARDING_INFO";
inline constexpr char kHfSavedOffsetsKey[] = "saved_offsets";

// "model-00002-of-00005.safetensors", or with shard_index >= 0
// "shard-00003-model-00002-of-00005.safetensors" (_hf_utils.py _gen_file_name; 1-based).
std::string HfFileName(int64_t index, int64_t count, int64_t shard_index = -1);

// The __metadata__ of a per-rank file: {"DCP_SHARDING_INFO": json.dumps of {key:
// {"saved_offsets": offsets}} in the given order, "DCP_VERSION": "1.0", "format": "pt"}, as
// filesystem.py writes it.
SafetensorsMetadata HfShardingMetadata(const std::vector<std::pair<std::string, std::vector<int64_t>>>& offsets);

// "5GB", "500MB", "1.5KB" (huggingface_hub's parse_size_to_int: decimal units TB, GB, MB, KB),
// or a plain byte count. Errors name `what` and the text.
int64_t ParseHfSize(const std::string& text, const std::string& what);

// A stored block of a tensor: its box of the global tensor, in entry `entry` of file `file`.
struct HfChunk {
  size_t file = 0;
  const SafetensorsEntry* entry = nullptr;
  std::vector<int64_t> offsets;
};

struct HfTensor {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> size;
  std::vector<HfChunk> chunks;
};

class HfCheckpointReader {
 public:
  static constexpr int64_t kBlockBytes = SafetensorsReader::kBlockBytes;

  explicit HfCheckpointReader(std::string dir, std::string caller = "HfCheckpointReader");

  const std::string& dir() const { return dir_; }
  // The files read, in name order (their paths: files()[i]->source()).
  const std::vector<std::unique_ptr<SafetensorsReader>>& files() const { return files_; }
  // Every tensor, in the order the files (then their headers) first name them.
  const std::vector<HfTensor>& tensors() const { return tensors_; }
  const HfTensor* Find(const std::string& key) const;

  void ReadInto(const std::string& key, const std::vector<int64_t>& dest_offsets, const at::Tensor& dest) const;

 private:
  void ReadChunk(const HfChunk& c, const std::vector<int64_t>& src_lo, const at::Tensor& dst) const;

  std::string dir_, caller_;
  std::vector<std::unique_ptr<SafetensorsReader>> files_;
  std::vector<HfTensor> tensors_;
  absl::flat_hash_map<std::string, size_t> index_;
};

// One tensor of an export: its key, the dtype written and its global shape.
struct HfExportTensor {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
};

class HfExportLayout {
 public:
  struct Place {
    size_t file = 0;
    int64_t data_begin = 0;  // of the tensor's bytes, in the file
  };

  // `max_shard_size` <= 0: one file. Errors: duplicate keys, what LayOutSafetensors rejects.
  HfExportLayout(const std::vector<HfExportTensor>& tensors, int64_t max_shard_size);

  size_t file_count() const { return files_.size(); }
  const std::string& file_name(size_t file) const { return names_[file]; }
  const SafetensorsLayout& file(size_t file) const { return files_[file]; }
  // The tensor's file and entry (null: not in the export).
  const SafetensorsEntry* Find(const std::string& key, size_t* file) const;
  int64_t total_size() const { return total_size_; }
  std::string IndexJson() const;

  // Creates (truncating) `dir`/file_name(file): its head, then zeros up to its full size
  // (sparse where the file system allows). Before any WritePart of the file.
  void CreateFile(const std::string& dir, size_t file, const char* caller) const;

 private:
  std::vector<std::string> names_;
  std::vector<SafetensorsLayout> files_;
  absl::flat_hash_map<std::string, std::pair<size_t, size_t>> index_;  // key -> file, entry
  std::vector<std::string> order_;                                     // keys, as given
  int64_t total_size_ = 0;
};

// Writes parts of tensors into the export files of `layout` under `dir` (made by CreateFile),
// converted to the export dtype. Keeps the files it writes open (without truncating them)
// until it goes; Sync fsyncs them. Errors start with `caller` and name the file and the key.
// Not thread-safe.
class HfExportWriter {
 public:
  HfExportWriter(const HfExportLayout& layout, std::string dir, std::string caller);
  ~HfExportWriter();
  HfExportWriter(const HfExportWriter&) = delete;
  HfExportWriter& operator=(const HfExportWriter&) = delete;

  // The box `src` (any dtype, device; other strides are copied once) of tensor `key` at
  // `offsets`, written in place through a block of at most HfCheckpointReader::kBlockBytes.
  void Write(const std::string& key, const std::vector<int64_t>& offsets, const at::Tensor& src);
  // Copies chunk `c` of `t` from `reader` into place (the consolidation of per-rank files),
  // a block of rows at a time.
  void Copy(const HfCheckpointReader& reader, const HfTensor& t, const HfChunk& c);
  // fsyncs every file written.
  void Sync();

 private:
  int FileFd(size_t file);
  // The contiguous runs of a box of `shape` at `offsets` in a row-major tensor of `global`:
  // calls fn(element offset in the box, element offset in the global tensor, elements).
  template <class Fn>
  static void ForEachRun(const std::vector<int64_t>& global, const std::vector<int64_t>& offsets,
                         const std::vector<int64_t>& shape, Fn&& fn);

  const HfExportLayout& layout_;
  std::string dir_, caller_;
  std::vector<int> fds_;
};

}  // namespace fsdp::checkpoint

#endif  // FSDP_CHECKPOINT_HF_CHECKPOINT_H_
