// Checkpoint files are input: truncated, bit-flipped and crafted files give a c10::Error
// naming the file and the bad value (never a crash), valid files read exactly as LibTorch's
// own reader reads them, and files Python's torch.save wrote load too.
#include <ATen/ATen.h>
#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_reader.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fuzz/fuzz_models.h"
#include "optim_state/fsdp2_optim_state.h"
#include "optim_state/optim_state_dict.h"
#include "testing/expect_error.h"

namespace fsdp::fuzz {
namespace {

using checkpoint::ReadCheckpoint;
using fsdp2::FullStateDict;
using namespace std::string_literals;

c10::IValue Read(const std::vector<char>& bytes) { return ReadCheckpoint(bytes.data(), bytes.size(), "'test.pt'"); }

// Same structure, dtypes, sizes, strides, offsets and values.
void ExpectSame(const c10::IValue& a, const c10::IValue& b, const std::string& at = "root") {
  ASSERT_EQ(a.tagKind(), b.tagKind()) << at;
  if (a.isTensor()) {
    const at::Tensor &x = a.toTensor(), &y = b.toTensor();
    EXPECT_EQ(x.scalar_type(), y.scalar_type()) << at;
    EXPECT_EQ(x.sizes(), y.sizes()) << at;
    EXPECT_EQ(x.strides(), y.strides()) << at;
    EXPECT_EQ(x.storage_offset(), y.storage_offset()) << at;
    EXPECT_TRUE(at::equal(x, y)) << at;
  } else if (a.isTuple() || a.isList()) {
    const auto xs = a.isTuple() ? a.toTupleRef().elements().vec() : a.toListRef().vec();
    const auto ys = b.isTuple() ? b.toTupleRef().elements().vec() : b.toListRef().vec();
    ASSERT_EQ(xs.size(), ys.size()) << at;
    for (size_t i = 0; i < xs.size(); ++i) ExpectSame(xs[i], ys[i], absl::StrCat(at, "[", i, "]"));
  } else if (a.isGenericDict()) {
    const auto x = a.toGenericDict(), y = b.toGenericDict();
    ASSERT_EQ(x.size(), y.size()) << at;
    auto it = y.begin();
    for (const auto& item : x) {  // insertion order is kept by both readers
      ExpectSame(item.key(), it->key(), at + " key");
      ExpectSame(item.value(), it->value(),
                 absl::StrCat(at, "[", item.key().isString() ? item.key().toStringRef() : "?", "]"));
      ++it;
    }
  } else if (a.isString()) {
    EXPECT_EQ(a.toStringRef(), b.toStringRef()) << at;
  } else if (a.isInt() || a.isBool()) {
    EXPECT_EQ(a.isInt() ? a.toInt() : a.toBool(), b.isInt() ? b.toInt() : b.toBool()) << at;
  } else if (a.isDouble()) {
    EXPECT_EQ(a.toDouble(), b.toDouble()) << at;
  } else {
    EXPECT_TRUE(a.isNone()) << at << ": " << a.tagKind();
  }
}

NamedBytes AllSeeds() {
  NamedBytes all = FullStateDictSeeds();
  for (auto& item : OptimStateSeeds()) all.push_back(std::move(item));
  return all;
}

std::vector<char> FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// ------------------------------------------------------------------ crafted files
// A zip archive as torch writes it, with the given records under "archive/".
std::vector<char> Archive(const std::vector<std::pair<std::string, std::string>>& records) {
  std::vector<char> out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) {
    out.insert(out.end(), static_cast<const char*>(data), static_cast<const char*>(data) + n);
    return n;
  });
  for (const auto& [name, bytes] : records) writer.writeRecord(name, bytes.data(), bytes.size());
  writer.writeEndOfFile();
  return out;
}

