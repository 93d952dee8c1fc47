// //checkpoint on its own: the reader and writer round trip, Python's default torch.load reads
// what the writer writes, full state dict (tensor dict) files and optimizer-state files round
// trip bit-exactly, and the file IO names the path and the reason in its errors. (Corrupted and malicious files:
// fuzz/corrupt_checkpoint_test.cc.)
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/checkpoint_zip.h"
#include "checkpoint/crc32.h"
#include "checkpoint/file_io.h"
#include "checkpoint/optim_state_file.h"
#include "checkpoint/tensor_dict_file.h"
#include "testing/expect_error.h"
#include "testing/peer_python.h"

namespace fsdp::checkpoint {
namespace {

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir ? dir : "/tmp";
}

std::string TempPath(const std::string& name) { return absl::StrCat(TempDir(), "/", name, "_", getpid(), ".pt"); }

// Names in `dir` that start with `prefix` (leftover temporary files).
std::vector<std::string> FilesStartingWith(const std::string& dir, const std::string& prefix) {
  std::vector<std::string> out;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (const dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind(prefix, 0) == 0) out.push_back(name);
  }
  closedir(d);
  return out;
}

void ExpectSameTensor(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  EXPECT_EQ(a.scalar_type(), b.scalar_type()) << what;
  EXPECT_EQ(a.sizes(), b.sizes()) << what;
  EXPECT_TRUE(at::equal(a, b)) << what;
}

// The CRC-32 every record read is checked with: the folding paths (PCLMULQDQ, and VPCLMULQDQ
// on 512-bit registers from 256 bytes, where the CPU has them) against the table one and the
// standard check value, at every length through the 16-, 64-, 256- and 2048-bit-fold
// boundaries and every alignment, whole and in pieces (Crc32Update's zlib semantics).
TEST(Checkpoint, Crc32MatchesTheTableAndTheCheckValue) {
  EXPECT_EQ(internal::Crc32("123456789", 9), 0xCBF43926u);  // CRC-32/ISO-HDLC's check value
  EXPECT_EQ(internal::Crc32Portable("123456789", 9), 0xCBF43926u);
  EXPECT_EQ(internal::Crc32Update(internal::Crc32("1234", 4), "56789", 5), 0xCBF43926u);
  EXPECT_EQ(internal::Crc32(nullptr, 0), 0u);
  std::vector<char> bytes((1 << 20) + 64);
  uint32_t x = 12345;
  for (char& b : bytes) b = static_cast<char>((x = x * 1103515245u + 12345u) >> 24);
  constexpr size_t kMax = 2100;
  for (size_t offset = 0; offset < 8; ++offset) {
    const char* p = bytes.data() + offset;
    uint32_t by_byte = 0;  // p[0, n) a byte at a time
    for (size_t n = 0; n <= kMax; ++n) {
      const uint32_t want = internal::Crc32Portable(p, n);
      ASSERT_EQ(by_byte, want) << "offset " << offset << " length " << n << " a byte at a time";
      if (n < kMax) by_byte = internal::Crc32Update(by_byte, p + n, 1);
      ASSERT_EQ(internal::Crc32(p, n), want) << "offset " << offset << " length " << n;
      ASSERT_EQ(internal::Crc32Update(0, p, n), want) << "offset " << offset << " length " << n;
      for (size_t split : {size_t{1}, size_t{7}, size_t{16}, size_t{63}, size_t{64}, size_t{100}, size_t{255},
                           size_t{256}, size_t{257}, size_t{1029}, n / 2, n - n / 3}) {
        if (split > n) continue;
        ASSERT_EQ(internal::Crc32Update(internal::Crc32(p, split), p + split, n - split), want)
            << "offset " << offset << " length " << n << " split at " << split;
      }
      if (n >= 20) {  // three pieces, the middle one short
        const size_t a = n / 3, b = a + 1 + n % 7;
        ASSERT_EQ(internal::Crc32Update(internal::Crc32Update(internal::Crc32(p, a), p + a, b - a), p + b, n - b), want)
            << "offset " << offset << " length " << n << " split at " << a << " and " << b;
      }
    }
  }
  for (size_t n : {size_t{4096}, size_t{65535}, size_t{65536 + 13}, size_t{(1 << 20) + 13}, bytes.size() - 8}) {
    const char* p = bytes.data() + 3;
    const uint32_t want = internal::Crc32Portable(p, n);
    EXPECT_EQ(internal::Crc32(p, n), want) << n;
    for (size_t split : {size_t{13}, size_t{4093}, n / 2 + 5, n - 250}) {
      EXPECT_EQ(internal::Crc32Update(internal::Crc32(p, split), p + split, n - split), want)
          << n << " split at " << split;
    }
  }
}

