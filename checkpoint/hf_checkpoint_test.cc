// //checkpoint Hugging Face directories (hf_checkpoint.h): an export split by size is, file
// by file, the bytes safetensors' save_file writes for its tensors; any box of any tensor
// reads as the slice of the original, converted to any dtype, from whole files and from
// per-rank files split by rows or columns; consolidating per-rank files writes the export's
// bytes; reads use one bounded block; and broken directories (index, sharding info, missing or
// overlapping chunks) are clear errors naming the file and the key.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/file_io.h"
#include "checkpoint/hf_checkpoint.h"
#include "checkpoint/safetensors.h"
#include "testing/allocation_counter.h"
#include "testing/expect_error.h"
#include "testing/test_dir.h"

namespace fsdp::checkpoint::hf_checkpoint_test {
namespace {

using fsdp::testing::NewTestPath;

// A small model's state dict, in order: 2-D weights, a 1-D norm, a 3-D tensor, ints.
std::vector<std::pair<std::string, at::Tensor>> StateDict() {
  at::manual_seed(7);
  return {
      {"embed.weight", at::randn({10, 6})},
      {"layers.0.attn.weight", at::randn({6, 6})},
      {"layers.0.norm.weight", at::randn({6})},
      {"layers.0.conv.weight", at::randn({4, 3, 5})},
      {"layers.1.mlp.weight", at::randn({12, 6}).to(at::kBFloat16)},
      {"positions", at::arange(9, at::kLong)},
  };
}

std::vector<HfExportTensor> Specs(const std::vector<std::pair<std::string, at::Tensor>>& sd,
                                  std::optional<at::ScalarType> dtype = std::nullopt) {
  std::vector<HfExportTensor> out;
  for (const auto& [k, t] : sd) {
    const at::ScalarType type = dtype && at::isFloatingType(t.scalar_type()) ? *dtype : t.scalar_type();
    out.push_back({k, type, t.sizes().vec()});
  }
  return out;
}

// Writes `sd` as the export of `layout` under dir, each tensor in row pieces of `rows`.
void Export(const HfExportLayout& layout, const std::string& dir,
            const std::vector<std::pair<std::string, at::Tensor>>& sd, int64_t rows) {
  std::filesystem::create_directories(dir);
  for (size_t f = 0; f < layout.file_count(); ++f) layout.CreateFile(dir, f, "test");
  HfExportWriter writer(layout, dir, "test");
  for (const auto& [k, t] : sd) {
    for (int64_t r = 0; r < t.size(0); r += rows) {
      std::vector<int64_t> offsets(t.dim(), 0);
      offsets[0] = r;
      writer.Write(k, offsets, t.narrow(0, r, std::min(rows, t.size(0) - r)));
    }
  }
  writer.Sync();
  const std::string index = layout.IndexJson();
  WriteFileAtomically(JoinPath(dir, kHfIndexFile), std::vector<char>(index.begin(), index.end()), "test");
}

std::vector<char> Bytes(const std::string& path) { return ReadFile(path, "test"); }

TEST(HfCheckpoint, ExportFilesAreTheBytesSaveFileWritesAndSplitBySize) {
  const auto sd = StateDict();
  // 10x6 f32 = 240 B, 6x6 = 144, 6 = 24, 4x3x5 = 240, 12x6 bf16 = 144, 9 i64 = 72: at 400 B
  // per file huggingface_hub's rule gives [240, 144], [24, 240], [144, 72].
  const HfExportLayout layout(Specs(sd), 400);
  ASSERT_EQ(layout.file_count(), 3u);
  EXPECT_EQ(layout.file_name(0), "model-00001-of-00003.safetensors");
  EXPECT_EQ(layout.total_size(), 240 + 144 + 24 + 240 + 144 + 72);
  const std::string dir = NewTestPath("hf_export");
  Export(layout, dir, sd, 3);
  const std::vector<std::vector<std::string>> groups = {{"embed.weight", "layers.0.attn.weight"},
                                                        {"layers.0.norm.weight", "layers.0.conv.weight"},
                                                        {"layers.1.mlp.weight", "positions"}};
  for (size_t f = 0; f < groups.size(); ++f) {
    TensorDict part;
    for (const auto& [k, t] : sd) {
      if (std::find(groups[f].begin(), groups[f].end(), k) != groups[f].end()) part.insert(k, t);
    }
    EXPECT_EQ(Bytes(JoinPath(dir, layout.file_name(f))),
              SerializeSafetensors(part, SafetensorsMetadata{{"format", "pt"}}))
        << layout.file_name(f);
  }
  const std::vector<char> index_bytes = Bytes(JoinPath(dir, kHfIndexFile));
  const std::string index(index_bytes.begin(), index_bytes.end());
  EXPECT_NE(index.find("\"total_size\": 864"), std::string::npos) << index;
  EXPECT_NE(index.find("\"layers.0.norm.weight\": \"model-00002-of-00003.safetensors\""), std::string::npos) << index;

  // No limit: one file.
  EXPECT_EQ(HfExportLayout(Specs(sd), 0).file_count(), 1u);
  // A tensor over the limit gets a file of its own (before the file being filled):
  // [240], [144], [240], [144], [24, 72].
  const HfExportLayout small(Specs(sd), 100);
  ASSERT_EQ(small.file_count(), 5u);
  EXPECT_EQ(small.file(4).entries.size(), 2u);
}

TEST(HfCheckpoint, AnyBoxReadsAsTheSliceInAnyDtype) {
  const auto sd = StateDict();
  const std::string dir = NewTestPath("hf_boxes");
  Export(HfExportLayout(Specs(sd), 400), dir, sd, 4);
  const HfCheckpointReader reader(dir);
  ASSERT_EQ(reader.tensors().size(), sd.size());
  for (const auto& [k, t] : sd) {
    const HfTensor* h = reader.Find(k);
    ASSERT_NE(h, nullptr) << k;
    EXPECT_EQ(h->size, t.sizes().vec());
    EXPECT_EQ(h->dtype, t.scalar_type());
    at::Tensor whole = at::empty_like(t);
    reader.ReadInto(k, std::vector<int64_t>(t.dim(), 0), whole);
    EXPECT_TRUE(at::equal(whole, t)) << k;
  }
  const at::Tensor w = sd[1].second;    // 6x6
  at::Tensor cols = at::empty({6, 2});  // a column shard (tensor parallel): one run per row
  reader.ReadInto("layers.0.attn.weight", {0, 3}, cols);
  EXPECT_TRUE(at::equal(cols, w.narrow(1, 3, 2)));
  at::Tensor inner = at::empty({2, 3});
  reader.ReadInto("layers.0.attn.weight", {1, 2}, inner);
  EXPECT_TRUE(at::equal(inner, w.slice(0, 1, 3).slice(1, 2, 5)));
  const at::Tensor conv = sd[3].second;  // 4x3x5: a box in the middle of every dim
  at::Tensor box = at::empty({2, 2, 3});
  reader.ReadInto("layers.0.conv.weight", {1, 1, 2}, box);
  EXPECT_TRUE(at::equal(box, conv.slice(0, 1, 3).slice(1, 1, 3).slice(2, 2, 5)));
  // bf16 in the file, f32 read, and back: tensor.to(dtype) of the slice.
  const at::Tensor mlp = sd[4].second;
  at::Tensor up = at::empty({5, 6}, at::kFloat);
  reader.ReadInto("layers.1.mlp.weight", {4, 0}, up);
  EXPECT_TRUE(at::equal(up, mlp.narrow(0, 4, 5).to(at::kFloat)));
  at::Tensor down = at::empty({3, 6}, at::kBFloat16);
  reader.ReadInto("layers.0.attn.weight", {2, 0}, down);
  EXPECT_TRUE(at::equal(down, w.narrow(0, 2, 3).to(at::kBFloat16)));
  // A strided destination.
  at::Tensor t = at::zeros({6, 10}).t();
  reader.ReadInto("embed.weight", {0, 0}, t);
  EXPECT_TRUE(at::equal(t, sd[0].second));
}

// Per-rank files as PyTorch's HuggingFaceStorageWriter(save_distributed=True) writes them:
// rows split over two ranks, columns over three, the rest on rank 0.
std::string WriteShardedDir(const std::vector<std::pair<std::string, at::Tensor>>& sd) {
  const std::string dir = NewTestPath("hf_sharded");
  std::filesystem::create_directories(dir);
  for (int rank = 0; rank < 3; ++rank) {
    TensorDict part;
    std::vector<std::pair<std::string, std::vector<int64_t>>> offsets;
    for (const auto& [k, t] : sd) {
      if (k == "embed.weight" && rank < 2) {  // rows 0-4, 5-9
        part.insert(k, t.narrow(0, 5 * rank, 5));
        offsets.push_back({k, {5 * rank, 0}});
      } else if (k == "layers.0.attn.weight") {  // columns 0-1, 2-3, 4-5
        part.insert(k, t.narrow(1, 2 * rank, 2));
        offsets.push_back({k, {0, 2 * rank}});
      } else if (rank == 0 && k != "embed.weight") {
        part.insert(k, t);
        offsets.push_back({k, std::vector<int64_t>(t.dim(), 0)});
      }
    }
    SaveSafetensors(JoinPath(dir, HfFileName(1, 1, rank + 1)), part, HfShardingMetadata(offsets));
  }
  return dir;
}

TEST(HfCheckpoint, PerRankFilesMergeIntoTensorsAndConsolidateToTheExportBytes) {
  const auto sd = StateDict();
  const std::string sharded = WriteShardedDir(sd);
  const HfCheckpointReader reader(sharded);
  const HfTensor* attn = reader.Find("layers.0.attn.weight");
  ASSERT_NE(attn, nullptr);
  EXPECT_EQ(attn->chunks.size(), 3u);
  EXPECT_EQ(attn->size, (std::vector<int64_t>{6, 6}));
  for (const auto& [k, t] : sd) {
    at::Tensor whole = at::empty_like(t);
    reader.ReadInto(k, std::vector<int64_t>(t.dim(), 0), whole);
    EXPECT_TRUE(at::equal(whole, t)) << k;
  }
  at::Tensor rows = at::empty({4, 6});  // across both row chunks
  reader.ReadInto("embed.weight", {3, 0}, rows);
  EXPECT_TRUE(at::equal(rows, sd[0].second.narrow(0, 3, 4)));
  at::Tensor cross = at::empty({6, 3});  // across two column chunks
  reader.ReadInto("layers.0.attn.weight", {0, 1}, cross);
  EXPECT_TRUE(at::equal(cross, sd[1].second.narrow(1, 1, 3)));

  // Consolidation: every chunk copied into place equals the export written from the tensors,
  // and in bf16 equals the export of tensor.to(bfloat16).
  for (const std::optional<at::ScalarType> dtype : {std::optional<at::ScalarType>(), std::optional(at::kBFloat16)}) {
    const HfExportLayout layout(Specs(sd, dtype), 400);
    const std::string out = NewTestPath("hf_consolidated"), expected = NewTestPath("hf_expected");
    std::filesystem::create_directories(out);
    for (size_t f = 0; f < layout.file_count(); ++f) layout.CreateFile(out, f, "test");
    HfExportWriter writer(layout, out, "test");
    for (const HfTensor& t : reader.tensors()) {
      for (const HfChunk& c : t.chunks) writer.Copy(reader, t, c);
    }
    writer.Sync();
    auto converted = sd;
    for (auto& [k, t] : converted) {
      if (dtype && at::isFloatingType(t.scalar_type())) t = t.to(*dtype);
    }
    Export(layout, expected, converted, 100);
    for (size_t f = 0; f < layout.file_count(); ++f) {
      EXPECT_EQ(Bytes(JoinPath(out, layout.file_name(f))), Bytes(JoinPath(expected, layout.file_name(f))))
          << layout.file_name(f);
    }
  }
}

TEST(HfCheckpoint, ReadsUseOneBoundedBlock) {
  // A 32 MiB f32 tensor: a column read (one run per row) and a converting row read may hold
  // one block (HfCheckpointReader::kBlockBytes) beyond the destination, not the tensor.
  const int64_t rows = 2048, cols = 4096;
  const at::Tensor big = at::arange(rows * cols, at::kFloat).view({rows, cols});
  const std::string dir = NewTestPath("hf_big");
  std::filesystem::create_directories(dir);
  TensorDict d;
  d.insert("w", big);
  SaveSafetensors(JoinPath(dir, "model.safetensors"), d);
  const HfCheckpointReader reader(dir);
  at::Tensor cols_dest = at::empty({rows, 64});
  at::Tensor bf16_dest = at::empty({rows / 2, cols}, at::kBFloat16);
  {
    fsdp::testing::ScopedAllocationCounter counter;
    reader.ReadInto("w", {0, 1000}, cols_dest);
    reader.ReadInto("w", {rows / 2, 0}, bf16_dest);
    // One block (or a run of 64 floats); nothing of the tensor's size (32 MiB).
    EXPECT_LE(counter.peak(), HfCheckpointReader::kBlockBytes);
  }
  EXPECT_TRUE(at::equal(cols_dest, big.narrow(1, 1000, 64)));
  EXPECT_TRUE(at::equal(bf16_dest, big.narrow(0, rows / 2, rows / 2).to(at::kBFloat16)));
}

void WriteText(const std::string& path, const std::string& text) {
  WriteFileAtomically(path, std::vector<char>(text.begin(), text.end()), "test");
}

TEST(HfCheckpoint, BrokenDirectoriesAreClearErrors) {
  const at::Tensor w = at::randn({4, 2});
  const auto save = [](const std::string& path, const std::string& key, const at::Tensor& t,
                       const std::optional<SafetensorsMetadata>& md) {
    TensorDict d;
    d.insert(key, t);
    SaveSafetensors(path, d, md);
  };
  const std::string empty = NewTestPath("hf_empty");
  std::filesystem::create_directories(empty);
  EXPECT_ERROR_CONTAINS(HfCheckpointReader{empty}, "holds neither model.safetensors.index.json nor *.safetensors");
  EXPECT_ERROR_CONTAINS(HfCheckpointReader{JoinPath(empty, "nope")}, "is not a directory");

  const std::string indexed = NewTestPath("hf_index");
  std::filesystem::create_directories(indexed);
  save(JoinPath(indexed, "a.safetensors"), "w", w, std::nullopt);
  WriteText(JoinPath(indexed, kHfIndexFile), R"({"weight_map": {"w": "a.safetensors", "v": "a.safetensors"}})");
  EXPECT_ERROR_CONTAINS(HfCheckpointReader{indexed}, "puts 'v' in 'a.safetensors', which has no such tensor");
  WriteText(JoinPath(indexed, kHfIndexFile), R"({"weight_map": {"w": "../a.safetensors"}})");
  EXPECT_ERROR_CONTAINS(HfCheckpointReader{indexed}, "the file of 'w' is '../a.safetensors', not a file name");
  WriteText(JoinPath(indexed, kHfIndexFile), R"({"weight_map": {"w": "b.safetensors"}})");
  EXPECT_ERROR_CONTAINS(HfCheckpointReader{indexed}, "b.safetensors");
  WriteText(JoinPath(indexed, kHfIndexFile), R"({"metadata": {}})");
  EXPECT_ERROR_CONTAINS(HfCheckpointReader{indexed}, "has no \"weight_map\" object");
  WriteText(JoinPath(indexed, kHfIndexFile), R"({"weight_map": )");
  EXPECT_ERROR_CONTAINS(HfCheckpointReader{indexed}, kHfIndexFile);

  const auto sharded_dir = [&](const std::string& name, const std::vector<std::vector<int64_t>>& offsets,
                               const std::vector<at::Tensor>& parts) {
    const std::string dir = NewTestPath(name);
    std::filesystem::create_directories(dir);
    for (size_t i = 0; i < parts.size(); ++i) {
      save(JoinPath(dir, HfFileName(1, 1, static_cast<int64_t>(i) + 1)), "w", parts[i],
           HfShardingMetadata({{"w", offsets[i]}}));
    }
    return dir;
  };
  const std::string overlap = sharded_dir("hf_overlap", {{0, 0}, {1, 0}}, {w.narrow(0, 0, 2), w.narrow(0, 1, 3)});
  EXPECT_ERROR_CONTAINS(HfCheckpointReader{overlap}, "(offsets [1, 0]) and '");
  const std::string gap = sharded_dir("hf_gap", {{0, 0}, {3, 0}}, {w.narrow(0, 0, 2), w.narrow(0, 3, 1)});
  EXPECT_ERROR_CONTAINS(HfCheckpointReader{gap},
                        "hold 6 of the 8 elements of its size [4, 2] (a rank's file is missing?)");
  const std::string rank = sharded_dir("hf_rank", {{0}}, {w});
  EXPECT_ERROR_CONTAINS(HfCheckpointReader{rank}, "the offsets [0]");
  const std::string bad_info = NewTestPath("hf_bad_info");
  std::filesystem::create_directories(bad_info);
  save(JoinPath(bad_info, "x.safetensors"), "w", w,
       SafetensorsMetadata{{kHfShardingInfoKey, R"({"v": {"saved_offsets": [0, 0]}})"}});
  EXPECT_ERROR_CONTAINS(HfCheckpointReader{bad_info}, "has no entry for its tensor 'w'");
  save(JoinPath(bad_info, "x.safetensors"), "w", w,
       SafetensorsMetadata{{kHfShardingInfoKey, R"({"w": {"saved_offsets": [0, -1]}})"}});
  EXPECT_ERROR_CONTAINS(HfCheckpointReader{bad_info}, "'w' has saved offset -1");
  save(JoinPath(bad_info, "x.safetensors"), "w", w, SafetensorsMetadata{{kHfShardingInfoKey, "[]"}});
  EXPECT_ERROR_CONTAINS(HfCheckpointReader{bad_info}, "is an array, not an object");
  const std::string twice = NewTestPath("hf_twice");
  std::filesystem::create_directories(twice);
  save(JoinPath(twice, "a.safetensors"), "w", w, std::nullopt);
  save(JoinPath(twice, "b.safetensors"), "w", w, std::nullopt);
  EXPECT_ERROR_CONTAINS(HfCheckpointReader{twice}, "'w' is in both");
}

TEST(HfCheckpoint, ReadMisuseIsAClearError) {
  const std::string dir = NewTestPath("hf_misuse");
  std::filesystem::create_directories(dir);
  TensorDict d;
  d.insert("w", at::randn({4, 2}));
  SaveSafetensors(JoinPath(dir, "model.safetensors"), d);
  const HfCheckpointReader reader(dir);
  at::Tensor dest = at::empty({2, 2});
  EXPECT_ERROR_CONTAINS(reader.ReadInto("v", {0, 0}, dest), "has no tensor 'v'");
  EXPECT_ERROR_CONTAINS(reader.ReadInto("w", {3, 0}, dest), "lies outside 'w' of size [4, 2]");
  EXPECT_ERROR_CONTAINS(reader.ReadInto("w", {0}, dest), "does not have the 2 dimensions of 'w'");
}

TEST(HfCheckpoint, SizesParseAsHuggingFaceHubParsesThem) {
  EXPECT_EQ(ParseHfSize("5GB", "size"), 5'000'000'000);
  EXPECT_EQ(ParseHfSize("1.5 MB", "size"), 1'500'000);
  EXPECT_EQ(ParseHfSize("10kb", "size"), 10'000);
  EXPECT_EQ(ParseHfSize("123", "size"), 123);
  EXPECT_ERROR_CONTAINS(ParseHfSize("5GiB", "--max-shard-size"), "--max-shard-size: '5GiB' is not a size");
  EXPECT_ERROR_CONTAINS(ParseHfSize("-1", "size"), "is not a positive size");
  EXPECT_ERROR_CONTAINS(ParseHfSize("GB", "size"), "is not a size");
}

}  // namespace
}  // namespace fsdp::checkpoint::hf_checkpoint_test