// Pickle opcodes, protocol 2.
struct Pickle {
  std::string b = "\x80\x02";
  Pickle& Op(const std::string& ops) {
    b += ops;
    return *this;
  }
  Pickle& Str(const std::string& s) {
    const uint32_t n = s.size();
    b += 'X';
    b.append(reinterpret_cast<const char*>(&n), 4);
    b += s;
    return *this;
  }
  Pickle& Int(int64_t v) {  // LONG1 with 8 bytes: any int64
    b += "\x8a\x08";
    b.append(reinterpret_cast<const char*>(&v), 8);
    return *this;
  }
  Pickle& Global(const std::string& module, const std::string& name) { return Op("c" + module + "\n" + name + "\n"); }
  Pickle& Ints(const std::vector<int64_t>& v) {
    Op("(");
    for (int64_t x : v) Int(x);
    return Op("t");
  }
  // _rebuild_tensor_v2(storage "0", offset, sizes, strides, requires_grad, OrderedDict())
  Pickle& Tensor(int64_t numel, int64_t offset, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                 const std::string& storage = "FloatStorage", bool requires_grad = false) {
    Global("torch._utils", "_rebuild_tensor_v2").Op("((").Str("storage").Global("torch", storage).Str("0").Str("cpu");
    Int(numel).Op("tQ").Int(offset).Ints(sizes).Ints(strides).Op(requires_grad ? "\x88" : "\x89");
    return Global("collections", "OrderedDict").Op(")Rt").Op("R");
  }
  std::string Done() const { return b + "."; }
};

// A file whose data.pkl is {"w": <tensor>} and whose storage "0" holds `storage_bytes`.
std::vector<char> TensorFile(Pickle tensor_pickle, const std::string& storage_bytes) {
  Pickle p;
  p.Op("}(").Str("w");
  p.b += tensor_pickle.b.substr(2);
  return Archive({{"data.pkl", p.Op("u").Done()}, {"data/0", storage_bytes}});
}

std::vector<char> PickleFile(const Pickle& p) { return Archive({{"data.pkl", p.Done()}}); }

// Overwrites a little-endian field of the central-directory entry of `name`.
void PatchCentral(std::vector<char>& file, const std::string& name, size_t field, uint32_t value, size_t width) {
  for (size_t i = 0; i + 46 <= file.size(); ++i) {
    if (std::memcmp(&file[i], "PK\x01\x02", 4) != 0) continue;
    uint16_t len;
    std::memcpy(&len, &file[i + 28], 2);
    if (std::string(&file[i + 46], len) != name) continue;
    std::memcpy(&file[i + field], &value, width);
    return;
  }
  ADD_FAILURE() << "no central directory entry " << name;
}

#define EXPECT_BAD_FILE(bytes, substring) EXPECT_ERROR_CONTAINS(Read(bytes), substring)

TEST(CorruptCheckpoint, ValidFilesReadAsLibTorchReadsThem) {
  for (const auto& [name, bytes] : AllSeeds()) {
    SCOPED_TRACE(name);
    ExpectSame(Read(bytes), torch::jit::pickle_load(bytes));
  }
  const FullStateDict model = fsdp2::DeserializeFullStateDict(FullStateDictSeeds()[0].second, "model.pt");
  EXPECT_EQ(model.size(), fsdp2::GetFullStateDict(*SharedTarget().model).size());
}