TEST(Checkpoint, WriterAndReaderRoundTripNestedValues) {
  c10::impl::GenericDict inner(c10::StringType::get(), c10::AnyType::get());
  inner.insert("t", at::arange(6, at::kFloat).reshape({2, 3}).t());  // strided: saved as is
  inner.insert("i", int64_t{-7});
  inner.insert("f", 2.5);
  inner.insert("b", true);
  inner.insert("s", std::string("text"));
  c10::impl::GenericList list(c10::AnyType::get());
  list.push_back(c10::IValue(inner));
  list.push_back(c10::IValue());
  const auto root = c10::ivalue::Tuple::create(c10::IValue(list), c10::IValue(int64_t{3}));
  const std::vector<char> bytes = WriteCheckpoint(c10::IValue(root));
  const c10::IValue back = ReadCheckpoint(bytes.data(), bytes.size(), "'nested.pt'");
  ASSERT_TRUE(back.isTuple());
  const auto& top = back.toTupleRef().elements();
  ASSERT_EQ(top.size(), 2u);
  EXPECT_EQ(top[1].toInt(), 3);
  const auto items = top[0].toListRef();
  ASSERT_EQ(items.size(), 2u);
  EXPECT_TRUE(items[1].isNone());
  const auto d = items[0].toGenericDict();
  ExpectSameTensor(d.at("t").toTensor(), at::arange(6, at::kFloat).reshape({2, 3}).t(), "t");
  EXPECT_EQ(d.at("i").toInt(), -7);
  EXPECT_EQ(d.at("f").toDouble(), 2.5);
  EXPECT_EQ(d.at("b").toBool(), true);
  EXPECT_EQ(d.at("s").toStringRef(), "text");

  EXPECT_ERROR_CONTAINS(WriteCheckpoint(c10::IValue(at::empty({2}, at::kMeta))),
                        "WriteCheckpoint: a tensor is on meta; move it to the CPU first");
  EXPECT_ERROR_CONTAINS(ReadCheckpoint(bytes.data(), 10, "'short.pt'"),
                        "'short.pt' is not a valid checkpoint: it has 10 bytes, fewer than the 22");
}

TEST(Checkpoint, TensorDictFileRoundTripsEveryDtypeAndKeepsOrder) {
  TensorDict dict;
  const at::Tensor base = at::arange(24, at::kFloat).reshape({4, 6});
  dict.insert("z.view", base.narrow(1, 1, 3));
  dict.insert("a.transposed", base.t());
  dict.insert("scalar", at::scalar_tensor(2.5, at::kDouble));
  dict.insert("empty", at::empty({0, 3}));
  dict.insert("grad", at::ones({2}, at::requires_grad()));  // saved detached
  for (at::ScalarType dtype : {at::kDouble, at::kHalf, at::kBFloat16, at::kLong, at::kInt, at::kShort, at::kChar,
                               at::kByte, at::kBool, at::kComplexFloat, at::kComplexDouble}) {
    dict.insert(std::string("dtype_") + c10::toString(dtype), at::arange(3, at::kDouble).to(dtype));
  }
  const std::string path = TempPath("tensor_dict");
  SaveTensorDict(dict, path);
  const TensorDict loaded = LoadTensorDict(path);
  ASSERT_EQ(loaded.size(), dict.size());
  for (size_t i = 0; i < dict.size(); ++i) {
    EXPECT_EQ(loaded.items()[i].key(), dict.items()[i].key());
    ExpectSameTensor(loaded.items()[i].value(), dict.items()[i].value().detach(), dict.items()[i].key());
  }
  EXPECT_FALSE(loaded["grad"].requires_grad());
  // The in-memory twins give the same bytes and the same dict.
  EXPECT_EQ(ReadFile(path, "test"), SerializeTensorDict(dict));
  EXPECT_EQ(DeserializeTensorDict(SerializeTensorDict(dict), "'mem'").size(), dict.size());
  EXPECT_EQ(LoadTensorDict(path).size(), dict.size());
  std::remove(path.c_str());
  const std::string empty = TempPath("empty_dict");
  SaveTensorDictAs(TensorDict(), empty, "Caller");
  EXPECT_TRUE(LoadTensorDictAs(empty, "Caller").is_empty());
  std::remove(empty.c_str());
}

