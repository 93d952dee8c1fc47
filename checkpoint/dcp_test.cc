// //checkpoint:dcp: PyTorch's distributed-checkpoint format. Chunks written as if by several
// ranks read back as a different sharding, exactly; the `.metadata` pickle round-trips and
// corrupt or malicious metadata and data files are clear errors; and, with the peer PyTorch
// (FSDP_PEER_PYTHON), a checkpoint Python's dcp.save wrote reads here and one written here
// loads with Python's dcp.load.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
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
#include "testing/expect_error.h"
#include "testing/peer_python.h"
#include "testing/test_dir.h"

namespace fsdp::checkpoint {
namespace {

void WriteBytes(const std::string& path, const std::vector<char>& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
  std::fclose(f);
}

void ExpectSame(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  EXPECT_EQ(got.scalar_type(), want.scalar_type()) << what;
  EXPECT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(at::equal(got, want)) << what << "\ngot\n" << got << "\nwant\n" << want;
}

// The box of `full` at `offsets` with `sizes`, read from the checkpoint into a fresh tensor.
at::Tensor ReadBox(const std::string& dir, const DcpMetadata& md, const std::string& fqn, const at::Tensor& full,
                   const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
  at::Tensor out = at::full(sizes, 7, full.options());  // not zero: every element must be written
  ReadInto(dir, md, fqn, offsets, out);
  at::Tensor want = full;
  for (size_t d = 0; d < sizes.size(); ++d) want = want.narrow(d, offsets[d], sizes[d]);
  ExpectSame(out, want, absl::StrCat(fqn, " at [", absl::StrJoin(offsets, ", "), "]"));
  return out;
}

// A two-rank-style checkpoint of a 2-D tensor: rows [0, 2) and [2, 4) of `t`.
std::string SmallCheckpoint(const at::Tensor& t) {
  const std::string dir = fsdp::testing::NewTestPath("small");
  std::vector<DcpFragment> fragments;
  for (int64_t r = 0; r < 2; ++r) {
    fragments.push_back(WriteRankData(dir, r, {{"t", {4, 3}, at::kFloat, {2 * r, 0}, t.narrow(0, 2 * r, 2)}}));
  }
  WriteMetadata(dir, fragments);
  return dir;
}

TEST(Dcp, ChunksOfSeveralRanksReadBackAsAnotherSharding) {
  const at::Tensor w = at::randn({12, 10});
  const at::Tensor v = at::arange(72, at::kLong).reshape({9, 8});
  const at::Tensor b = at::randn({7}).to(at::kBFloat16);
  const at::Tensor s = at::scalar_tensor(2.5, at::kDouble);
  const std::string dir = fsdp::testing::NewTestPath("reshard") + "/nested/ckpt";  // created with its parents
  // w: 4 uneven row shards (ranks 0-3); v: 2 column shards (non-contiguous views, ranks 0-1);
  // b: one chunk on each of ranks 0 and 1 plus one more on rank 1; a 0-d tensor and a bytes item.
  const int64_t rows[] = {0, 4, 6, 11, 12};
  std::vector<std::vector<DcpTensorItem>> items(4);
  for (int r = 0; r < 4; ++r) {
    items[r].push_back({"w", {12, 10}, at::kFloat, {rows[r], 0}, w.narrow(0, rows[r], rows[r + 1] - rows[r])});
  }
  items[0].push_back({"layer.v", {9, 8}, at::kLong, {0, 0}, v.narrow(1, 0, 5)});
  items[1].push_back({"layer.v", {9, 8}, at::kLong, {0, 5}, v.narrow(1, 5, 3)});
  items[0].push_back({"b", {7}, at::kBFloat16, {0}, b.narrow(0, 0, 3)});
  items[1].push_back({"b", {7}, at::kBFloat16, {3}, b.narrow(0, 3, 2)});
  items[1].push_back({"b", {7}, at::kBFloat16, {5}, b.narrow(0, 5, 2)});
  items[2].push_back({"s", {}, at::kDouble, {}, s});
  std::vector<DcpFragment> fragments;
  for (int r = 0; r < 4; ++r) {
    std::vector<DcpBytesItem> bytes;
    if (r == 3) bytes.push_back({"step", WriteCheckpoint(c10::IValue(int64_t{42}))});
    fragments.push_back(WriteRankData(dir, r, items[r], bytes));
    // A fragment survives the trip to the rank that writes the metadata.
    EXPECT_EQ(ParseDcpFragment(SerializeDcpFragment(fragments.back()), "'fragment'").entries, fragments.back().entries);
  }
  EXPECT_ERROR_CONTAINS(ReadMetadata(dir), "ReadMetadata: cannot open '" + dir + "/.metadata' for reading");
  WriteMetadata(dir, fragments);

  const DcpMetadata md = ReadMetadata(dir);
  EXPECT_EQ(md.entries, MergeDcpFragments(fragments, dir).entries);
  EXPECT_EQ(md.version, "1.0.0");
  ASSERT_TRUE(md.storage_meta.has_value());
  EXPECT_EQ(md.storage_meta->checkpoint_id, dir);
  const DcpEntry* we = md.Find("w");
  ASSERT_NE(we, nullptr);
  ASSERT_EQ(we->chunks.size(), 4u);
  EXPECT_EQ(we->chunks[2].offsets, (std::vector<int64_t>{6, 0}));
  EXPECT_EQ(we->chunks[2].sizes, (std::vector<int64_t>{5, 10}));
  EXPECT_EQ(we->chunks[2].storage.relative_path, "__2_0.distcp");
  EXPECT_EQ(md.Find("b")->chunks.size(), 3u);

  // Three new shards of each, one an N-D box across every stored chunk, and the whole tensors.
  ReadBox(dir, md, "w", w, {0, 0}, {5, 10});
  ReadBox(dir, md, "w", w, {5, 0}, {7, 4});
  ReadBox(dir, md, "w", w, {5, 4}, {7, 6});
  ReadBox(dir, md, "w", w, {2, 3}, {9, 6});
  ReadBox(dir, md, "w", w, {0, 0}, {12, 10});
  ReadBox(dir, md, "w", w, {3, 3}, {0, 4});  // empty
  for (int64_t r = 0; r < 3; ++r) ReadBox(dir, md, "layer.v", v, {3 * r, 0}, {3, 8});
  ReadBox(dir, md, "layer.v", v, {1, 2}, {7, 5});
  ReadBox(dir, md, "b", b, {2}, {4});
  ReadBox(dir, md, "s", s, {}, {});
  const c10::IValue step = ReadCheckpoint(ReadBytes(dir, md, "step").data(), ReadBytes(dir, md, "step").size(), "step");
  EXPECT_EQ(step.toInt(), 42);

  // A destination that requires grad is filled like its data.
  at::Tensor param = at::zeros({2, 10}, at::requires_grad());
  ReadInto(dir, md, "w", {4, 0}, param);
  ExpectSame(param.detach(), w.narrow(0, 4, 2), "param");

  // Only the files of overlapping chunks are opened: without rank 3's file (w rows 11+),
  // rows [0, 11) still read, and row 11 names the missing file.
  ASSERT_EQ(std::remove((dir + "/__3_0.distcp").c_str()), 0);
  ReadBox(dir, md, "w", w, {0, 0}, {11, 10});
  at::Tensor last = at::empty({1, 10});
  EXPECT_ERROR_CONTAINS(ReadInto(dir, md, "w", {11, 0}, last),
                        "ReadInto: cannot open '" + dir +
                            "/__3_0.distcp' (holding the chunk of 'w' at offsets [11, 0])"
                            " for reading (No such file or directory)");
  EXPECT_ERROR_CONTAINS(ReadBytes(dir, md, "step"), "/__3_0.distcp' (holding bytes entry 'step')");
}

TEST(Dcp, MetadataRoundTripsThroughItsPickle) {
  DcpMetadata md;
  DcpEntry t;
  t.fqn = "opt.state.0.exp_avg";
  t.properties = {at::kHalf, true, 1, true, std::vector<int64_t>{1, 4}};
  t.size = {4, 70000};
  t.chunks = {{{0, 0}, {4, 1}, {"__0_0.distcp", 0, 300}}, {{0, 1}, {4, 69999}, {"__1_0.distcp", 1LL << 40, 5}}};
  t.object_path = {std::string("opt"), std::string("state"), int64_t{0}, std::string("exp_avg")};
  DcpEntry bytes;
  bytes.fqn = "step \xc3\xa9";  // UTF-8
  bytes.is_bytes = true;
  bytes.bytes_storage = {"__1_0.distcp", 0, 9};
  bytes.object_path = {bytes.fqn};
  DcpEntry zero_d;
  zero_d.fqn = "scalar";
  zero_d.properties.dtype = at::kComplexDouble;
  zero_d.chunks = {{{}, {}, {"__0_0.distcp", 300, 1}}};
  zero_d.object_path = {std::string("scalar")};
  md.entries = {t, bytes, zero_d};
  md.storage_meta = DcpStorageMeta{"/ckpt", "save", std::nullopt, {"a", "b"}};
  md.version = kDcpVersion;
  const std::vector<char> pickle = SerializeDcpMetadata(md);
  EXPECT_EQ(ParseDcpMetadata(pickle.data(), pickle.size(), "'m'"), md);
  md.has_planner_data = false;
  md.storage_meta.reset();
  md.version.reset();
  for (DcpEntry& e : md.entries) e.object_path.clear();
  const std::vector<char> bare = SerializeDcpMetadata(md);
  EXPECT_EQ(ParseDcpMetadata(bare.data(), bare.size(), "'m'"), md);

  // The writer refuses what the reader would reject.
  DcpMetadata bad = md;
  bad.entries[0].chunks[0].storage.relative_path = "../elsewhere";
  EXPECT_ERROR_CONTAINS(SerializeDcpMetadata(bad),
                        "SerializeDcpMetadata: the chunk of 'opt.state.0.exp_avg' at offsets [0, 0] of size [4, 1] is "
                        "stored in '../elsewhere', which is not a file name inside the checkpoint directory");
  bad = md;
  bad.entries[0].chunks[1].sizes = {4, 70000};
  EXPECT_ERROR_CONTAINS(SerializeDcpMetadata(bad), "lies outside the tensor's size [4, 70000]");
  bad = md;
  bad.entries[0].chunks[1].offsets = {0, 0};
  EXPECT_ERROR_CONTAINS(SerializeDcpMetadata(bad), "tensor 'opt.state.0.exp_avg' has two chunks at offsets [0, 0]");
  bad = md;
  bad.entries[0].properties.dtype = at::kQInt8;
  EXPECT_ERROR_CONTAINS(
      SerializeDcpMetadata(bad),
      "SerializeDcpMetadata: tensor 'opt.state.0.exp_avg' is QInt8, a dtype DCP files here do not hold");
  bad = md;
  bad.entries[1].fqn = "bad \xff";
  EXPECT_ERROR_CONTAINS(SerializeDcpMetadata(bad), "is not valid UTF-8");
}

// Replaces the `n`-th (from 0) occurrence of `from` in `bytes` with `to` (same length).
std::vector<char> Patch(std::vector<char> bytes, const std::string& from, const std::string& to, int n) {
  EXPECT_EQ(from.size(), to.size());
  std::string s(bytes.begin(), bytes.end());
  size_t pos = s.find(from);
  for (int i = 0; i < n && pos != std::string::npos; ++i) pos = s.find(from, pos + 1);
  EXPECT_NE(pos, std::string::npos) << "occurrence " << n;
  if (pos != std::string::npos) std::copy(to.begin(), to.end(), bytes.begin() + pos);
  return bytes;
}

// The bytes of a string literal, NULs included.
template <size_t N>
std::vector<char> Pickle(const char (&s)[N]) {
  return std::vector<char>(s, s + N - 1);
}

// BININT ('J') of `v`, how the pickler writes 65536 <= v < 2^31.
std::string BinInt(int32_t v) {
  std::string out = "J";
  for (int i = 0; i < 4; ++i) out += static_cast<char>((static_cast<uint32_t>(v) >> (8 * i)) & 0xFF);
  return out;
}

TEST(Dcp, CorruptOrMaliciousMetadataIsAClearError) {
  // Tensor 'x' of size [200000, 2] in two row chunks; 100000 marks the chunk boundary.
  DcpMetadata md;
  DcpEntry x;
  x.fqn = "x";
  x.size = {200000, 2};
  x.chunks = {{{0, 0}, {100000, 2}, {"__0_0.distcp", 0, 70000}}, {{100000, 0}, {100000, 2}, {"__1_0.distcp", 0, 8}}};
  md.entries = {x};
  const std::vector<char> good = SerializeDcpMetadata(md);
  auto parse = [](const std::vector<char>& bytes) { ParseDcpMetadata(bytes.data(), bytes.size(), "'d/.metadata'"); };
  parse(good);
  const std::string prefix = "'d/.metadata' is not a valid DCP metadata file: ";

  // Occurrences of 100000: chunk 0's size, chunk 1's offset, chunk 1's size, chunk 1's storage key.
  EXPECT_ERROR_CONTAINS(parse(Patch(good, BinInt(100000), BinInt(100001), 2)),
                        prefix +
                            "the chunk of 'x' at offsets [100000, 0] of size [100001, 2] lies outside the "
                            "tensor's size [200000, 2]");
  EXPECT_ERROR_CONTAINS(parse(Patch(good, BinInt(100000), BinInt(99999), 1)),
                        prefix +
                            "tensor 'x' has overlapping chunks at offsets [0, 0] (size [100000, 2]) and "
                            "[99999, 0] (size [100000, 2])");
  EXPECT_ERROR_CONTAINS(parse(Patch(good, BinInt(100000), BinInt(-100000), 1)), "lies outside");
  EXPECT_ERROR_CONTAINS(parse(Patch(good, BinInt(100000), BinInt(99999), 3)),
                        prefix + "the chunk of 'x' at [100000, 0] has no storage_data entry");
  EXPECT_ERROR_CONTAINS(parse(Patch(good, BinInt(200000), BinInt(-200000), 0)),
                        prefix + "tensor 'x' has size [-200000, 2] (negative)");
  EXPECT_ERROR_CONTAINS(parse(Patch(good, BinInt(70000), BinInt(-70000), 0)),
                        "is stored at offset 0 with length -70000 of '__0_0.distcp'");
  EXPECT_ERROR_CONTAINS(parse(Patch(good, "__1_0.distcp", "_/1_0.distcp", 0)),
                        "is stored in '_/1_0.distcp', which is not a file name inside the checkpoint directory");
  EXPECT_ERROR_CONTAINS(parse(Patch(good, "\nSize\n", "\nSizf\n", 0)), prefix + "byte ");
  EXPECT_ERROR_CONTAINS(parse(Patch(good, "\nSize\n", "\nSizf\n", 0)), "unsupported global 'torch.Sizf'");
  const std::vector<char> as_double = Patch(good, "float32", "float64", 0);  // another dtype: valid
  EXPECT_EQ(ParseDcpMetadata(as_double.data(), as_double.size(), "d").entries[0].properties.dtype, at::kDouble);

  // Foreign globals, in protocol 2 (GLOBAL) and 4 (STACK_GLOBAL), are refused before any use.
  EXPECT_ERROR_CONTAINS(parse(Pickle("\x80\x02"
                                     "cos\nsystem\n"
                                     "X\x02\x00\x00\x00"
                                     "ls\x85R.")),
                        prefix + "byte 2: unsupported global 'os.system'");
  EXPECT_ERROR_CONTAINS(parse(Pickle("\x80\x04\x95\x17\x00\x00\x00\x00\x00\x00\x00"
                                     "\x8c\x08"
                                     "builtins"
                                     "\x8c\x04"
                                     "eval"
                                     "\x93\x8c\x01"
                                     "1\x85R.")),
                        prefix + "byte 27: unsupported global 'builtins.eval'");
  EXPECT_ERROR_CONTAINS(parse(Pickle("\x80\x02"
                                     "ctorch.distributed.checkpoint.planner\nSavePlan\n)\x81.")),
                        "unsupported global 'torch.distributed.checkpoint.planner.SavePlan'");
  EXPECT_ERROR_CONTAINS(parse(Pickle("\x80\x02"
                                     "ctorch\nSize\n)\x81.")),  // allowed, but not to NEWOBJ
                        "NEWOBJ of 'torch.Size', which is not read that way");
  EXPECT_ERROR_CONTAINS(parse(Pickle("\x80\x02]q\x00h\x00"
                                     "a.")),
                        "puts a value into itself");  // a cycle
  EXPECT_ERROR_CONTAINS(parse(Pickle("\x80\x02]q\x00]h\x00"
                                     "aa.")),
                        "modifies a value after putting it into another");
  const std::string deep = "\x80\x02" + std::string(100, ']') + std::string(99, 'a') + ".";
  EXPECT_ERROR_CONTAINS(parse(std::vector<char>(deep.begin(), deep.end())), "more than 64");
  EXPECT_ERROR_CONTAINS(parse(Pickle("\x80\x02K\x01.")), prefix + "the pickled value is an int, not a Metadata");
  EXPECT_ERROR_CONTAINS(parse(Pickle("\x80\x02K\x01.K")), prefix + "byte 4: 1 bytes follow the pickle's STOP");
  EXPECT_ERROR_CONTAINS(parse(Pickle("\x80\x02"
                                     "C\x01x.")),
                        "unsupported pickle opcode 0x43 ('C')");

  // Every truncation fails; every single-bit flip either still parses or fails cleanly.
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_ERROR_CONTAINS(parse(std::vector<char>(good.begin(), good.begin() + n)), prefix);
  }
  int rejected = 0;
  for (size_t i = 0; i < good.size(); ++i) {
    std::vector<char> flipped = good;
    flipped[i] = static_cast<char>(flipped[i] ^ (1 << (i % 8)));
    try {
      parse(flipped);
    } catch (const c10::Error& e) {
      EXPECT_TRUE(absl::StrContains(e.what_without_backtrace(), prefix)) << e.what_without_backtrace();
      ++rejected;
    }
  }
  EXPECT_GT(rejected, static_cast<int>(good.size()) / 2);
}

TEST(Dcp, StorageErrorsNameTheFileAndTheValue) {
  const at::Tensor t = at::arange(12, at::kFloat).reshape({4, 3});
  const std::string dir = SmallCheckpoint(t);
  const DcpMetadata md = ReadMetadata(dir);
  at::Tensor out = at::empty({4, 3});
  EXPECT_ERROR_CONTAINS(ReadInto(dir, md, "nope", {0, 0}, out),
                        "ReadInto: the checkpoint '" + dir + "' has no entry 'nope' (it has 1: 't')");
  at::Tensor dbl = at::empty({4, 3}, at::kDouble);
  EXPECT_ERROR_CONTAINS(ReadInto(dir, md, "t", {0, 0}, dbl),
                        "'t' in '" + dir + "' is stored as Float, the destination is Double");
  at::Tensor flat = at::empty({12});
  EXPECT_ERROR_CONTAINS(ReadInto(dir, md, "t", {0}, flat), "does not have the 2 dimensions of 't' (size [4, 3])");
  at::Tensor big = at::empty({2, 3});
  EXPECT_ERROR_CONTAINS(ReadInto(dir, md, "t", {3, 0}, big),
                        "ReadInto: the box at offsets [3, 0] of size [2, 3] lies outside 't' of size [4, 3]");
  EXPECT_ERROR_CONTAINS(ReadBytes(dir, md, "t"), "ReadBytes: 't' in '" + dir + "' is a tensor, not a bytes entry");

  // Metadata whose chunks do not cover the box.
  DcpMetadata partial = md;
  partial.entries[0].chunks.pop_back();
  EXPECT_ERROR_CONTAINS(ReadInto(dir, partial, "t", {0, 0}, out),
                        "ReadInto: the chunks of 't' in '" + dir +
                            "' cover 6 of the 12 elements of the box at offsets "
                            "[0, 0] of size [4, 3]");

  // A data file cut short, then one with a flipped byte inside the stored tensor.
  const std::string file = dir + "/__1_0.distcp";
  std::vector<char> data = ReadFile(file, "test");
  const DcpStorageInfo& s = md.Find("t")->chunks[1].storage;
  ASSERT_EQ(static_cast<size_t>(s.offset + s.length), data.size());
  WriteBytes(file, std::vector<char>(data.begin(), data.end() - 10));
  at::Tensor rows = at::empty({2, 3});
  EXPECT_ERROR_CONTAINS(ReadInto(dir, md, "t", {2, 0}, rows),
                        absl::StrCat("ReadInto: the chunk of 't' at offsets [2, 0] is stored at bytes [0, ", s.length,
                                     ") of '", file, "', which has only ", s.length - 10, " bytes (truncated?)"));
  ReadInto(dir, md, "t", {0, 0}, rows);                      // rank 0's file is intact
  const at::Tensor stored = t.narrow(0, 2, 2).contiguous();  // find its bytes in the archive
  const std::string text(data.begin(), data.end());
  const size_t at = text.find(std::string(static_cast<const char*>(stored.data_ptr()), stored.nbytes()));
  ASSERT_NE(at, std::string::npos);
  std::vector<char> flipped = data;
  flipped[at + 5] ^= 0x10;
  WriteBytes(file, flipped);
  EXPECT_ERROR_CONTAINS(ReadInto(dir, md, "t", {2, 0}, rows),
                        absl::StrCat("'", file, "' bytes [0, ", s.length,
                                     ") (the chunk of 't' at offsets [2, 0]) is not a valid checkpoint: record '"));
  EXPECT_ERROR_CONTAINS(ReadInto(dir, md, "t", {2, 0}, rows), "has CRC-32 ");

  // An item holding a different tensor than the metadata says: rank 0's file in rank 1's place.
  WriteBytes(file, ReadFile(dir + "/__0_0.distcp", "test"));
  DcpMetadata wrong = md;
  wrong.entries[0].chunks[1].storage = md.Find("t")->chunks[0].storage;
  wrong.entries[0].chunks[1].storage.relative_path = "__1_0.distcp";
  ReadInto(dir, wrong, "t", {2, 0}, rows);  // same shape and dtype: indistinguishable, read
  wrong.entries[0].properties.dtype = at::kInt;
  at::Tensor ints = at::empty({2, 3}, at::kInt);
  EXPECT_ERROR_CONTAINS(ReadInto(dir, wrong, "t", {2, 0}, ints),
                        "' holds at bytes [0, " + std::to_string(md.Find("t")->chunks[0].storage.length) +
                            ") a Float tensor of size [2, 3], not the chunk of 't' at offsets [2, 0] (Int of size "
                            "[2, 3])");
}

TEST(Dcp, WritersRejectInconsistentChunks) {
  const at::Tensor t = at::randn({4, 3});
  const std::string dir = fsdp::testing::NewTestPath("bad_write");
  EXPECT_ERROR_CONTAINS(WriteRankData(dir, 0, {{"t", {4, 3}, at::kDouble, {0, 0}, t}}),
                        "WriteRankData: the chunk of 't' at offsets [0, 0] is declared Double but its tensor is Float");
  EXPECT_ERROR_CONTAINS(WriteRankData(dir, 0, {{"t", {4, 3}, at::kFloat, {1, 0}, t}}),
                        "a tensor of size [4, 3] at offsets [1, 0] does not fit in its global size [4, 3]");
  EXPECT_ERROR_CONTAINS(WriteRankData(dir, 0, {{"t", {4, 3}, at::kFloat, {0}, t}}), "the dimensions differ");
  EXPECT_ERROR_CONTAINS(
      WriteRankData(
          dir, 0,
          {{"t", {4, 3}, at::kFloat, {0, 0}, t.narrow(0, 0, 2)}, {"t", {4, 3}, at::kFloat, {1, 0}, t.narrow(0, 1, 2)}}),
      "WriteRankData: rank 0: tensor 't' has overlapping chunks at offsets [0, 0] (size [2, 3]) and [1, 0] (size "
      "[2, 3])");
  struct stat st {};
  EXPECT_NE(::stat((dir + "/__0_0.distcp").c_str(), &st), 0) << "a failed write left its file";
  const DcpFragment top = WriteRankData(dir, 0, {{"t", {4, 3}, at::kFloat, {0, 0}, t.narrow(0, 0, 2)}});
  EXPECT_ERROR_CONTAINS(WriteMetadata(dir, {top}),
                        "WriteMetadata: the chunks of tensor 't' (size [4, 3]) cover 6 of its 12 elements");
  const DcpFragment other = WriteRankData(dir, 1, {{"t", {5, 3}, at::kFloat, {2, 0}, t.narrow(0, 2, 2)}});
  EXPECT_ERROR_CONTAINS(WriteMetadata(dir, {top, other}),
                        "WriteMetadata: tensor 't' is Float of size [5, 3] in fragment 1 but Float of size [4, 3]");
  EXPECT_NE(::stat((dir + "/.metadata").c_str(), &st), 0) << "an incomplete checkpoint has metadata";
  // Rewriting a rank's data removes the metadata of the checkpoint it overwrites.
  const DcpFragment bottom = WriteRankData(dir, 1, {{"t", {4, 3}, at::kFloat, {2, 0}, t.narrow(0, 2, 2)}});
  WriteMetadata(dir, {top, bottom});
  ASSERT_EQ(::stat((dir + "/.metadata").c_str(), &st), 0);
  WriteRankData(dir, 0, {{"t", {4, 3}, at::kFloat, {0, 0}, t.narrow(0, 0, 2)}});
  EXPECT_NE(::stat((dir + "/.metadata").c_str(), &st), 0);
}

// ------------------------------------------------------------------ interop with PyTorch
using fsdp::testing::PeerPython;
using fsdp::testing::RunCommand;

constexpr char kScript[] = "checkpoint/testdata/dcp_interop.py";

TEST(DcpInterop, CheckpointSavedByPythonReadsHere) {
  std::string why_not;
  const std::string python = PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << why_not;
  const std::string dir = fsdp::testing::NewTestPath("py_saved"), ref = dir + "_ref.pt";
  std::string output;
  const int status = RunCommand(absl::StrCat(python, " ", kScript, " save ", dir, " ", ref), &output);
  ASSERT_EQ(status, 0) << output;
  ASSERT_TRUE(absl::StrContains(output, "SAVED")) << output;

  const DcpMetadata md = ReadMetadata(dir);
  EXPECT_EQ(md.version, "1.0.0");
  ASSERT_TRUE(md.storage_meta.has_value());
  EXPECT_EQ(md.storage_meta->checkpoint_id, dir);  // a pathlib.PosixPath in the file
  ASSERT_NE(md.Find("nested.b"), nullptr);
  EXPECT_EQ(md.Find("nested.b")->object_path, (std::vector<DcpPathElement>{std::string("nested"), std::string("b")}));
  EXPECT_EQ(md.Find("t")->properties.strides, (std::vector<int64_t>{1, 4}));
  const std::vector<char> ref_bytes = ReadFile(ref, "test");
  const auto expected = ReadCheckpoint(ref_bytes.data(), ref_bytes.size(), ref).toGenericDict();
  ASSERT_EQ(expected.size(), 6u);
  for (const auto& item : expected) {
    const std::string fqn = item.key().toStringRef();
    const at::Tensor want = item.value().toTensor();
    const DcpEntry* e = md.Find(fqn);
    ASSERT_NE(e, nullptr) << fqn;
    EXPECT_EQ(e->size, want.sizes().vec()) << fqn;
    at::Tensor got = at::empty(want.sizes(), want.options());
    ReadInto(dir, md, fqn, std::vector<int64_t>(want.dim(), 0), got);
    ExpectSame(got, want, fqn);
    if (want.dim() == 2 && want.size(0) > 2) {  // and a box of it
      at::Tensor part = at::empty({2, want.size(1) - 1}, want.options());
      ReadInto(dir, md, fqn, {1, 1}, part);
      ExpectSame(part, want.narrow(0, 1, 2).narrow(1, 1, want.size(1) - 1), fqn + " box");
    }
  }
  const std::vector<char> step = ReadBytes(dir, md, "step");
  EXPECT_EQ(ReadCheckpoint(step.data(), step.size(), "step").toInt(), 7);
}

TEST(DcpInterop, CheckpointSavedHereLoadsInPython) {
  std::string why_not;
  const std::string python = PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << why_not;
  const at::Tensor w = at::randn({8, 6});
  const at::Tensor b = at::randn({10}).to(at::kBFloat16);
  const at::Tensor i = at::arange(-6, 6, at::kLong).reshape({3, 4});
  const at::Tensor s = at::scalar_tensor(-1.25, at::kDouble);
  // Two ranks, several chunks of each tensor per rank: w in 4 row blocks (2 per rank) plus a
  // column split of the last block, b in 4 pieces, i by columns, the 0-d s on rank 1.
  std::vector<DcpTensorItem> rank0 = {
      {"w", {8, 6}, at::kFloat, {0, 0}, w.narrow(0, 0, 2)},
      {"w", {8, 6}, at::kFloat, {2, 0}, w.narrow(0, 2, 3)},
      {"layer.b", {10}, at::kBFloat16, {0}, b.narrow(0, 0, 3)},
      {"layer.b", {10}, at::kBFloat16, {3}, b.narrow(0, 3, 1)},
      {"i", {3, 4}, at::kLong, {0, 0}, i.narrow(1, 0, 1)},
  };
  std::vector<DcpTensorItem> rank1 = {
      {"w", {8, 6}, at::kFloat, {5, 0}, w.narrow(0, 5, 3).narrow(1, 0, 4)},
      {"w", {8, 6}, at::kFloat, {5, 4}, w.narrow(0, 5, 3).narrow(1, 4, 2)},
      {"layer.b", {10}, at::kBFloat16, {4}, b.narrow(0, 4, 5)},
      {"layer.b", {10}, at::kBFloat16, {9}, b.narrow(0, 9, 1)},
      {"i", {3, 4}, at::kLong, {0, 1}, i.narrow(1, 1, 3)},
      {"s", {}, at::kDouble, {}, s},
  };
  const std::string dir = fsdp::testing::NewTestPath("cpp_saved"), ref = dir + "_ref.pt";
  std::vector<DcpFragment> fragments = {
      WriteRankData(dir, 0, rank0),
      WriteRankData(dir, 1, rank1, {{"step", WriteCheckpoint(c10::IValue(int64_t{3}))}}),
  };
  WriteMetadata(dir, fragments);
  c10::impl::GenericDict expected(c10::StringType::get(), c10::AnyType::get());
  expected.insert("w", w);
  expected.insert("layer.b", b);
  expected.insert("i", i);
  expected.insert("s", s);
  expected.insert("step", int64_t{3});
  WriteFileAtomically(ref, WriteCheckpoint(c10::IValue(expected)), "test");
  std::string output;
  const int status = RunCommand(absl::StrCat(python, " ", kScript, " load ", dir, " ", ref), &output);
  EXPECT_EQ(status, 0) << output;
  EXPECT_TRUE(absl::StrContains(output, "OK")) << output;
}

}  // namespace
}  // namespace fsdp::checkpoint