TEST(CorruptCheckpoint, FilesWrittenByPythonTorchSaveLoad) {
  const at::Tensor base = at::arange(24, at::kFloat).reshape({4, 6});
  for (const char* file : {"fuzz/testdata/python_dict.pt", "fuzz/testdata/python_no_crc.pt"}) {
    SCOPED_TRACE(file);
    const FullStateDict sd = fsdp2::DeserializeFullStateDict(FileBytes(file), file);
    ASSERT_EQ(sd.size(), 7u);
    EXPECT_TRUE(at::equal(sd["view"], base.slice(0, 1).slice(1, 2, 5)));
    EXPECT_EQ(sd["view"].storage_offset(), 8);
    EXPECT_TRUE(at::equal(sd["transposed"], base.t()));
    EXPECT_EQ(sd["long_scalar"].item<int64_t>(), 7);
    EXPECT_TRUE(at::equal(sd["bf16"], at::arange(5, at::kBFloat16)));
    EXPECT_TRUE(at::equal(sd["bool"], at::tensor({1, 0, 1}).to(at::kBool)));
    EXPECT_TRUE(at::allclose(sd["double"], at::linspace(0, 1, 4, at::kDouble)));
    EXPECT_EQ(sd["empty"].sizes(), (std::vector<int64_t>{0, 3}));
  }
  // model.state_dict(): an OrderedDict with _metadata attributes (dropped).
  const FullStateDict sd = fsdp2::DeserializeFullStateDict(FileBytes("fuzz/testdata/python_state_dict.pt"), "sd");
  ASSERT_EQ(sd.keys(), (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));
  EXPECT_TRUE(at::equal(sd["2.weight"], at::arange(2, at::kFloat).reshape({1, 2}) + 20));
}

TEST(CorruptCheckpoint, EveryTruncationIsAClearError) {
  for (const auto& [name, bytes] : AllSeeds()) {
    for (size_t n = 0; n < bytes.size(); ++n) {
      const std::vector<char> cut(bytes.begin(), bytes.begin() + n);
      EXPECT_ERROR_CONTAINS(fsdp2::DeserializeFullStateDict(cut, "'" + name + "'"),
                            "LoadFullStateDictFile: '" + name + "' is not a valid checkpoint: ");
    }
  }
}

// [offset, offset + size) of each record the reader reads (data.pkl, the storages), as
// LibTorch's zip reader finds them in a valid file.
std::vector<std::pair<size_t, size_t>> ReadRecords(const std::vector<char>& bytes) {
  caffe2::serialize::PyTorchStreamReader reader(
      std::make_shared<caffe2::serialize::MemoryReadAdapter>(bytes.data(), bytes.size()));
  std::vector<std::pair<size_t, size_t>> out;
  for (const std::string& name : reader.getAllRecords()) {
    if (name == "data.pkl" || absl::StartsWith(name, "data/")) {
      out.emplace_back(reader.getRecordOffset(name), reader.getRecordSize(name));
    }
  }
  return out;
}

// Flipping any one bit either fails with an error or changes nothing that is read (e.g. a
// timestamp or a record the reader does not use); flips inside data.pkl or a storage are
// always errors (CRC-32).
TEST(CorruptCheckpoint, EveryBitFlipIsAnErrorOrHarmless) {
  for (const auto& [name, bytes] : AllSeeds()) {
    SCOPED_TRACE(name);
    const c10::IValue good = Read(bytes);
    const auto records = ReadRecords(bytes);
    ASSERT_GE(records.size(), 1u);
    int errors = 0, harmless = 0;
    for (size_t i = 0; i < bytes.size(); ++i) {
      bool in_record = false;
      for (const auto& [offset, size] : records) in_record = in_record || (i >= offset && i < offset + size);
      std::vector<char> flipped = bytes;
      flipped[i] ^= static_cast<char>(1 << (i % 8));
      c10::IValue value;
      try {
        value = Read(flipped);
      } catch (const c10::Error& e) {
        ++errors;
        EXPECT_TRUE(absl::StrContains(e.what_without_backtrace(), "'test.pt' is not a valid checkpoint: "))
            << e.what_without_backtrace();
        continue;
      }
      ++harmless;
      EXPECT_FALSE(in_record) << "a flip at byte " << i << ", inside a record, went unnoticed";
      ExpectSame(value, good, absl::StrCat("flip at byte ", i));
    }
    std::printf("%s: %zu single-bit flips, %d errors, %d harmless\n", name.c_str(), bytes.size(), errors, harmless);
  }
  std::vector<char> file = FullStateDictSeeds()[1].second;  // mixed.pt: "view" is arange(24) floats
  const at::Tensor pattern = at::arange(24, at::kFloat);
  const std::string needle(static_cast<const char*>(pattern.data_ptr()), pattern.nbytes());
  const size_t at = std::string(file.begin(), file.end()).find(needle);
  ASSERT_NE(at, std::string::npos);
  file[at + 13] ^= 0x10;
  EXPECT_BAD_FILE(file, "bytes at offset " + std::to_string(at) + ") has CRC-32 ");
}