TEST(Checkpoint, TensorDictErrorsNameTheCallerAndTheSource) {
  const std::vector<char> optim = SerializeOptimStateDict(OptimStateDict{"SGD", {}, {}});
  EXPECT_ERROR_CONTAINS(DeserializeTensorDict(optim, "'o.pt'"),
                        "LoadTensorDict: 'o.pt' holds a Tuple, not a str -> Tensor dict");
  EXPECT_ERROR_CONTAINS(DeserializeTensorDict(optim, "'o.pt'", "LoadFullStateDictFile"),
                        "LoadFullStateDictFile: 'o.pt' holds a Tuple");
  c10::impl::GenericDict mixed(c10::StringType::get(), c10::AnyType::get());
  mixed.insert("w", at::ones({1}));
  mixed.insert("n", int64_t{1});
  EXPECT_ERROR_CONTAINS(DeserializeTensorDict(WriteCheckpoint(c10::IValue(mixed)), "'m.pt'"),
                        "LoadTensorDict: 'm.pt' has an entry that is not str -> Tensor (String -> Int)");
  const std::string missing = TempDir() + "/no_such_file.pt";
  EXPECT_ERROR_CONTAINS(LoadTensorDict(missing),
                        "LoadTensorDict: cannot open '" + missing + "' for reading (No such file or directory)");
}

TEST(Checkpoint, OptimStateFileRoundTripsEveryValueKind) {
  OptimStateDict sd;
  sd.optimizer = "AdamW";
  sd.state["a.w"] = {
      {"step", int64_t{4}}, {"exp_avg", at::randn({2, 3})}, {"lr_scale", 0.5}, {"count", at::scalar_tensor(3.0)}};
  sd.state["b"] = {{"step", int64_t{4}}, {"exp_avg", at::randn({5}, at::kDouble)}};
  sd.param_groups.push_back(
      {{"a.w"}, {{"lr", 1e-3}, {"betas", c10::ivalue::Tuple::create(0.9, 0.999)}, {"amsgrad", false}}});
  sd.param_groups.push_back({{"b", "c"}, {{"lr", int64_t{1}}}});
  const std::string path = TempPath("optim_state");
  SaveOptimStateDict(sd, path);
  const OptimStateDict loaded = LoadOptimStateDict(path);
  std::remove(path.c_str());
  EXPECT_EQ(loaded.optimizer, "AdamW");
  ASSERT_EQ(loaded.state.size(), 2u);
  for (const auto& [fqn, values] : sd.state) {
    ASSERT_EQ(loaded.state.at(fqn).size(), values.size()) << fqn;
    for (const auto& [name, value] : values) {
      const StateValue& other = loaded.state.at(fqn).at(name);
      ASSERT_EQ(value.index(), other.index()) << fqn << " " << name;
      EXPECT_EQ(Classify(value), Classify(other)) << fqn << " " << name;
      if (const auto* t = std::get_if<at::Tensor>(&value)) ExpectSameTensor(std::get<at::Tensor>(other), *t, name);
    }
  }
  EXPECT_EQ(std::get<int64_t>(loaded.state.at("a.w").at("step")), 4);
  EXPECT_EQ(std::get<double>(loaded.state.at("a.w").at("lr_scale")), 0.5);
  EXPECT_EQ(Classify(loaded.state.at("a.w").at("count")), StateKind::kZeroDimTensor);
  EXPECT_EQ(Classify(loaded.state.at("a.w").at("exp_avg")), StateKind::kPositiveDimTensor);
  EXPECT_EQ(Classify(loaded.state.at("a.w").at("step")), StateKind::kNonTensor);
  ASSERT_EQ(loaded.param_groups.size(), 2u);
  EXPECT_EQ(loaded.param_groups[1].params, (std::vector<std::string>{"b", "c"}));
  EXPECT_EQ(loaded.param_groups[0].options.at("lr").toDouble(), 1e-3);
  EXPECT_EQ(loaded.param_groups[0].options.at("betas").toTupleRef().elements()[1].toDouble(), 0.999);
  EXPECT_EQ(loaded.param_groups[1].options.at("lr").toInt(), 1);

  EXPECT_ERROR_CONTAINS(DeserializeOptimStateDict(SerializeTensorDict(TensorDict()), "'m.pt'"),
                        "LoadOptimStateDict: 'm.pt' is not an optimizer state dict: expected a 3-tuple");
  const std::string missing = TempDir() + "/no_such_optim.pt";
  EXPECT_ERROR_CONTAINS(LoadOptimStateDict(missing), "LoadOptimStateDict: cannot open '" + missing + "' for reading");
  EXPECT_ERROR_CONTAINS(SaveOptimStateDict(sd, "/no/such/dir/o.pt"),
                        "SaveOptimStateDict: cannot create '/no/such/dir/o.pt.tmp.");
}

