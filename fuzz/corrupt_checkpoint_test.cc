// Checkpoint files are input: truncated, bit-flipped and crafted files give a c10::Error
// naming the file and the bad value (never a crash), valid files read exactly as LibTorch's
// own reader reads them, and files Python's torch.save wrote load too. Safetensors files
// Python wrote: every truncation is an error, every bit flip an error or a change of only
// what it hits (the format has no checksum: see the last tests).
#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
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
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/safetensors.h"
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

// ------------------------------------------------------------------ safetensors files
// Files Python's safetensors 0.8 wrote (fuzz/testdata/make_testdata.py).
constexpr const char* kSafetensorsFiles[] = {"python.safetensors", "python_odd.safetensors"};

// What the reader gives for a file: metadata, entries and each tensor's bytes (Read).
struct SafetensorsContent {
  std::optional<checkpoint::SafetensorsMetadata> metadata;
  std::vector<checkpoint::SafetensorsEntry> entries;
  std::vector<std::string> bytes;
};

SafetensorsContent ReadSafetensors(const std::vector<char>& file, const std::string& name) {
  const checkpoint::SafetensorsReader reader(file.data(), file.size(), name);
  SafetensorsContent c{reader.metadata(), reader.entries(), {}};
  for (const auto& e : c.entries) {
    const at::Tensor t = reader.Read(e.name);
    c.bytes.emplace_back(static_cast<const char*>(t.const_data_ptr()), t.nbytes());
  }
  return c;
}

// Whether each byte of `header` (JSON) lies inside a string, between its quotes.
std::vector<bool> InsideJsonStrings(const std::string& header) {
  std::vector<bool> inside(header.size(), false);
  bool in = false;
  for (size_t i = 0; i < header.size(); ++i) {
    if (in && header[i] == '\\') {
      inside[i] = inside[i + 1] = true;
      ++i;
    } else if (header[i] == '"') {
      in = !in;
    } else {
      inside[i] = in;
    }
  }
  return inside;
}

TEST(CorruptCheckpoint, SafetensorsFilesWrittenByPythonRead) {
  const std::vector<char> file = FileBytes("fuzz/testdata/python.safetensors");
  const checkpoint::SafetensorsReader r(file.data(), file.size(), "python.safetensors");
  EXPECT_EQ(r.metadata(), (checkpoint::SafetensorsMetadata{{"format", "pt"}}));
  EXPECT_TRUE(at::equal(r.Read("weight"), at::arange(6, at::kFloat).reshape({2, 3})));
  EXPECT_TRUE(at::equal(r.Read("bf16"), at::arange(4, at::kBFloat16) - 1.5));
  EXPECT_EQ(r.Read("step").dim(), 0);
  EXPECT_EQ(r.Read("step").item<int64_t>(), 7);
  EXPECT_TRUE(at::equal(r.Read("mask"), at::tensor({1, 0, 1}).to(at::kBool)));
  EXPECT_EQ(r.Read("empty").sizes(), (std::vector<int64_t>{0, 2}));
  EXPECT_TRUE(at::equal(r.Read("bytes"), at::arange(5, at::kByte)));
  const std::vector<char> odd = FileBytes("fuzz/testdata/python_odd.safetensors");
  const checkpoint::SafetensorsReader o(odd.data(), odd.size(), "python_odd.safetensors");
  EXPECT_EQ(o.metadata(), (checkpoint::SafetensorsMetadata{{"a", "1"}, {"b", "\u00e9\n"}}));
  EXPECT_TRUE(at::equal(o.Read("caf\u00e9 \"q\"\\\n"), at::arange(3, at::kShort)));
  EXPECT_TRUE(at::equal(o.Read("f8").to(at::kFloat), at::arange(4, at::kFloat)));
  EXPECT_EQ(o.Read("e").sizes(), (std::vector<int64_t>{2, 0}));
}

// A cut anywhere is an error naming the file; once the header is whole, naming the first
// tensor (in the header) that the cut reaches.
TEST(CorruptCheckpoint, EverySafetensorsTruncationIsAClearError) {
  for (const char* name : kSafetensorsFiles) {
    const std::vector<char> bytes = FileBytes(std::string("fuzz/testdata/") + name);
    const SafetensorsContent good = ReadSafetensors(bytes, name);
    const int64_t data_offset = checkpoint::SafetensorsReader(bytes.data(), bytes.size(), name).data_offset();
    for (size_t n = 0; n < bytes.size(); ++n) {
      const std::vector<char> cut(bytes.begin(), bytes.begin() + n);
      std::string expected = std::string("SafetensorsReader: '") + name + "' is not a valid safetensors file: ";
      if (static_cast<int64_t>(n) >= data_offset) {
        for (const auto& e : good.entries) {
          if (e.end > static_cast<int64_t>(n) - data_offset) {
            expected += "tensor '" + e.name + "' has data_offsets [";
            break;
          }
        }
      }
      EXPECT_ERROR_CONTAINS(ReadSafetensors(cut, name), expected);
      EXPECT_ERROR_CONTAINS(ReadSafetensors(cut, name), "(truncated?)");
    }
  }
}

