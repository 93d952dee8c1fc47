// DcpReader (dcp_storage.h, dcp_read.cc) and the chunk writer (a streamed TorchSaveWriter): the reader's three ways of
// reading a box out of a stored chunk (straight into the destination, dim-0 rows through the scratch block, the whole
// record for a chunk stored with other strides) give the same values as indexing the full tensor; a partial read holds
// one block, not the chunk; every byte of a record is CRC-checked, also the ones the box does not need.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/dcp_metadata.h"
#include "checkpoint/dcp_storage.h"
#include "checkpoint/file_io.h"
#include "testing/allocation_counter.h"
#include "testing/expect_error.h"
#include "testing/test_dir.h"

namespace fsdp::checkpoint {
namespace {

// Writes `full` as the given chunks (offsets, sizes), one "rank" file each, and returns the
// metadata. `stored` turns each chunk into the tensor actually saved (its strides may differ).
DcpMetadata WriteChunks(const std::string& dir, const at::Tensor& full,
                        const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>>& chunks,
                        at::Tensor (*stored)(const at::Tensor&) = nullptr) {
  std::vector<DcpFragment> fragments;
  for (size_t rank = 0; rank < chunks.size(); ++rank) {
    at::Tensor box = full;
    for (size_t d = 0; d < chunks[rank].first.size(); ++d) {
      box = box.narrow(d, chunks[rank].first[d], chunks[rank].second[d]);
    }
    box = box.contiguous();
    if (stored != nullptr) box = stored(box);
    fragments.push_back(
        WriteRankData(dir, rank, {{"t", full.sizes().vec(), full.scalar_type(), chunks[rank].first, box}}));
  }
  WriteMetadata(dir, fragments);
  return ReadMetadata(dir);
}

// Reads the box at `offsets` of size `sizes` into `dest` (which may be a strided view) and
// compares it with indexing `full`.
void ExpectBox(DcpReader& reader, const at::Tensor& full, const std::vector<int64_t>& offsets, const at::Tensor& dest,
               const std::string& what) {
  dest.fill_(7);  // every element must be written
  reader.ReadInto("t", offsets, dest);
  at::Tensor want = full;
  for (size_t d = 0; d < offsets.size(); ++d) want = want.narrow(d, offsets[d], dest.size(d));
  EXPECT_TRUE(at::equal(dest, want)) << what << " box at [" << absl::StrJoin(offsets, ", ") << "] of size "
                                     << dest.sizes();
}

at::Tensor Transposed(const at::Tensor& t) { return t.t().contiguous().t(); }  // same values, column-major

TEST(DcpRead, EveryReadPathGivesTheIndexedValues) {
  const at::Tensor full = at::randn({37, 29});
  const std::vector<std::pair<std::string, std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>>>>
      layouts = {
          {"rows", {{{0, 0}, {20, 29}}, {{20, 0}, {17, 29}}}},                         // Shard(0): direct reads
          {"columns", {{{0, 0}, {37, 10}}, {{0, 10}, {37, 19}}}},                      // Shard(1): rows of chunks
          {"blocks", {{{0, 0}, {20, 10}}, {{0, 10}, {20, 19}}, {{20, 0}, {17, 29}}}},  // 2-D
          {"whole", {{{0, 0}, {37, 29}}}},
      };
  for (bool transposed : {false, true}) {
    for (const auto& [name, chunks] : layouts) {
      const std::string dir = fsdp::testing::NewTestPath("paths");
      const DcpMetadata md = WriteChunks(dir, full, chunks, transposed ? Transposed : nullptr);
      DcpReader reader(dir, md);
      const std::string what = absl::StrCat(name, transposed ? " (stored column-major)" : "");
      const std::vector<std::vector<int64_t>> boxes = {{0, 0, 37, 29}, {3, 0, 20, 29},  {19, 0, 2, 29},
                                                       {0, 5, 37, 9},  {11, 7, 13, 15}, {36, 28, 1, 1}};
      for (const auto& b : boxes) {
        ExpectBox(reader, full, {b[0], b[1]}, at::empty({b[2], b[3]}), what);
        ExpectBox(reader, full, {b[0], b[1]}, at::empty({b[3], b[2]}).t(), what + ", strided destination");
      }
    }
  }
}

TEST(DcpRead, APartialReadHoldsOneBlockNotTheChunk) {
  testing::ScopedAllocationCounter::Install();
  // One 16 MiB chunk (rows of 4 KiB); the boxes need a row, a row band, and a column strip.
  const at::Tensor full = at::randn({4096, 1024});
  const std::string dir = fsdp::testing::NewTestPath("bounded");
  const DcpMetadata md = WriteChunks(dir, full, {{{0, 0}, {4096, 1024}}});
  const int64_t chunk = full.nbytes();
  for (const std::vector<int64_t>& b : std::vector<std::vector<int64_t>>{
           {2000, 0, 1, 1024}, {1000, 0, 700, 1024}, {0, 3, 4096, 2}, {100, 100, 50, 50}}) {
    at::Tensor dest = at::empty({b[2], b[3]});
    testing::ScopedAllocationCounter counter;
    {
      DcpReader reader(dir, md);
      reader.ReadInto("t", {b[0], b[1]}, dest);
    }
    EXPECT_LE(counter.peak(), DcpReader::kBlockBytes + 64 * 1024)
        << "box [" << absl::StrJoin(b, ", ") << "] of a " << chunk << "-byte chunk";
    EXPECT_TRUE(at::equal(dest, full.narrow(0, b[0], b[2]).narrow(1, b[1], b[3])));
  }
}

TEST(DcpRead, EveryByteOfARecordIsChecked) {
  const at::Tensor full = at::arange(4096 * 64, at::kFloat).view({4096, 64});
  const std::string dir = fsdp::testing::NewTestPath("crc");
  const DcpMetadata md = WriteChunks(dir, full, {{{0, 0}, {4096, 64}}});
  const std::string file = dir + "/__0_0.distcp";
  std::vector<char> bytes = ReadFile(file, "test");
  const std::string text(bytes.begin(), bytes.end());
  const size_t first_row = text.find(std::string(static_cast<const char*>(full.data_ptr()), 256));
  ASSERT_NE(first_row, std::string::npos);
  bytes[first_row + 8] ^= 0x01;  // in row 0
  WriteFileAtomically(file, bytes, "test");
  // The box is the last rows (and, second, a column strip): row 0 is read only for the CRC.
  EXPECT_ERROR_CONTAINS(ReadInto(dir, md, "t", {4000, 0}, at::empty({96, 64})), "has CRC-32 ");
  EXPECT_ERROR_CONTAINS(ReadInto(dir, md, "t", {1000, 3}, at::empty({100, 2})), "(corrupted)");
}

TEST(DcpRead, BoolBytesOtherThanZeroOrOneAreAnError) {
  const at::Tensor full = at::rand({300, 40}) > 0.5;
  const std::string dir = fsdp::testing::NewTestPath("bool");
  const DcpMetadata md = WriteChunks(dir, full, {{{0, 0}, {300, 40}}});
  at::Tensor back = at::empty({300, 40}, at::kBool);
  ReadInto(dir, md, "t", {0, 0}, back);
  EXPECT_TRUE(at::equal(back, full));
  // A 2 in the storage: the value check runs on each block as it arrives, before the record's
  // CRC-32 is compared at its end.
  const std::string file = dir + "/__0_0.distcp";
  std::vector<char> bytes = ReadFile(file, "test");
  const std::string text(bytes.begin(), bytes.end());
  const size_t at = text.find(std::string(static_cast<const char*>(full.data_ptr()), 200));
  ASSERT_NE(at, std::string::npos);
  bytes[at + 3] = 2;
  WriteFileAtomically(file, bytes, "test");
  EXPECT_ERROR_CONTAINS(ReadInto(dir, md, "t", {0, 0}, back), "holds byte 2");
}

// A DCP chunk as WriteRankData streams it (TorchSaveWriter into the rank's file): the bytes
// WriteCheckpoint builds in memory, read back with the tensor's strides and storage offset,
// its storage record located at a 64-byte boundary (torch.load(mmap=True) maps it there).
TEST(ChunkArchive, StreamsWhatWriteCheckpointBuildsAndReadsBack) {
  const at::Tensor big = at::randn({4, 6});
  const std::vector<at::Tensor> tensors = {
      at::randn({3, 5}),
      at::tensor(2.5),
      at::randn({300}).to(at::kBFloat16),
      at::randint(0, 1000, {70000}, at::kLong),
      at::randn({2, 3, 4}, at::kDouble),
      at::rand({17}) > 0.5,
      at::randn({4, 0}),
      at::randint(-100, 100, {9, 300}, at::kInt).to(at::kChar),
      at::randn({6}, at::kComplexFloat),
      big.t(),              // non-contiguous: its storage as it is, with its strides
      big.narrow(0, 1, 2),  // a view: the whole storage, with its offset
  };
  for (const at::Tensor& t : tensors) {
    const std::string what = absl::StrCat(c10::toString(t.scalar_type()), " ", c10::str(t.sizes()));
    const std::string path = fsdp::testing::NewTestPath("archive") + ".bin";
    {
      AtomicFile out(path, "test");
      TorchSaveWriter([&out](const char* data, size_t size) { out.Write(data, size); }, "test").Finish(t);
      out.Commit();
    }
    const std::vector<char> ours = ReadFile(path, "test");
    EXPECT_EQ(ours, WriteCheckpoint(c10::IValue(t))) << what;
    const c10::IValue back = ReadCheckpoint(ours.data(), ours.size(), "ours");
    ASSERT_TRUE(back.isTensor()) << what;
    EXPECT_TRUE(at::equal(back.toTensor(), t)) << what;
    EXPECT_EQ(back.toTensor().strides(), t.strides()) << what;
    EXPECT_EQ(back.toTensor().storage_offset(), t.storage_offset()) << what;
    const LocatedTensor located = LocateCheckpointTensor(
        ours.size(), [&](uint64_t offset, size_t n, char* out) { std::memcpy(out, ours.data() + offset, n); }, "ours");
    EXPECT_EQ(located.record_size, t.storage().nbytes()) << what;
    EXPECT_EQ(located.record_offset % 64, 0u) << what;
  }
  AtomicFile out(fsdp::testing::NewTestPath("archive") + ".bin", "test");
  EXPECT_ERROR_CONTAINS(TorchSaveWriter([&out](const char* data, size_t size) { out.Write(data, size); }, "test")
                            .Finish(at::zeros({3}, at::kUInt16)),
                        "test: cannot write a UInt16 tensor");
  EXPECT_EQ(out.size(), 0);
}

// A file another process truncates while it is being written is an error at Commit, which
// leaves nothing at the path (a checkpoint file cut short never looks complete).
TEST(AtomicFile, CommitRejectsATemporaryTruncatedByAnotherProcess) {
  const std::string path = fsdp::testing::NewTestPath("truncated") + ".bin";
  const std::vector<char> bytes(4096, 'x');
  {
    AtomicFile out(path, "test");
    out.Write(bytes);
    std::string tmp;
    const std::filesystem::path p(path);
    for (const auto& entry : std::filesystem::directory_iterator(p.parent_path())) {
      if (absl::StartsWith(entry.path().filename().string(), p.filename().string() + ".tmp.")) tmp = entry.path();
    }
    ASSERT_FALSE(tmp.empty());
    ASSERT_EQ(::truncate(tmp.c_str(), 100), 0);
    EXPECT_ERROR_CONTAINS(out.Commit(), "holds 100 bytes after 4096 were written (truncated or changed by another");
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  WriteFileAtomically(path, bytes, "test");  // untouched, the same bytes commit
  EXPECT_EQ(ReadFile(path, "test"), bytes);
}

}  // namespace
}  // namespace fsdp::checkpoint