TEST(Checkpoint, FileIoWritesAtomicallyAndNamesThePathInErrors) {
  const std::string path = TempPath("atomic");
  WriteFileAtomically(path, {'o', 'l', 'd'}, "Test");
  WriteFileAtomically(path, {'n', 'e', 'w', '!'}, "Test");
  EXPECT_EQ(ReadFile(path, "Test"), (std::vector<char>{'n', 'e', 'w', '!'}));
  WriteFileAtomically(path, {}, "Test");
  EXPECT_TRUE(ReadFile(path, "Test").empty());
  const std::string base = path.substr(path.rfind('/') + 1);
  EXPECT_EQ(FilesStartingWith(TempDir(), base + ".tmp."), std::vector<std::string>{}) << "temporary file left behind";
  std::remove(path.c_str());

  // A missing file, a directory, a missing directory, a parent that is a file.
  const std::string missing = TempDir() + "/missing_file";
  EXPECT_ERROR_CONTAINS(ReadFile(missing, "Reader"),
                        "Reader: cannot open '" + missing + "' for reading (No such file or directory)");
  EXPECT_ERROR_CONTAINS(ReadFile(TempDir(), "Reader"),
                        "Reader: '" + TempDir() + "' is a directory, not a checkpoint file");
  EXPECT_ERROR_CONTAINS(WriteFileAtomically("/no/such/dir/x.pt", {'x'}, "Writer"),
                        "Writer: cannot create '/no/such/dir/x.pt.tmp.");
  EXPECT_ERROR_CONTAINS(WriteFileAtomically("/no/such/dir/x.pt", {'x'}, "Writer"),
                        "' to write '/no/such/dir/x.pt' (No such file or directory)");
  const std::string file = TempPath("a_file");
  WriteFileAtomically(file, {'x'}, "Test");
  EXPECT_ERROR_CONTAINS(WriteFileAtomically(file + "/x.pt", {'x'}, "Writer"), "(Not a directory)");
  // Renaming onto a directory fails after the write: the temporary file is removed.
  const std::string dir = TempPath("a_dir");
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  const std::string inner = dir + "/keep";  // a non-empty directory cannot be replaced
  WriteFileAtomically(inner, {'k'}, "Test");
  EXPECT_ERROR_CONTAINS(WriteFileAtomically(dir, {'x'}, "Writer"), "Writer: cannot rename '" + dir + ".tmp.");
  const std::string dir_base = dir.substr(dir.rfind('/') + 1);
  EXPECT_EQ(FilesStartingWith(TempDir(), dir_base + ".tmp."), std::vector<std::string>{});
  EXPECT_ERROR_CONTAINS(WriteFileAtomically("", {'x'}, "Writer"), "Writer: the path is empty");
  std::remove(inner.c_str());
  ::rmdir(dir.c_str());
  std::remove(file.c_str());
}