TEST(CorruptCheckpoint, CraftedTensorsAreCheckedAgainstTheirStorage) {
  const std::string six(24, '\0');
  EXPECT_NO_THROW(Read(TensorFile(Pickle().Tensor(6, 1, {2, 2}, {3, 1}), six)));  // elements 1..5
  EXPECT_BAD_FILE(
      TensorFile(Pickle().Tensor(100, 0, {100}, {1}), six),
      "storage '0' is declared as 100 Float elements (400 bytes) but its record 'archive/data/0' holds 24 bytes");
  EXPECT_BAD_FILE(TensorFile(Pickle().Tensor(6, 0, {4}, {2}), six),
                  "a tensor of size [4], stride [2] and storage offset 0 reaches element 6 of a storage of 6 elements");
  EXPECT_BAD_FILE(TensorFile(Pickle().Tensor(6, 7, {0}, {1}), six),
                  "a tensor's storage offset 7 is outside its storage of 6 elements");
  EXPECT_BAD_FILE(TensorFile(Pickle().Tensor(6, 5, {2}, {-1}), six),
                  "a tensor has size [2] and stride [-1] (negative)");
  EXPECT_BAD_FILE(TensorFile(Pickle().Tensor(6, 0, {1LL << 40, 1LL << 40}, {1, 1}), six),
                  "has more elements than int64 counts");
  EXPECT_BAD_FILE(TensorFile(Pickle().Tensor(6, 0, {2, 3}, {1}), six), "a tensor has size [2, 3] but stride [1]");
  EXPECT_BAD_FILE(TensorFile(Pickle().Tensor(int64_t{1} << 62, 0, {1}, {1}), six),
                  "storage '0' has 4611686018427387904 elements");
  EXPECT_BAD_FILE(TensorFile(Pickle().Tensor(3, 0, {3}, {1}, "BoolStorage"), std::string("\x01\x02\x00", 3)),
                  "bool storage '0' holds byte 2 at element 1");
  EXPECT_BAD_FILE(TensorFile(Pickle().Tensor(3, 0, {3}, {1}, "LongStorage", true), std::string(24, '\0')),
                  "a Long tensor is saved with requires_grad");
  EXPECT_BAD_FILE(TensorFile(Pickle().Tensor(6, 0, {6}, {1}, "QInt8Storage"), six),
                  "unsupported global 'torch.QInt8Storage'");
  EXPECT_BAD_FILE(Archive({{"data.pkl", Pickle().Op("}(").Str("w").Tensor(6, 0, {6}, {1}).Op("u").Done()}}),
                  "storage '0' has no record 'archive/data/0'");
}

