// The trainer's data: PackedTokenStream's windows against torchtitan 0.3.0's own packing
// (train/testdata/golden_train_data.txt, written by testing/golden/gen_train_data.py with
// HuggingFaceTextDataset over the shipped corpus and synthetic documents), one test per
// stream; then what torchtitan does not check: the distribution over dp ranks and
// micro-batches, many epochs, resuming from a state, and corrupt or truncated files.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "testing/expect_error.h"
#include "testing/golden_file.h"
#include "testing/test_dir.h"
#include "train/dataloader.h"
#include "train/token_dataset.h"

namespace fsdp::train {
namespace {

using ::fsdp::testing::GoldenFields;
using ::fsdp::testing::GoldenInt;
using ::fsdp::testing::GoldenInts;

constexpr char kGolden[] = "train/testdata/golden_train_data.txt";
constexpr char kValidation[] = "train/testdata/corpus/validation";
constexpr char kTrain[] = "train/testdata/corpus/train";

std::vector<int64_t> Ints(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return {c.const_data_ptr<int64_t>(), c.const_data_ptr<int64_t>() + c.numel()};
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// ---- the golden corpus ----------------------------------------------------------------

struct GoldenWindow {
  int64_t k = 0, epoch = 0;
  std::vector<int64_t> input, labels, positions;
};

struct GoldenStream {
  std::string name;                         // <dataset>_L<seq_len>
  std::string prefix;                       // the dataset's files, or "synthetic"
  std::vector<std::vector<uint32_t>> docs;  // synthetic only
  std::map<int64_t, std::vector<int64_t>> orders;
  int64_t tokens_per_epoch = 0, seq_len = 0;
  std::vector<GoldenWindow> windows;
};

void PrintTo(const GoldenStream& s, std::ostream* os) { *os << s.name; }

std::vector<GoldenStream> ReadStreams() {
  std::vector<GoldenStream> out;
  GoldenStream dataset;  // the current dataset's fields
  for (const GoldenFields& f : ::fsdp::testing::ReadGoldenFile(kGolden)) {
    if (f[0] == "dataset" && f.size() == 4) {
      dataset = GoldenStream{};
      dataset.name = f[1];
      dataset.prefix = f[2];
      dataset.tokens_per_epoch = GoldenInt(f[3]);
    } else if (f[0] == "doc" && f.size() == 2) {
      std::vector<uint32_t> doc;
      for (int64_t id : GoldenInts(f[1])) doc.push_back(static_cast<uint32_t>(id));
      dataset.docs.push_back(std::move(doc));
    } else if (f[0] == "order" && f.size() == 3) {
      dataset.orders[GoldenInt(f[1])] = GoldenInts(f[2]);
    } else if (f[0] == "stream" && f.size() == 2) {
      out.push_back(dataset);
      out.back().seq_len = GoldenInt(f[1]);
      out.back().name = dataset.name + "_L" + f[1];
    } else if (f[0] == "window" && f.size() == 6 && !out.empty()) {
      out.back().windows.push_back(
          {GoldenInt(f[1]), GoldenInt(f[2]), GoldenInts(f[3]), GoldenInts(f[4]), GoldenInts(f[5])});
    } else {
      throw std::runtime_error(std::string(kGolden) + ": unexpected record '" + f[0] + "'");
    }
  }
  return out;
}

// The synthetic corpus' files (vocab 64, bos 0, eos 1, as the generator's) under TEST_TMPDIR.
std::shared_ptr<const TokenDataset> OpenStreamDataset(const GoldenStream& s) {
  if (s.prefix != "synthetic") return TokenDataset::Open(s.prefix);
  const std::string prefix = ::fsdp::testing::NewTestPath("synthetic");
  WriteTokenDataset(prefix, s.docs, 64, 0, 1);
  return TokenDataset::Open(prefix);
}

class TorchtitanPacking : public ::testing::TestWithParam<GoldenStream> {};

TEST_P(TorchtitanPacking, WindowsAreTorchtitans) {
  const GoldenStream& s = GetParam();
  ASSERT_FALSE(s.windows.empty());
  PackedTokenStream stream(OpenStreamDataset(s), s.seq_len);
  EXPECT_EQ(stream.tokens_per_epoch(), s.tokens_per_epoch);
  for (const auto& [epoch, order] : s.orders) EXPECT_EQ(stream.EpochOrder(epoch), order) << "epoch " << epoch;
  for (const GoldenWindow& w : s.windows) {
    SCOPED_TRACE("window " + std::to_string(w.k));
    const TokenBatch got = stream.Window(w.k);
    EXPECT_EQ(Ints(got.input), w.input);
    EXPECT_EQ(Ints(got.labels), w.labels);
    EXPECT_EQ(Ints(got.positions), w.positions);
    EXPECT_EQ(stream.EpochOfWindow(w.k), w.epoch);
  }
}

INSTANTIATE_TEST_SUITE_P(Corpus, TorchtitanPacking, ::testing::ValuesIn(ReadStreams()),
                         [](const ::testing::TestParamInfo<GoldenStream>& info) { return info.param.name; });

TEST(TokenDataset, ShippedCorpusHeader) {
  for (const char* prefix : {kTrain, kValidation}) {
    const auto ds = TokenDataset::Open(prefix);
    EXPECT_EQ(ds->vocab_size(), 2048);
    EXPECT_EQ(ds->token_bytes(), 2u);
    EXPECT_EQ(ds->bos_id(), 0);
    EXPECT_EQ(ds->eos_id(), 1);
    ASSERT_GT(ds->num_documents(), 50);
    for (int64_t d = 0; d < ds->num_documents(); ++d) {
      const DocumentView doc = ds->Document(d);
      ASSERT_GE(doc.size, 2);
      EXPECT_EQ(doc[0], 0u);
      EXPECT_EQ(doc[doc.size - 1], 1u);
    }
    EXPECT_ERROR_CONTAINS(ds->Document(ds->num_documents()), "out of range");
    EXPECT_ERROR_CONTAINS(ds->Document(-1), "out of range");
  }
}

TEST(TokenDataset, FromBytesReadsWhatOpenReads) {
  const std::string index = ReadFile(std::string(kValidation) + ".index");
  const std::string tokens = ReadFile(std::string(kValidation) + ".tokens");
  const auto mapped = TokenDataset::Open(kValidation);
  const auto copied = TokenDataset::FromBytes(index, tokens, "mem/validation");
  ASSERT_EQ(copied->num_documents(), mapped->num_documents());
  EXPECT_EQ(copied->num_tokens(), mapped->num_tokens());
  std::vector<std::vector<uint32_t>> docs;
  for (int64_t d = 0; d < mapped->num_documents(); ++d) {
    const DocumentView a = mapped->Document(d), b = copied->Document(d);
    ASSERT_EQ(a.size, b.size);
    docs.emplace_back();
    for (int64_t i = 0; i < a.size; ++i) {
      ASSERT_EQ(a[i], b[i]);
      docs.back().push_back(a[i]);
    }
  }
  // The format is canonical: our writer's bytes of the same documents are the Python tool's.
  const TokenDatasetBytes again = SerializeTokenDataset(docs, 2048, 0, 1);
  EXPECT_TRUE(again.index == index && again.tokens == tokens);
}

TEST(TokenDataset, Uint32TokensRoundTrip) {
  const std::string prefix = ::fsdp::testing::NewTestPath("u32");
  const std::vector<std::vector<uint32_t>> docs = {{0, 69999, 1}, {}, {65536, 65535}};
  WriteTokenDataset(prefix, docs, 70000, 0, 1);
  const auto ds = TokenDataset::Open(prefix);
  EXPECT_EQ(ds->token_bytes(), 4u);
  ASSERT_EQ(ds->num_documents(), 3);
  for (int64_t d = 0; d < 3; ++d) {
    const DocumentView v = ds->Document(d);
    ASSERT_EQ(v.size, static_cast<int64_t>(docs[d].size()));
    for (int64_t i = 0; i < v.size; ++i) EXPECT_EQ(v[i], docs[d][i]);
  }
  EXPECT_ERROR_CONTAINS(WriteTokenDataset(prefix, {{70000}}, 70000, 0, 1), "token id 70000");
}

// ---- many epochs, against a plain re-implementation of torchtitan's buffer --------------

// torchtitan's loop: documents of each epoch's order into buffers, windows cut from the front.
std::vector<std::vector<int64_t>> ReferenceWindows(PackedTokenStream& stream, int64_t count, int which) {
  std::vector<int64_t> in, lab, pos;
  std::vector<std::vector<int64_t>> out;
  const int64_t L = stream.seq_len();
  for (int64_t epoch = 0; static_cast<int64_t>(out.size()) < count; ++epoch) {
    for (int64_t d : stream.EpochOrder(epoch)) {
      const DocumentView doc = stream.dataset().Document(d);
      for (int64_t i = 0; i + 1 < doc.size; ++i) {
        in.push_back(doc[i]);
        lab.push_back(doc[i + 1]);
        pos.push_back(i);
      }
      while (static_cast<int64_t>(in.size()) >= L && static_cast<int64_t>(out.size()) < count) {
        std::vector<int64_t>& src = which == 0 ? in : which == 1 ? lab : pos;
        std::vector<int64_t> w(src.begin(), src.begin() + L);
        if (which == 2 && w[0] > 0) {  // _normalize_positions
          const int64_t offset = w[0];
          for (auto& p : w) {
            if (p == 0) break;
            p -= offset;
          }
        }
        out.push_back(std::move(w));
        in.erase(in.begin(), in.begin() + L);
        lab.erase(lab.begin(), lab.begin() + L);
        pos.erase(pos.begin(), pos.begin() + L);
      }
    }
  }
  return out;
}

TEST(PackedTokenStream, ManyEpochsMatchTheBufferedLoop) {
  for (const int64_t seq_len : {1, 7, 100, 1000, 4853}) {
    SCOPED_TRACE("seq_len " + std::to_string(seq_len));
    PackedTokenStream stream(TokenDataset::Open(kValidation), seq_len, /*seed=*/7);
    EXPECT_EQ(stream.windows_per_epoch(), 4852 / seq_len);
    const int64_t count = std::min<int64_t>(5 * 4852 / seq_len + 2, 3000);
    const auto in = ReferenceWindows(stream, count, 0), lab = ReferenceWindows(stream, count, 1),
               pos = ReferenceWindows(stream, count, 2);
    for (int64_t k = 0; k < count; ++k) {
      const TokenBatch w = stream.Window(k);
      ASSERT_EQ(Ints(w.input), in[k]) << "window " << k;
      ASSERT_EQ(Ints(w.labels), lab[k]) << "window " << k;
      ASSERT_EQ(Ints(w.positions), pos[k]) << "window " << k;
    }
    // Random access: out of order, the same windows.
    for (int64_t k = count - 1; k >= 0; k -= 3) ASSERT_EQ(Ints(stream.Window(k).input), in[k]);
  }
}

TEST(PackedTokenStream, EpochOrdersArePermutations) {
  PackedTokenStream stream(TokenDataset::Open(kValidation), 16);
  std::vector<int64_t> identity(81);
  for (int64_t i = 0; i < 81; ++i) identity[i] = i;
  EXPECT_EQ(stream.EpochOrder(0), identity);
  for (int64_t e = 1; e < 4; ++e) {
    std::vector<int64_t> order = stream.EpochOrder(e);
    EXPECT_NE(order, identity);
    EXPECT_NE(order, stream.EpochOrder(e + 1));
    std::sort(order.begin(), order.end());
    EXPECT_EQ(order, identity);
  }
  PackedTokenStream other_seed(TokenDataset::Open(kValidation), 16, 43);
  EXPECT_EQ(other_seed.EpochOrder(1), stream.EpochOrder(2));  // seed + epoch
}

TEST(PackedTokenStream, BadArguments) {
  const auto ds = TokenDataset::Open(kValidation);
  EXPECT_ERROR_CONTAINS(PackedTokenStream(ds, 0), "seq_len = 0");
  EXPECT_ERROR_CONTAINS(PackedTokenStream(ds, 8, -1), "seed = -1");
  EXPECT_ERROR_CONTAINS(PackedTokenStream(nullptr, 8), "null");
  PackedTokenStream stream(ds, 8);
  EXPECT_ERROR_CONTAINS(stream.Window(-1), "window -1");
  EXPECT_ERROR_CONTAINS(stream.Window(int64_t{1} << 61), "overflow");
  const std::string prefix = ::fsdp::testing::NewTestPath("empty");
  WriteTokenDataset(prefix, {{0}, {}, {5}}, 8, 0, 1);
  EXPECT_ERROR_CONTAINS(PackedTokenStream(TokenDataset::Open(prefix), 8), "no document of 2 or more tokens");
  WriteTokenDataset(prefix, {}, 8, 0, 1);
  EXPECT_EQ(TokenDataset::Open(prefix)->num_documents(), 0);
  EXPECT_ERROR_CONTAINS(PackedTokenStream(TokenDataset::Open(prefix), 8), "no document");
}

// ---- distribution over dp ranks and micro-batches ----------------------------------------

struct Layout {
  int64_t local_batch, dp, accum;
};

// Every rank's micro-batches of `steps` steps, rows in (step, micro-batch, rank, row) order.
std::vector<std::vector<int64_t>> RowsOf(const Layout& l, int64_t seq_len, int64_t steps,
                                         const DataLoaderState* resume = nullptr) {
  std::vector<std::unique_ptr<DataLoader>> ranks;
  for (int64_t r = 0; r < l.dp; ++r) {
    ranks.push_back(std::make_unique<DataLoader>(TokenDataset::Open(kValidation),
                                                 DataLoaderConfig{seq_len, l.local_batch, l.dp, r, l.accum, 42}));
    if (resume != nullptr) ranks.back()->LoadState(*resume);
  }
  std::vector<std::vector<int64_t>> rows;
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t m = 0; m < l.accum; ++m) {
      for (auto& loader : ranks) {
        const TokenBatch b = loader->NextBatch();
        EXPECT_EQ(b.input.sizes(), (std::vector<int64_t>{l.local_batch, seq_len}));
        for (int64_t i = 0; i < l.local_batch; ++i) rows.push_back(Ints(b.input[i]));
      }
    }
  }
  for (auto& loader : ranks) EXPECT_EQ(loader->state(), ranks[0]->state());
  return rows;
}

TEST(DataLoader, StepsAreTheSameWindowsOnAnyDpDegree) {
  constexpr int64_t kSeqLen = 32, kSteps = 45;  // 8 * 45 windows of 32: past two epochs of 4852 tokens
  PackedTokenStream stream(TokenDataset::Open(kValidation), kSeqLen);
  std::vector<std::vector<int64_t>> expected;
  for (int64_t k = 0; k < 8 * kSteps; ++k) expected.push_back(Ints(stream.Window(k).input));
  for (const Layout& l : {Layout{8, 1, 1}, Layout{4, 1, 2}, Layout{4, 2, 1}, Layout{2, 2, 2}, Layout{2, 4, 1},
                          Layout{1, 4, 2}, Layout{1, 1, 8}}) {
    SCOPED_TRACE("local_batch " + std::to_string(l.local_batch) + " dp " + std::to_string(l.dp) + " accum " +
                 std::to_string(l.accum));
    EXPECT_EQ(RowsOf(l, kSeqLen, kSteps), expected);
  }
}

TEST(DataLoader, ResumeEqualsAnUninterruptedRun) {
  const DataLoaderConfig config{64, 2, 2, 1, 3, 42};  // rank 1 of 2, accumulation 3
  DataLoader full(TokenDataset::Open(kValidation), config);
  std::vector<TokenBatch> batches;
  DataLoaderState saved;
  for (int i = 0; i < 60; ++i) {
    if (i == 25) saved = full.state();
    batches.push_back(full.NextBatch());
  }
  EXPECT_EQ(saved.windows_consumed, 25 * 4);
  EXPECT_EQ(full.state().epoch, 60 * 4 * 64 / 4852);
  EXPECT_GE(full.state().epoch, 1);
  DataLoader resumed(TokenDataset::Open(kValidation), config);
  resumed.LoadState(saved);
  EXPECT_EQ(resumed.state(), saved);
  for (int i = 25; i < 60; ++i) {
    const TokenBatch b = resumed.NextBatch();
    ASSERT_TRUE(b.input.equal(batches[i].input) && b.labels.equal(batches[i].labels) &&
                b.positions.equal(batches[i].positions))
        << "micro-batch " << i;
  }
  EXPECT_EQ(resumed.state(), full.state());
}

TEST(DataLoader, ResumeOnAnotherDpDegreeContinuesTheStream) {
  constexpr int64_t kSeqLen = 24;
  const auto all = RowsOf({2, 2, 2}, kSeqLen, 30);  // G = 8
  DataLoader at_step(TokenDataset::Open(kValidation), DataLoaderConfig{kSeqLen, 2, 2, 0, 2, 42});
  for (int i = 0; i < 12 * 2; ++i) at_step.NextBatch();  // 12 steps of 2 micro-batches
  const DataLoaderState saved = at_step.state();
  EXPECT_EQ(saved.windows_consumed, 12 * 8);
  const auto rest = RowsOf({1, 4, 2}, kSeqLen, 18, &saved);
  EXPECT_EQ(rest, std::vector<std::vector<int64_t>>(all.begin() + 12 * 8, all.end()));
  const auto rest8 = RowsOf({8, 1, 1}, kSeqLen, 18, &saved);
  EXPECT_EQ(rest8, rest);
}

TEST(DataLoader, BadConfigAndState) {
  const auto ds = TokenDataset::Open(kValidation);
  EXPECT_ERROR_CONTAINS(DataLoader(ds, DataLoaderConfig{16, 0, 1, 0, 1, 42}), "local_batch_size = 0");
  EXPECT_ERROR_CONTAINS(DataLoader(ds, DataLoaderConfig{16, 1, 0, 0, 1, 42}), "dp_degree = 0");
  EXPECT_ERROR_CONTAINS(DataLoader(ds, DataLoaderConfig{16, 1, 2, 2, 1, 42}), "dp_rank = 2");
  EXPECT_ERROR_CONTAINS(DataLoader(ds, DataLoaderConfig{16, 1, 2, -1, 1, 42}), "dp_rank = -1");
  EXPECT_ERROR_CONTAINS(DataLoader(ds, DataLoaderConfig{16, 1, 1, 0, 0, 42}), "gradient_accumulation_steps = 0");
  EXPECT_ERROR_CONTAINS(DataLoader(ds, DataLoaderConfig{0, 1, 1, 0, 1, 42}), "seq_len = 0");
  EXPECT_ERROR_CONTAINS(DataLoader(ds, DataLoaderConfig{16, 1, 1, 0, 1, -5}), "seed = -5");
  EXPECT_ERROR_CONTAINS(DataLoader(ds, DataLoaderConfig{16, int64_t{1} << 40, 1, 0, 1, 42}), "over 2^31");
  DataLoader loader(ds, DataLoaderConfig{16, 2, 2, 0, 1, 42});
  EXPECT_ERROR_CONTAINS(loader.LoadState({0, -4, 42}), "windows_consumed = -4");
  EXPECT_ERROR_CONTAINS(loader.LoadState({-1, 0, 42}), "epoch = -1");
  EXPECT_ERROR_CONTAINS(loader.LoadState({0, 4, -1}), "seed = -1");
  EXPECT_ERROR_CONTAINS(loader.LoadState({0, 6, 42}), "not a multiple of local_batch_size * dp_degree = 4");
  EXPECT_ERROR_CONTAINS(loader.LoadState({0, 400, 42}), "lies in epoch 1");  // 400 * 16 tokens > 4852
  EXPECT_EQ(loader.state(), (DataLoaderState{0, 0, 42}));                    // unchanged by the failures
  loader.LoadState({1, 400, 9});                                             // a checkpoint's seed wins
  EXPECT_EQ(loader.state(), (DataLoaderState{1, 400, 9}));
  PackedTokenStream seed9(ds, 16, 9);
  EXPECT_TRUE(loader.NextBatch().input[0].equal(seed9.Window(400).input));
}

// ---- corrupt files ---------------------------------------------------------------------

// The validation split's two files, and a scratch prefix to write variants to.
struct Files {
  std::string index = ReadFile(std::string(kValidation) + ".index");
  std::string tokens = ReadFile(std::string(kValidation) + ".tokens");
  std::string prefix = ::fsdp::testing::NewTestPath("corrupt");

