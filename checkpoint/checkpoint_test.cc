// //checkpoint on its own: the reader and writer round trip, full state dict (tensor dict)
// files and optimizer-state files round trip bit-exactly, and the file IO names the path and
// the reason in its errors. (Corrupted and malicious files: fuzz/corrupt_checkpoint_test.cc.)
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/checkpoint_zip.h"
#include "checkpoint/crc32.h"
#include "checkpoint/file_io.h"
#include "checkpoint/optim_state_file.h"
#include "checkpoint/tensor_dict_file.h"
#include "testing/expect_error.h"

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

// ReadCheckpointAliasing: the same values and checks as ReadCheckpoint, its storages inside
// the caller's bytes.
TEST(Checkpoint, AliasingReadSharesTheCallersBytes) {
  const at::Tensor t = at::randn({5, 7});
  std::vector<char> bytes = WriteCheckpoint(c10::IValue(t));
  const at::Tensor copied = ReadCheckpoint(bytes.data(), bytes.size(), "bytes").toTensor();
  const at::Tensor aliased = ReadCheckpointAliasing(bytes.data(), bytes.size(), "bytes").toTensor();
  EXPECT_TRUE(at::equal(aliased, t));
  EXPECT_TRUE(at::equal(copied, t));
  const char* p = static_cast<const char*>(aliased.data_ptr());
  EXPECT_TRUE(p >= bytes.data() && p + aliased.nbytes() <= bytes.data() + bytes.size());
  EXPECT_FALSE(static_cast<const char*>(copied.data_ptr()) >= bytes.data() &&
               static_cast<const char*>(copied.data_ptr()) < bytes.data() + bytes.size());
  bytes[p - bytes.data()] ^= 0x01;  // the CRC is checked as ReadCheckpoint's
  EXPECT_ERROR_CONTAINS(ReadCheckpointAliasing(bytes.data(), bytes.size(), "bytes"), "(corrupted)");
}

}  // namespace
}  // namespace fsdp::checkpoint