TEST(CorruptCheckpoint, CraftedPicklesAreClearErrors) {
  // Each of these makes LibTorch's unpickler read out of bounds, allocate without bound,
  // recurse without bound or run arbitrary code paths; here each is an error.
  EXPECT_BAD_FILE(PickleFile(Pickle().Op("(").Str("a").Op("d")), "DICT of an odd number (1) of keys and values");
  EXPECT_BAD_FILE(PickleFile(Pickle().Op("}(").Str("a").Op("u")), "SETITEMS of an odd number (1)");
  EXPECT_BAD_FILE(PickleFile(Pickle().Op("}s")), "SETITEM with 1 values on the stack");
  EXPECT_BAD_FILE(PickleFile(Pickle().Op("t")), "opcode needs a MARK but there is none");
  EXPECT_BAD_FILE(PickleFile(Pickle().Op("R")), "opcode needs a value but the stack is empty");
  EXPECT_BAD_FILE(PickleFile(Pickle().Op("h\x05")), "BINGET of memo entry 5, which was never stored");
  EXPECT_TRUE(Read(PickleFile(Pickle().Op("Nr\xff\xff\xff\xff"))).isNone());  // a 2^32 memo id costs nothing
  EXPECT_BAD_FILE(PickleFile(Pickle().Global("os", "system").Op("(").Str("true").Op("tR")),
                  "unsupported global 'os.system'");
  EXPECT_BAD_FILE(PickleFile(Pickle().Global("torch._utils", "_rebuild_tensor_v2").Op(")R")),
                  "_rebuild_tensor_v2 takes 6 to 7 arguments, got 0");
  EXPECT_BAD_FILE(PickleFile(Pickle().Op("]q\0h\0a"s)), "the pickle puts a container into itself");
  EXPECT_BAD_FILE(PickleFile(Pickle().Op("]q\0]q\1h\0aa"s)), "modifies a container after putting it into another");
  Pickle deep;
  deep.Op(")");
  for (int i = 0; i < 100000; ++i) deep.Op("\x85");
  EXPECT_BAD_FILE(PickleFile(deep), "containers nest 65 deep, more than 64");
  EXPECT_BAD_FILE(PickleFile(Pickle().Op("NN")), "the pickle ends with 2 values and 0 marks");
  EXPECT_BAD_FILE(PickleFile(Pickle().Op("X\xff\xff\xff\x7f")),
                  "an operand of 2147483647 bytes runs past the end of data.pkl");
  EXPECT_BAD_FILE(Archive({{"data.pkl", "\x80\x04N."}}), "pickle protocol 4 (only 2");
  EXPECT_BAD_FILE(Archive({{"data.pkl", "\x80\x02N"}}), "data.pkl ends at byte 3 inside an opcode (truncated)");
  EXPECT_BAD_FILE(Archive({{"data.pkl", "\x80\x02\xff"}}), "unsupported pickle opcode 0xff");
  EXPECT_BAD_FILE(Archive({{"data.pkl", "\x80\x02N."}, {"byteorder", "big"}}), "written on a 'big' byte-order machine");
  EXPECT_BAD_FILE(Archive({{"model.pkl", "\x80\x02N."}}), "it has no record 'archive/data.pkl'");
}

TEST(CorruptCheckpoint, CraftedZipDirectoriesAreClearErrors) {
  const std::vector<char> good = TensorFile(Pickle().Tensor(6, 0, {6}, {1}), std::string(24, '\0'));
  ASSERT_NO_THROW(Read(good));
  auto patched = [&](size_t field, uint32_t value, size_t width = 4) {
    std::vector<char> f = good;
    PatchCentral(f, "archive/data/0", field, value, width);
    return f;
  };
  EXPECT_BAD_FILE(patched(20, 0x7fffffff), "is stored with 2147483647 bytes but lists 24 uncompressed");
  std::vector<char> huge = patched(20, 0x7fffffff);
  PatchCentral(huge, "archive/data/0", 24, 0x7fffffff, 4);
  EXPECT_BAD_FILE(huge, "record 'archive/data/0' (2147483647 bytes at offset");  // ... extends past the data area
  EXPECT_BAD_FILE(patched(10, 8, 2), "record 'archive/data/0' is compressed (method 8)");
  EXPECT_BAD_FILE(patched(8, 1, 2), "record 'archive/data/0' is encrypted");
  EXPECT_BAD_FILE(patched(42, 0x10000000), "record 'archive/data/0' has no local header at offset 268435456");
  EXPECT_BAD_FILE(patched(16, 0x12345678), "but the archive lists 305419896 (corrupted)");
  EXPECT_BAD_FILE(std::vector<char>(), "it has 0 bytes, fewer than the 22 of an empty zip archive");
  const std::string text = "garbage, not a checkpoint at all";
  EXPECT_BAD_FILE(std::vector<char>(text.begin(), text.end()), "no zip end-of-central-directory record at its end");
  std::vector<char> moved = good;  // the central directory's offset, in the zip64 end record if there is one
  const size_t locator = moved.size() - 22 - 20;
  if (std::memcmp(&moved[locator], "PK\x06\x07", 4) == 0) {
    uint64_t eocd64, far = uint64_t{1} << 40;
    std::memcpy(&eocd64, &moved[locator + 8], 8);
    std::memcpy(&moved[eocd64 + 48], &far, 8);
  } else {
    const uint32_t far = 0x7ffffff0;
    std::memcpy(&moved[moved.size() - 22 + 16], &far, 4);
  }
  EXPECT_BAD_FILE(moved, "its central directory (");
}