// Safetensors has no checksum: a flipped bit of tensor data is a different value that no
// reader can notice. So each flip is an error naming the file, or changes only what it hits:
// in the data section, the bytes of the one tensor holding it (a BOOL byte must stay 0 or 1:
// else an error naming the tensor); in the header, only a name or metadata string holding it,
// or a dimension of an empty tensor ([0, 2] -> [0, 0]: no byte of the file counts it). No
// flip changes a dtype, where a tensor's bytes are, or the shape of a tensor with elements.
TEST(CorruptCheckpoint, EverySafetensorsBitFlipIsAnErrorOrChangesOnlyWhatItHits) {
  for (const char* name : kSafetensorsFiles) {
    SCOPED_TRACE(name);
    const std::vector<char> bytes = FileBytes(std::string("fuzz/testdata/") + name);
    const SafetensorsContent good = ReadSafetensors(bytes, name);
    const checkpoint::SafetensorsReader reader(bytes.data(), bytes.size(), name);
    const size_t data_offset = static_cast<size_t>(reader.data_offset());
    const std::vector<bool> in_string = InsideJsonStrings(std::string(bytes.data() + 8, data_offset - 8));
    int errors = 0, strings = 0, values = 0, reshaped = 0;
    for (size_t i = 0; i < bytes.size(); ++i) {
      std::vector<char> flipped = bytes;
      flipped[i] ^= static_cast<char>(1 << (i % 8));
      const std::string at = absl::StrCat("flip at byte ", i);
      // The tensor whose bytes hold byte i, if any.
      const checkpoint::SafetensorsEntry* hit = nullptr;
      for (const auto& e : good.entries) {
        if (i >= data_offset + e.begin && i < data_offset + e.end) hit = &e;
      }
      SafetensorsContent got;
      try {
        got = ReadSafetensors(flipped, name);
      } catch (const c10::Error& e) {
        ++errors;
        const std::string message = e.what_without_backtrace();
        EXPECT_TRUE(absl::StrContains(message, std::string("'") + name + "' is not a valid safetensors file: "))
            << at << ": " << message;
        if (hit != nullptr) {  // only a BOOL byte can be wrong in the data section
          EXPECT_TRUE(absl::StrContains(message, "BOOL tensor '" + hit->name + "'")) << at;
        }
        continue;
      }
      ASSERT_EQ(got.entries.size(), good.entries.size()) << at;
      for (size_t k = 0; k < good.entries.size(); ++k) {
        const auto &g = got.entries[k], &w = good.entries[k];
        EXPECT_EQ(g.dtype, w.dtype) << at;
        if (g.shape != w.shape) {  // only an empty tensor's: no byte counts its dimensions
          EXPECT_TRUE(w.begin == w.end && i < data_offset) << at << " reshaped '" << w.name << "'";
          EXPECT_EQ(c10::multiply_integers(g.shape), 0) << at;
          ++reshaped;
        }
        EXPECT_EQ(g.begin, w.begin) << at;
        EXPECT_EQ(g.end, w.end) << at;
        std::string want = good.bytes[k];
        if (hit == &w) want[i - data_offset - w.begin] ^= static_cast<char>(1 << (i % 8));
        EXPECT_EQ(got.bytes[k], want) << at << ", tensor " << w.name;
        if (g.name != w.name) {
          EXPECT_TRUE(i >= 8 && i < data_offset && in_string[i - 8]) << at << " renamed '" << w.name << "'";
          ++strings;
        }
      }
      if (got.metadata != good.metadata) {
        EXPECT_TRUE(i >= 8 && i < data_offset && in_string[i - 8]) << at << " changed the metadata";
        ++strings;
      }
      if (i >= data_offset) ++values;
    }
    std::printf("%s: %zu single-bit flips, %d errors, %d in strings, %d in tensor data, %d reshape an empty tensor\n",
                name, bytes.size(), errors, strings, values, reshaped);
  }
}

}  // namespace
}  // namespace fsdp::fuzz