// Same structure, dtypes, sizes, strides, storage offsets, requires_grad and values.
void ExpectSameValue(const c10::IValue& a, const c10::IValue& b, const std::string& at) {
  ASSERT_EQ(a.tagKind(), b.tagKind()) << at;
  if (a.isTensor()) {
    const at::Tensor &x = a.toTensor(), &y = b.toTensor();
    ExpectSameTensor(x, y, at);
    EXPECT_EQ(x.strides(), y.strides()) << at;
    EXPECT_EQ(x.storage_offset(), y.storage_offset()) << at;
    EXPECT_EQ(x.requires_grad(), y.requires_grad()) << at;
  } else if (a.isTuple() || a.isList()) {
    const auto xs = a.isTuple() ? a.toTupleRef().elements().vec() : a.toListRef().vec();
    const auto ys = b.isTuple() ? b.toTupleRef().elements().vec() : b.toListRef().vec();
    ASSERT_EQ(xs.size(), ys.size()) << at;
    for (size_t i = 0; i < xs.size(); ++i) ExpectSameValue(xs[i], ys[i], absl::StrCat(at, "[", i, "]"));
  } else if (a.isGenericDict()) {
    const auto x = a.toGenericDict(), y = b.toGenericDict();
    ASSERT_EQ(x.size(), y.size()) << at;
    auto it = y.begin();
    for (const auto& item : x) {  // in insertion order
      ExpectSameValue(item.key(), it->key(), at + " key");
      ExpectSameValue(item.value(), it->value(), at + "[" + c10::str(item.key()) + "]");
      ++it;
    }
  } else {
    EXPECT_EQ(a, b) << at;  // None, bool, int, float, str
  }
}

// Every kind of value the writer writes: views sharing a storage, a non-contiguous tensor, a
// 0-d, an empty and a requires_grad tensor, every dtype, int keys, nesting, UTF-8.
c10::IValue EveryKindOfValue() {
  c10::impl::GenericDict d(c10::AnyType::get(), c10::AnyType::get());
  const at::Tensor t = at::arange(24, at::kFloat).reshape({4, 6});
  d.insert("t", t);
  d.insert("view", t.narrow(0, 1, 2).narrow(1, 2, 3));  // t's storage, offset 8
  d.insert("transposed", at::randn({3, 5}, at::kDouble).t());
  d.insert("scalar", at::scalar_tensor(-1.5, at::kBFloat16));
  d.insert("empty", at::empty({0, 3}, at::kHalf));
  d.insert("grad", at::randn({2, 2}).requires_grad_());
  for (at::ScalarType dtype :
       {at::kLong, at::kInt, at::kShort, at::kChar, at::kByte, at::kBool, at::kComplexFloat, at::kComplexDouble}) {
    d.insert(std::string("dtype_") + c10::toString(dtype), at::arange(3, at::kDouble).to(dtype));
  }
  c10::impl::GenericList list(c10::AnyType::get());
  for (c10::IValue v : {c10::IValue(true), c10::IValue(), c10::IValue(1.25), c10::IValue(int64_t{-(int64_t{1} << 50)}),
                        c10::IValue(int64_t{70000}), c10::IValue(std::string("caf\xc3\xa9"))}) {
    list.push_back(v);
  }
  d.insert(int64_t{3}, list);
  d.insert("tuple", c10::ivalue::Tuple::create(c10::IValue(int64_t{1}), c10::IValue(std::string("x"))));
  d.insert("empty_tuple", c10::ivalue::Tuple::create(std::vector<c10::IValue>{}));
  d.insert("empty_list", c10::impl::GenericList(c10::AnyType::get()));
  return d;
}

TEST(Checkpoint, WriterNamesOnlyWhatWeightsOnlyLoadsAndWritesEachStorageOnce) {
  const c10::IValue value = EveryKindOfValue();
  const std::vector<char> bytes = WriteCheckpoint(value);
  const std::string text(bytes.begin(), bytes.end());
  EXPECT_FALSE(absl::StrContains(text, "torch.jit")) << "LibTorch's type tags: weights_only refuses them";
  EXPECT_TRUE(absl::StrContains(text, "torch._utils\n_rebuild_tensor_v2\n"));
  EXPECT_TRUE(absl::StrContains(text, "torch\nBFloat16Storage\n"));
  const c10::IValue back = ReadCheckpoint(bytes.data(), bytes.size(), "'all.pt'");
  ExpectSameValue(back, value, "root");
  const auto d = back.toGenericDict();
  EXPECT_TRUE(d.at("view").toTensor().storage().is_alias_of(d.at("t").toTensor().storage()));
  const internal::CheckpointZip zip(bytes.data(), bytes.size(), "test");
  EXPECT_TRUE(zip.Has("archive/data/0"));
  EXPECT_TRUE(zip.Has("archive/version"));
  EXPECT_EQ(zip.Find("archive/data/0").size, 24 * sizeof(float));  // t's, once for both views
  EXPECT_EQ(zip.Find("archive/data/0").offset % 64, 0u);
}