TEST(CorruptCheckpoint, LoadersNameTheFileAndTheValue) {
  const std::vector<char> model = FullStateDictSeeds()[0].second, adamw = OptimStateSeeds()[0].second;
  const std::string path = ::testing::TempDir() + "/truncated_model.pt";
  {
    std::ofstream out(path, std::ios::binary);
    out.write(model.data(), static_cast<std::streamsize>(model.size() / 2));
  }
  EXPECT_ERROR_CONTAINS(
      fsdp2::LoadFullStateDictFile(path),
      "LoadFullStateDictFile: '" + path + "' is not a valid checkpoint: no zip end-of-central-directory record");
  std::remove(path.c_str());
  EXPECT_ERROR_CONTAINS(fsdp2::DeserializeFullStateDict(adamw, "'o.pt'"),
                        "LoadFullStateDictFile: 'o.pt' holds a Tuple, not a str -> Tensor dict");
  EXPECT_ERROR_CONTAINS(optim_state::DeserializeOptimStateDict(model, "'m.pt'"),
                        "LoadOptimStateDict: 'm.pt' is not an optimizer state dict: expected a 3-tuple");
  std::vector<char> flipped = adamw;
  flipped[ReadRecords(adamw).front().first] ^= 4;
  EXPECT_ERROR_CONTAINS(optim_state::DeserializeOptimStateDict(flipped, "'o.pt'"),
                        "LoadOptimStateDict: 'o.pt' is not a valid checkpoint: ");

  // Options and scalar state that cannot be applied leave the optimizer as it was.
  Target& t = SharedTarget();
  const optim_state::OptimStateDict before =
      optim_state::GetOptimStateDict(*t.adamw, optim_state::NamedOptimizerParams(*t.model));
  optim_state::OptimStateDict sd = optim_state::DeserializeOptimStateDict(adamw, "'o.pt'");
  sd.param_groups[0].options.at("lr") = c10::IValue("fast");
  EXPECT_ERROR_CONTAINS(optim_state::LoadFullOptimStateDict(*t.model, *t.adamw, sd),
                        "param group option 'lr' is a String, not a float");
  sd.param_groups[0].options.erase("lr");
  EXPECT_ERROR_CONTAINS(optim_state::LoadFullOptimStateDict(*t.model, *t.adamw, sd),
                        "the optimizer state's param group has no option 'lr'");
  sd = optim_state::DeserializeOptimStateDict(adamw, "'o.pt'");
  sd.state.begin()->second.at("step") = int64_t{-3};
  EXPECT_ERROR_CONTAINS(optim_state::LoadFullOptimStateDict(*t.model, *t.adamw, sd), "' is -3 (negative)");
  const optim_state::OptimStateDict after =
      optim_state::GetOptimStateDict(*t.adamw, optim_state::NamedOptimizerParams(*t.model));
  ASSERT_EQ(after.state.size(), before.state.size());
  for (const auto& [fqn, values] : before.state) {
    EXPECT_EQ(std::get<int64_t>(after.state.at(fqn).at("step")), std::get<int64_t>(values.at("step"))) << fqn;
    EXPECT_TRUE(
        at::equal(std::get<at::Tensor>(after.state.at(fqn).at("exp_avg")), std::get<at::Tensor>(values.at("exp_avg"))));
  }
}

}  // namespace
}  // namespace fsdp::fuzz