  std::string Open(const std::string& index, const std::string& tokens) const {
    WriteFile(prefix + ".index", index);
    WriteFile(prefix + ".tokens", tokens);
    TokenDataset::Open(prefix);
    return "opened";
  }
};

template <typename T>
std::string With(std::string bytes, size_t offset, T value) {
  std::memcpy(bytes.data() + offset, &value, sizeof(T));
  return bytes;
}

TEST(TokenDataset, EveryTruncationOfTheIndexIsAnErrorNamingTheFile) {
  const Files f;
  ASSERT_EQ(f.index.size(), 64u + 8 * 82);
  for (size_t n = 0; n < f.index.size(); ++n) {
    EXPECT_ERROR_CONTAINS(TokenDataset::FromBytes(f.index.substr(0, n), f.tokens, "mem/validation"),
                          "mem/validation.index");
  }
  // Through real files: the header's lengths and a few of the offsets'.
  for (size_t n : {0, 1, 8, 12, 16, 40, 63, 64, 65, 72, 100, 719}) {
    EXPECT_ERROR_CONTAINS(f.Open(f.index.substr(0, n), f.tokens), f.prefix + ".index");
  }
  EXPECT_EQ(f.Open(f.index, f.tokens), "opened");
  EXPECT_ERROR_CONTAINS(f.Open(f.index + "x", f.tokens), f.prefix + ".index");
}

TEST(TokenDataset, TruncatedOrLongTokensFileIsAnError) {
  const Files f;
  for (size_t n : {size_t{0}, size_t{1}, f.tokens.size() - 2, f.tokens.size() - 1}) {
    EXPECT_ERROR_CONTAINS(f.Open(f.index, f.tokens.substr(0, n)), f.prefix + ".tokens");
  }
  EXPECT_ERROR_CONTAINS(f.Open(f.index, f.tokens + "ab"), f.prefix + ".tokens");
}

TEST(TokenDataset, BadHeaderFieldsAreErrorsNamingTheFileAndValue) {
  const Files f;
  const std::string idx = f.prefix + ".index";
  EXPECT_ERROR_CONTAINS(f.Open(With<char>(f.index, 0, 'X'), f.tokens), idx + " does not start with the magic");
  EXPECT_ERROR_CONTAINS(f.Open(With<uint32_t>(f.index, 8, 2), f.tokens), "format version 2");
  EXPECT_ERROR_CONTAINS(f.Open(With<uint32_t>(f.index, 12, 4), f.tokens), "token_bytes 4 for vocab_size 2048");
  EXPECT_ERROR_CONTAINS(f.Open(With<uint32_t>(f.index, 12, 3), f.tokens), "token_bytes 3");
  EXPECT_ERROR_CONTAINS(f.Open(With<uint64_t>(f.index, 16, 0), f.tokens), "vocab_size 0");
  EXPECT_ERROR_CONTAINS(f.Open(With<uint64_t>(f.index, 16, (uint64_t{1} << 32) + 1), f.tokens), "vocab_size");
  EXPECT_ERROR_CONTAINS(f.Open(With<uint64_t>(f.index, 24, 2048), f.tokens), "bos_id 2048");
  EXPECT_ERROR_CONTAINS(f.Open(With<uint64_t>(f.index, 32, 5000), f.tokens), "eos_id 5000");
  EXPECT_ERROR_CONTAINS(f.Open(With<uint64_t>(f.index, 40, 82), f.tokens), "num_documents 82");
  EXPECT_ERROR_CONTAINS(f.Open(With<uint64_t>(f.index, 40, ~uint64_t{0}), f.tokens), "num_documents");
  EXPECT_ERROR_CONTAINS(f.Open(With<uint64_t>(f.index, 48, 4934), f.tokens), "says num_tokens 4934");
  EXPECT_ERROR_CONTAINS(f.Open(With<uint64_t>(f.index, 48, ~uint64_t{0}), f.tokens), "num_tokens");
  EXPECT_ERROR_CONTAINS(f.Open(With<uint64_t>(f.index, 56, 1), f.tokens), "reserved");
  // A smaller vocab than a token: the scan finds it and names the token file.
  EXPECT_ERROR_CONTAINS(f.Open(With<uint64_t>(f.index, 16, 100), f.tokens), f.prefix + ".tokens has token id");
}

TEST(TokenDataset, BadOffsetsAndTokensAreErrorsNamingTheFile) {
  const Files f;
  const std::string idx = f.prefix + ".index";
  const size_t off = kTokenIndexHeaderBytes;
  EXPECT_ERROR_CONTAINS(f.Open(With<uint64_t>(f.index, off, 3), f.tokens), idx + " has offsets[0] = 3");
  // offsets[5] past offsets[6]: decreasing.
  uint64_t o6 = 0;
  std::memcpy(&o6, f.index.data() + off + 6 * 8, 8);
  EXPECT_ERROR_CONTAINS(f.Open(With<uint64_t>(f.index, off + 5 * 8, o6 + 1), f.tokens),
                        idx + " has decreasing offsets: offsets[6]");
  uint64_t o80 = 0;  // the last document's start: a last offset there is monotone, and wrong
  std::memcpy(&o80, f.index.data() + off + 80 * 8, 8);
  ASSERT_LT(o80, 4933u);
  EXPECT_ERROR_CONTAINS(f.Open(With<uint64_t>(f.index, off + 81 * 8, o80), f.tokens),
                        "last offset " + std::to_string(o80));
  EXPECT_ERROR_CONTAINS(f.Open(With<uint64_t>(f.index, off + 81 * 8, ~uint64_t{0}), f.tokens), "last offset");
  EXPECT_ERROR_CONTAINS(f.Open(f.index, With<uint16_t>(f.tokens, 2 * 100, 2048)),
                        f.prefix + ".tokens has token id 2048 at token 100 >= vocab_size 2048");
  EXPECT_ERROR_CONTAINS(f.Open(f.index, With<uint16_t>(f.tokens, f.tokens.size() - 2, 65535)), "token id 65535");
}

TEST(TokenDataset, MissingFilesAreErrorsNamingThem) {
  const std::string prefix = ::fsdp::testing::NewTestPath("missing");
  EXPECT_ERROR_CONTAINS(TokenDataset::Open(prefix), "cannot open " + prefix + ".index");
  WriteTokenDataset(prefix, {{0, 1}}, 8, 0, 1);
  std::filesystem::remove(prefix + ".tokens");
  EXPECT_ERROR_CONTAINS(TokenDataset::Open(prefix), "cannot open " + prefix + ".tokens");
  std::filesystem::create_directory(prefix + ".tokens");
  EXPECT_ERROR_CONTAINS(TokenDataset::Open(prefix), prefix + ".tokens is not a regular file");
}

}  // namespace
}  // namespace fsdp::train
