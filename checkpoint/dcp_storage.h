// The storage layer of PyTorch's distributed checkpoint (DCP) on a local file system: the
// directory layout of torch/distributed/checkpoint/filesystem.py (FileSystemWriter with its
// defaults: single_file_per_rank, one thread, TORCH_SAVE format, no stream transforms) and
// FileSystemReader, at the pinned PyTorch (v2.15.0). No collectives: the FSDP layer gathers
// the ranks' fragments to one rank, which calls WriteMetadata.
//
// On disk, a checkpoint is a directory holding
//  * `__<rank>_0.distcp` per rank: the rank's items back to back, bytes items first, then
//    tensor chunks in the order given (filesystem.py _write_files_from_queue). A tensor chunk
//    is a whole torch.save archive of the local tensor (filesystem.py _write_item calls
//    torch.save per item; checkpoint_writer.h writes the same archive), a bytes item its raw
//    bytes (DCP torch.save's a non-tensor value into them);
//  * `.metadata` (dcp_metadata.h), written last: a checkpoint is complete only once it exists.
//
// Contracts:
//  * WriteRankData(dir, rank, tensors, bytes) creates `dir` (and its parents) if needed,
//    removes a `.metadata` left there (so an interrupted overwrite never looks complete),
//    writes `__<rank>_0.distcp` atomically (a temporary file renamed over it) and returns the
//    rank's fragment: one entry per FQN with the chunks it wrote (a rank may write several
//    chunks of one tensor) and where each is stored. Preconditions of each tensor item: the
//    local tensor's dtype is `dtype`, it has the global size's dimensions, and
//    offsets + local sizes lie inside the global size; anything else is an error naming the
//    item. The local tensor may be on any device and be a view: it is copied to the CPU and,
//    when its storage holds more than it (filesystem.py _SerialCpuLoader), cloned first.
//  * WriteMetadata(dir, fragments) merges the fragments in order (a tensor's chunks in rank
//    order, as default_planner.py create_default_global_save_plan), checks every tensor is
//    covered exactly (same size and dtype on every rank, no overlap, chunk volumes summing to
//    the tensor's), and writes `dir/.metadata` atomically.
//  * ReadMetadata(dir) parses `dir/.metadata` (every ParseDcpMetadata check).
//  * ReadInto(dir, metadata, fqn, dest_offsets, dest) fills `dest`, the box of the
//    global tensor at `dest_offsets` with dest's sizes (any box: the saved sharding does not
//    matter), from the stored chunks that overlap it. Of such a chunk only the archive's
//    directory and pickle are parsed (ReadCheckpoint's checks); its tensor's bytes are read
//    once, in blocks of DcpReader::kBlockBytes, each CRC-32-checked as it arrives, the part
//    the box needs straight into `dest` where it can (dcp_read.cc says when). Memory beyond
//    `dest`: one block (or one dim-0 row of the chunk, when larger). Files whose chunks do not
//    overlap are not opened. On an error, dest's content is unspecified.
//    DcpReader does the same for many tensors, keeping its files open and its block.
//  * ReadBytes(dir, metadata, fqn) returns a bytes entry's raw bytes (a torch.save archive when
//    Python wrote them: ReadCheckpoint reads it).
//  Errors are c10::Errors that start with the function's name and name the file and the
//  offending value: a missing file, a range outside its file (truncated), an item that is not
//  the tensor the metadata says, a FQN not in the checkpoint, a box outside the tensor, a dtype
//  or dimension mismatch, chunks that do not cover the box.
#ifndef FSDP_CHECKPOINT_DCP_STORAGE_H_
#define FSDP_CHECKPOINT_DCP_STORAGE_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/dcp_metadata.h"