TEST(Checkpoint, WriterRefusesWhatNoReaderReadsBack) {
  auto nested = [](int n) {
    c10::IValue v = c10::impl::GenericList(c10::AnyType::get());
    for (int i = 1; i < n; ++i) {
      c10::impl::GenericList outer(c10::AnyType::get());
      outer.push_back(v);
      v = outer;
    }
    return v;
  };
  const std::vector<char> deepest = WriteCheckpoint(nested(64));
  EXPECT_NO_THROW(ReadCheckpoint(deepest.data(), deepest.size(), "'deep.pt'"));
  EXPECT_ERROR_CONTAINS(WriteCheckpoint(nested(65)), "WriteCheckpoint: the value nests deeper than 64 containers");
  EXPECT_ERROR_CONTAINS(WriteCheckpoint(c10::IValue(std::string("\xff"))),
                        "WriteCheckpoint: the str '\xff' is not valid UTF-8");
  EXPECT_ERROR_CONTAINS(WriteCheckpoint(c10::IValue(at::zeros({2}, at::kUInt16))),
                        "WriteCheckpoint: cannot write a UInt16 tensor");
  c10::impl::GenericDict by_tensor(c10::AnyType::get(), c10::AnyType::get());
  by_tensor.insert(at::ones({1}), int64_t{1});
  EXPECT_ERROR_CONTAINS(WriteCheckpoint(c10::IValue(by_tensor)),
                        "WriteCheckpoint: a dict key is a Tensor, not a str, int, float or bool");
  const at::Tensor t = at::zeros({4});
  EXPECT_ERROR_CONTAINS(WriteCheckpoint(c10::ivalue::Tuple::create(c10::IValue(t), c10::IValue(t.view(at::kInt)))),
                        "WriteCheckpoint: two tensors view one storage as Float and Int");
}

// Add writes a tensor's record at once and returns a stand-in that Finish pickles as it.
TEST(Checkpoint, TorchSaveWriterWritesAddedTensorsFirst) {
  std::vector<char> bytes;
  TorchSaveWriter writer([&bytes](const char* data, size_t size) { bytes.insert(bytes.end(), data, data + size); },
                         "Caller");
  const at::Tensor a = at::randn({3, 4}), b = at::arange(10, at::kLong);
  const at::Tensor stand_in = writer.Add(a.t());  // written contiguous
  EXPECT_TRUE(stand_in.is_meta());
  const size_t after_add = bytes.size();
  EXPECT_GT(after_add, a.nbytes());
  c10::impl::GenericDict root(c10::StringType::get(), c10::AnyType::get());
  root.insert("a", stand_in);
  root.insert("b", b);
  writer.Finish(root);
  const c10::IValue back = ReadCheckpoint(bytes.data(), bytes.size(), "'added.pt'");
  ExpectSameTensor(back.toGenericDict().at("a").toTensor(), a.t().contiguous(), "a");
  ExpectSameTensor(back.toGenericDict().at("b").toTensor(), b, "b");
  EXPECT_ERROR_CONTAINS(writer.Finish(root), "Caller: Finish called twice");
  EXPECT_ERROR_CONTAINS(WriteCheckpoint(at::empty({2}, at::kMeta)), "WriteCheckpoint: a tensor is on meta");
}

// Python's torch.load, with its defaults (weights_only=True), loads what we write, the same
// values (compared here after Python torch.save's them back).
TEST(CheckpointInterop, PythonsDefaultTorchLoadReadsOurFiles) {
  std::string why_not;
  const std::string python = fsdp::testing::PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << why_not;
  const c10::IValue value = EveryKindOfValue();
  const std::string ours = TempPath("ours"), back = TempPath("back");
  WriteFileAtomically(ours, WriteCheckpoint(value), "test");
  std::string output;
  const int status = fsdp::testing::RunCommand(
      absl::StrCat(python, " checkpoint/testdata/torch_load_interop.py ", ours, " ", back), &output);
  ASSERT_EQ(status, 0) << output;
  ASSERT_TRUE(absl::StrContains(output, "OK")) << output;
  const std::vector<char> bytes = ReadFile(back, "test");
  ExpectSameValue(ReadCheckpoint(bytes.data(), bytes.size(), back), value, "root");
  std::remove(ours.c_str());
  std::remove(back.c_str());
}

}  // namespace
}  // namespace fsdp::checkpoint