namespace fsdp::checkpoint {

// One chunk of a tensor that a rank writes: the box at `offsets` with local's sizes.
struct DcpTensorItem {
  std::string fqn;
  std::vector<int64_t> global_size;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> offsets;
  at::Tensor local;
};

// A non-tensor value, already serialized (DCP's BYTE_IO: e.g. WriteCheckpoint of the value,
// which Python's dcp.load turns back into it with torch.load).
struct DcpBytesItem {
  std::string fqn;
  std::vector<char> bytes;
};

// What one rank wrote: state_dict_metadata entries holding only this rank's chunks.
struct DcpFragment {
  std::vector<DcpEntry> entries;
};

// The name of a rank's data file, "__<rank>_0.distcp" (filesystem.py: the _StoragePrefix
// "__<rank>_", a file counter, DEFAULT_SUFFIX).
std::string DcpDataFileName(int64_t rank);

DcpFragment WriteRankData(const std::string& dir, int64_t rank, const std::vector<DcpTensorItem>& tensors,
                          const std::vector<DcpBytesItem>& bytes = {});

// The fragment WriteRankData(dir, rank, tensors, bytes) returns, without writing anything: for
// a caller that announces its fragment before the file exists (dcp::AsyncSave). Each tensor
// item's local tensor must be contiguous: then its archive's length depends only on its dtype
// and sizes. The same checks and errors as WriteRankData's fragment.
DcpFragment PredictRankData(int64_t rank, const std::vector<DcpTensorItem>& tensors,
                            const std::vector<DcpBytesItem>& bytes = {});

// The checkpoint's metadata from the ranks' fragments, in rank order (what WriteMetadata
// writes, with storage_meta.checkpoint_id = `checkpoint_id` and a fresh save_id).
DcpMetadata MergeDcpFragments(const std::vector<DcpFragment>& fragments, const std::string& checkpoint_id);

void WriteMetadata(const std::string& dir, const std::vector<DcpFragment>& fragments);

// A fragment as bytes and back, for gathering the fragments to one rank (the metadata pickle
// of its entries, without the coverage check; ParseDcpFragment validates like ReadMetadata).
std::vector<char> SerializeDcpFragment(const DcpFragment& fragment);
DcpFragment ParseDcpFragment(const std::vector<char>& bytes, const std::string& source);

DcpMetadata ReadMetadata(const std::string& dir);

// Reads tensors and bytes entries of the checkpoint in `dir` that `metadata` describes (which
// must outlive it), keeping the data files it opened and its scratch block between calls.
// Errors start with `caller` (a string literal). Not thread-safe.
class DcpReader {
 public:
  // The most bytes read per pread: small enough that the CRC-32 of a block runs while it is
  // still in the core's cache, large enough that syscalls cost nothing.
  static constexpr int64_t kBlockBytes = int64_t{1} << 19;

  DcpReader(std::string dir, const DcpMetadata& metadata, const char* caller = "ReadInto");
  ~DcpReader();
  DcpReader(const DcpReader&) = delete;
  DcpReader& operator=(const DcpReader&) = delete;

  void ReadInto(const std::string& fqn, const std::vector<int64_t>& dest_offsets, const at::Tensor& dest);
  // The checks of ReadInto that need only the metadata and the file system: the box, and
  // each overlapping chunk's file (it opens) and byte range (inside the file). A ReadInto
  // after it fails only on a read error or a damaged data file (an archive that is not the
  // chunk the metadata says, corrupted bytes).
  void Prepare(const std::string& fqn, const std::vector<int64_t>& dest_offsets, const at::Tensor& dest);
  std::vector<char> ReadBytes(const std::string& fqn);

 private:
  struct OpenFile;
  struct Located {  // a stored chunk, located
    int fd = -1;
    std::string path;
    int64_t base = 0;  // the chunk's offset in its file
    LocatedTensor tensor;
  };
  void ForEachOverlap(
      const std::string& fqn, const std::vector<int64_t>& dest_offsets, const at::Tensor& dest,
      const std::function<void(const DcpEntry&, const DcpChunk&, const std::vector<int64_t>&, const at::Tensor&)>& fn);
  const Located& Locate(const DcpEntry& e, const DcpChunk& c);
  // A stored tensor's record: `size` bytes at `offset` of file `fd`, holding `stored` (meta).
  struct Record {
    int fd;
    std::string path;
    int64_t offset, size;
    bool whole;  // read all of it (for its CRC-32), not just the part the box needs
    at::Tensor stored;
    std::string what, name;  // for errors: "<source> is not a valid checkpoint: ", the record
  };
  // Reads the part of `r` at src_lo into `dst`; returns the CRC-32 of the bytes read.
  uint32_t ReadRecord(const Record& r, const std::vector<int64_t>& src_lo, const at::Tensor& dst);
  // Reads a chunk not located yet in file order, guessing DCP's layout from its first local
  // header, then locates it and checks the guess and the CRC-32; false: the guess was wrong
  // (`dst` must be read again as located).
  bool ReadChunkInOrder(const DcpEntry& e, const DcpChunk& c, const std::vector<int64_t>& src_lo,
                        const at::Tensor& dst);
  void CheckCrc(const LocatedTensor& t, uint32_t crc) const;
  static std::string ItemName(const DcpEntry& e, const DcpChunk& c);
  std::string SourceOf(const DcpEntry& e, const DcpChunk& c) const;
  const DcpEntry& Entry(const std::string& fqn) const;
  OpenFile& File(const DcpStorageInfo& storage, const std::string& item);
  char* Scratch(size_t size);
  void ReadChunk(const DcpEntry& e, const DcpChunk& c, const std::vector<int64_t>& src_lo, const at::Tensor& dst);

  std::string dir_;
  const DcpMetadata& md_;
  const char* caller_;
  std::map<std::string, std::unique_ptr<OpenFile>> files_;
  std::map<std::pair<std::string, int64_t>, Located> located_;  // by (file, offset)
  at::Tensor scratch_;                                          // bytes; grows to the largest block asked for
};

void ReadInto(const std::string& dir, const DcpMetadata& metadata, const std::string& fqn,
              const std::vector<int64_t>& dest_offsets, const at::Tensor& dest);

std::vector<char> ReadBytes(const std::string& dir, const DcpMetadata& metadata, const std::string& fqn);

}  // namespace fsdp::checkpoint

#endif  // FSDP_CHECKPOINT_DCP_STORAGE_H_
