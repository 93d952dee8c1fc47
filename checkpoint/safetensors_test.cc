// //checkpoint safetensors files (safetensors.h): every dtype round-trips, with empty and 0-d
// tensors and metadata; the header is byte for byte Python's; rows, bytes and converted reads
// equal slices of the tensor and read only what they need; the writer's and the reader's
// misuse errors name the file and the tensor; and, with the peer Python (FSDP_PEER_PYTHON),
// files Python's safetensors wrote read here and files written here load in Python and are
// the bytes save_file writes. The checks of crafted files are in safetensors_validation_test.cc.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/file_io.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_dict_file.h"
#include "testing/expect_error.h"
#include "testing/peer_python.h"
#include "testing/test_dir.h"

namespace fsdp::checkpoint::safetensors_test {
namespace {

using fsdp::testing::NewTestPath;

struct Spec {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

const std::string kOddName = "odd \"name\"\\ \u00e9\U0001F600 \x01\n";

// The same list as testdata/safetensors_interop.py's SPECS.
std::vector<Spec> Specs() {
  using T = at::ScalarType;
  return {
      {"f64", T::Double, {2, 3}},
      {"f32", T::Float, {4, 5}},
      {"f16", T::Half, {3, 2}},
      {"bf16", T::BFloat16, {7}},
      {"i64", T::Long, {2, 2}},
      {"i32", T::Int, {5}},
      {"i16", T::Short, {3}},
      {"i8", T::Char, {4}},
      {"u8", T::Byte, {6}},
      {"bool", T::Bool, {2, 2, 2}},
      {"u16", T::UInt16, {3}},
      {"u32", T::UInt32, {3}},
      {"u64", T::UInt64, {2}},
      {"f8_e4m3", T::Float8_e4m3fn, {5}},
      {"f8_e5m2", T::Float8_e5m2, {5}},
      {"f8_e4m3fnuz", T::Float8_e4m3fnuz, {4}},
      {"f8_e5m2fnuz", T::Float8_e5m2fnuz, {4}},
      {"f8_e8m0", T::Float8_e8m0fnu, {6}},
      {"c64", T::ComplexFloat, {3}},
      {"empty", T::Float, {0, 3}},
      {"empty_i64", T::Long, {2, 0}},
      {"scalar", T::Double, {}},
      {"scalar_i8", T::Char, {}},
      {"model.layers.0.weight", T::Float, {3, 4}},
      {kOddName, T::Half, {2}},
  };
}

// testdata/safetensors_interop.py's pattern(): small integers and halves, exact in every dtype.
at::Tensor Pattern(at::ScalarType dtype, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  const at::Tensor i = at::arange(n, at::kLong);
  const at::Tensor centered = i.remainder(13) - 6;
  at::Tensor v;
  switch (dtype) {
    case at::ScalarType::Bool: v = i.remainder(3) == 1; break;
    case at::ScalarType::Long: v = centered * int64_t{1000000007000}; break;
    case at::ScalarType::Int: v = centered * 100000000; break;
    case at::ScalarType::Short: v = centered * 2000; break;
    case at::ScalarType::Char: v = centered * 10; break;
    case at::ScalarType::Byte: v = i.remainder(13) * 19; break;
    case at::ScalarType::UInt16: v = i.remainder(13) * 5000; break;
    case at::ScalarType::UInt32: v = i.remainder(13) * 300000000; break;
    case at::ScalarType::UInt64: v = i.remainder(13) * int64_t{1000000007000000}; break;
    case at::ScalarType::Float8_e8m0fnu: v = at::pow(2.0, (i.remainder(7) - 3).to(at::kDouble)); break;
    case at::ScalarType::ComplexFloat:
      v = at::complex((centered * 0.5).to(at::kFloat), (i.remainder(5) * 0.25).to(at::kFloat));
      break;
    default: v = centered.to(at::kDouble) * 0.5;
  }
  return v.to(dtype).reshape(shape);
}

TensorDict TestTensors() {
  TensorDict dict;
  for (const Spec& s : Specs()) dict.insert(s.name, Pattern(s.dtype, s.shape));
  return dict;
}

std::string Bytes(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return c.nbytes() == 0 ? std::string() : std::string(static_cast<const char*>(c.const_data_ptr()), c.nbytes());
}

// Same dtype, sizes and bytes (bitwise: float8 has no at::equal, and NaN would not equal).
void ExpectSameTensor(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  EXPECT_EQ(got.scalar_type(), want.scalar_type()) << what;
  EXPECT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_EQ(Bytes(got), Bytes(want)) << what;
}

std::string Header(const std::vector<char>& file) {
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  return std::string(file.data() + 8, n);
}

TEST(Safetensors, EveryDtypeRoundTripsWithEmptyAndZeroDimTensors) {
  const std::string path = NewTestPath("all") + ".safetensors";
  const TensorDict tensors = TestTensors();
  SaveSafetensors(path, tensors, SafetensorsMetadata{{"format", "pt"}});
  const SafetensorsReader reader(path);
  ASSERT_EQ(reader.entries().size(), tensors.size());
  EXPECT_EQ(reader.data_offset() % 8, 0);
  ASSERT_TRUE(reader.metadata().has_value());
  EXPECT_EQ(*reader.metadata(), (SafetensorsMetadata{{"format", "pt"}}));
  for (const auto& item : tensors) {
    const SafetensorsEntry& e = reader.Entry(item.key());
    EXPECT_EQ(e.dtype, item.value().scalar_type()) << item.key();
    EXPECT_EQ(e.shape, item.value().sizes().vec()) << item.key();
    EXPECT_EQ(e.begin % static_cast<int64_t>(item.value().element_size()), 0) << item.key() << " is not aligned";
    ExpectSameTensor(reader.Read(item.key()), item.value(), item.key());
    const char* name = SafetensorsDtypeName(e.dtype);
    ASSERT_NE(name, nullptr);
    EXPECT_EQ(SafetensorsScalarType(name).value_or(at::ScalarType::Undefined), e.dtype);
  }
  for (size_t i = 1; i < reader.entries().size(); ++i) {  // the header lists tensors in file order
    EXPECT_EQ(reader.entries()[i].begin, reader.entries()[i - 1].end);
  }
  const TensorDict loaded = LoadSafetensors(path);
  ASSERT_EQ(loaded.size(), tensors.size());
  EXPECT_EQ(loaded.keys().front(), reader.entries().front().name);
  for (const auto& item : tensors) ExpectSameTensor(loaded[item.key()], item.value(), item.key());
  EXPECT_FALSE(SafetensorsScalarType("F4").has_value());
  EXPECT_FALSE(SafetensorsScalarType("F6_E2M3").has_value());
  EXPECT_FALSE(SafetensorsScalarType("f32").has_value());
  EXPECT_EQ(SafetensorsDtypeName(at::kComplexDouble), nullptr);
}

// The header of safetensors 0.8's save_file for these tensors (printed by Python): tensors by
// dtype, larger elements first, then by name, bytewise; serde_json's escapes; space padding.
TEST(Safetensors, HeaderIsTheOnePythonWrites) {
  TensorDict t;
  t.insert("b", at::zeros({2}));
  t.insert("a", at::zeros({1}));
  t.insert("i", at::zeros({1}, at::kLong));
  t.insert("flag", at::zeros({1}, at::kBool));
  t.insert("h", at::zeros({3}, at::kHalf));
  t.insert("B", at::zeros({0, 2}));
  t.insert("q\"\\\x1f\u00e9", at::zeros({}));
  const std::vector<char> file = SerializeSafetensors(t, SafetensorsMetadata{{"format", "pt"}});
  const std::string python =
      R"({"__metadata__":{"format":"pt"},"i":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},)"
      R"("B":{"dtype":"F32","shape":[0,2],"data_offsets":[8,8]},"a":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},)"
      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]},)"
      "\"q\\\"\\\\\\u001f\u00e9\""
      R"(:{"dtype":"F32","shape":[],"data_offsets":[20,24]},"h":{"dtype":"F16","shape":[3],"data_offsets":[24,30]},)"
      R"("flag":{"dtype":"BOOL","shape":[1],"data_offsets":[30,31]}}   )";
  ASSERT_EQ(python.size(), 432u);
  EXPECT_EQ(Header(file), python);
  EXPECT_EQ(file.size(), 8 + 432 + 31u);
  EXPECT_EQ(std::string(file.data(), 8), std::string("\xb0\x01\0\0\0\0\0\0", 8));
}

TEST(Safetensors, MetadataIsOptional) {
  TensorDict t;
  t.insert("w", at::ones({2}));
  EXPECT_EQ(Header(SerializeSafetensors(t)), R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}  )");
  EXPECT_EQ(Header(SerializeSafetensors(t, SafetensorsMetadata{})),
            R"({"__metadata__":{},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})");
  // Python writes `{},"__metadata__":{}}` for no tensors and metadata={} (a header its own reader
  // refuses); this is the valid header of that content.
  EXPECT_EQ(Header(SerializeSafetensors(TensorDict(), SafetensorsMetadata{})), R"({"__metadata__":{}}     )");
  EXPECT_EQ(Header(SerializeSafetensors(TensorDict())), "{}      ");
  const SafetensorsMetadata several = {{"b", "1"}, {"a", "\u00e9\n"}, {"", ""}};
  const std::vector<char> file = SerializeSafetensors(t, several);
  EXPECT_TRUE(absl::StartsWith(Header(file), R"({"__metadata__":{"":"","a":"é\n","b":"1"},"w")")) << Header(file);
  const SafetensorsReader with(file.data(), file.size(), "with");
  EXPECT_EQ(with.metadata(), several);
  const std::vector<char> none = SerializeSafetensors(t);
  EXPECT_FALSE(SafetensorsReader(none.data(), none.size(), "none").metadata().has_value());
}

TEST(Safetensors, RowsAndBytesReadAsSlicesOfTheTensor) {
  TensorDict t;
  t.insert("w", Pattern(at::kFloat, {5, 3}));
  t.insert("b", Pattern(at::kBFloat16, {4, 2, 3}));
  t.insert("v", Pattern(at::kLong, {6}));
  t.insert("flags", Pattern(at::kBool, {7, 2}));
  t.insert("no_columns", at::empty({3, 0}));
  t.insert("no_rows", at::empty({0, 4}));
  const std::string path = NewTestPath("rows") + ".safetensors";
  SaveSafetensors(path, t);
  const SafetensorsReader reader(path);
  for (const auto& item : t) {
    const at::Tensor& full = item.value();
    for (int64_t b = 0; b <= full.size(0); ++b) {
      for (int64_t e = b; e <= full.size(0); ++e) {
        const std::string what = absl::StrCat(item.key(), " rows [", b, ", ", e, ")");
        const at::Tensor want = full.narrow(0, b, e - b);
        ExpectSameTensor(reader.ReadRows(item.key(), b, e), want, what);
        at::Tensor dest = at::full(want.sizes(), 7, at::kDouble);  // converted on the way
        reader.ReadRowsInto(item.key(), b, e, dest);
        EXPECT_TRUE(at::equal(dest, want.to(at::kDouble))) << what;
        at::Tensor same = at::full(want.sizes(), 7, want.options());  // straight into it
        reader.ReadRowsInto(item.key(), b, e, same);
        ExpectSameTensor(same, want, what);
      }
    }
  }
  const std::string w = Bytes(t["w"]);
  std::string part(16, '\0');
  reader.ReadBytes("w", 4, 20, part.data());
  EXPECT_EQ(part, w.substr(4, 16));
  reader.ReadBytes("w", 60, 60, nullptr);
}

TEST(Safetensors, ReadIntoConvertsAnyDtypeLayoutAndSize) {
  TensorDict t;
  t.insert("big", Pattern(at::kBFloat16, {4096, 1100}));        // several blocks when converted
  t.insert("long_rows", Pattern(at::kBFloat16, {2, 2200000}));  // a row larger than a block
  t.insert("w", Pattern(at::kFloat, {5, 3}));
  t.insert("i", Pattern(at::kInt, {4}));
  t.insert("s", Pattern(at::kDouble, {}));
  const std::string path = NewTestPath("into") + ".safetensors";
  SaveSafetensors(path, t);
  const SafetensorsReader reader(path);
  for (const char* name : {"big", "long_rows"}) {
    at::Tensor f32 = at::empty(t[name].sizes(), at::kFloat);
    reader.ReadInto(name, f32);
    EXPECT_TRUE(at::equal(f32, t[name].to(at::kFloat))) << name;
  }
  at::Tensor transposed = at::zeros({3, 5}).t();  // same dtype, not contiguous
  reader.ReadInto("w", transposed);
  EXPECT_TRUE(at::equal(transposed, t["w"]));
  at::Tensor as_float = at::zeros({4});
  reader.ReadInto("i", as_float);
  EXPECT_TRUE(at::equal(as_float, t["i"].to(at::kFloat)));
  at::Tensor scalar = at::zeros({}, at::kFloat);
  reader.ReadInto("s", scalar);
  EXPECT_EQ(scalar.item<float>(), static_cast<float>(t["s"].item<double>()));
  at::Tensor rows = at::zeros({3, 2}, at::kDouble).t();
  reader.ReadRowsInto("w", 3, 5, rows);
  EXPECT_TRUE(at::equal(rows, t["w"].narrow(0, 3, 2).to(at::kDouble)));
}

// The reader reads only the header when opened and only the bytes asked for after: with the
// file cut after the first tensor, that tensor still reads and the next one is an error.
TEST(Safetensors, OnlyTheBytesAskedForAreRead) {
  TensorDict t;
  t.insert("a", Pattern(at::kFloat, {4, 256}));
  t.insert("z", Pattern(at::kFloat, {4, 256}));
  const std::string path = NewTestPath("cut") + ".safetensors";
  SaveSafetensors(path, t);
  const SafetensorsReader reader(path);
  ASSERT_EQ(::truncate(path.c_str(), reader.data_offset() + reader.Entry("a").end), 0);
  ExpectSameTensor(reader.Read("a"), t["a"], "a");
  ExpectSameTensor(reader.ReadRows("a", 1, 3), t["a"].narrow(0, 1, 2), "a rows");
  EXPECT_ERROR_CONTAINS(reader.ReadRows("z", 1, 2), "SafetensorsReader::ReadRows: reading bytes [");
  EXPECT_ERROR_CONTAINS(reader.Read("z"), "of '" + path +
                                              "' failed after 0 bytes (end of file: truncated?) "
                                              "(reading tensor 'z')");
}

TEST(Safetensors, WriterCopiesTensorsThatAreNotContiguous) {
  const at::Tensor base = at::arange(24, at::kFloat).reshape({4, 6});
  const at::Tensor c = at::complex(at::arange(4, at::kFloat), at::ones({4}));
  TensorDict t;
  t.insert("transposed", base.t());
  t.insert("view", base.narrow(1, 2, 3));
  t.insert("conj", c.conj());
  t.insert("grad", at::ones({2}).requires_grad_());
  const std::vector<char> file = SerializeSafetensors(t);
  const SafetensorsReader reader(file.data(), file.size(), "views");
  ExpectSameTensor(reader.Read("transposed"), base.t().contiguous(), "transposed");
  ExpectSameTensor(reader.Read("view"), base.narrow(1, 2, 3).contiguous(), "view");
  ExpectSameTensor(reader.Read("conj"), c.conj().resolve_conj(), "conj");
  ExpectSameTensor(reader.Read("grad"), at::ones({2}), "grad");
}

TEST(Safetensors, WriterErrorsNameTheTensorAndLeaveTheOldFile) {
  const std::string dir = NewTestPath("writer");
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/model.safetensors";
  TensorDict good;
  good.insert("w", at::ones({2}));
  SaveSafetensors(path, good);
  const std::vector<char> before = ReadFile(path, "test");
  auto save = [&](const std::string& name, const at::Tensor& tensor, const SafetensorsMetadata& metadata = {}) {
    TensorDict t;
    t.insert("ok", at::ones({3}));
    t.insert(name, tensor);
    SaveSafetensors(path, t, metadata);
  };
  EXPECT_ERROR_CONTAINS(save("__metadata__", at::ones({1})),
                        "SaveSafetensors: a tensor may not be named '__metadata__'");
  EXPECT_ERROR_CONTAINS(save("z", at::ones({2}, at::kComplexDouble)),
                        "SaveSafetensors: tensor 'z' has dtype ComplexDouble, which safetensors has no dtype for");
  EXPECT_ERROR_CONTAINS(save("s", at::ones({2, 2}).to_sparse()), "SaveSafetensors: tensor 's' has layout Sparse");
  EXPECT_ERROR_CONTAINS(save("u", at::Tensor()), "SaveSafetensors: tensor 'u' is an undefined tensor");
  EXPECT_ERROR_CONTAINS(save("m", at::ones({2}, at::Device(at::kMeta))),
                        "SaveSafetensors: tensor 'm' is on the meta device");
  EXPECT_ERROR_CONTAINS(save("bad\xff", at::ones({1})),
                        "SaveSafetensors: the tensor name 'bad\xff' is not valid UTF-8 (at byte 3)");
  EXPECT_ERROR_CONTAINS(save("w", at::ones({1}), {{"k", "\xc0\x80"}}),
                        "SaveSafetensors: the value of metadata key 'k' '\xc0\x80' is not valid UTF-8 (at byte 0)");
  EXPECT_EQ(ReadFile(path, "test"), before);
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) files.push_back(entry.path().filename());
  EXPECT_EQ(files, std::vector<std::string>{"model.safetensors"});  // no temporary file left
  EXPECT_ERROR_CONTAINS(SaveSafetensors(dir + "/no/such/dir/x.safetensors", good),
                        "SaveSafetensors: cannot create '" + dir + "/no/such/dir/x.safetensors.tmp.");
}

TEST(Safetensors, ReaderMisuseIsAClearError) {
  TensorDict t;
  t.insert("w", Pattern(at::kFloat, {5, 3}));
  t.insert("s", Pattern(at::kDouble, {}));
  const std::string path = NewTestPath("misuse") + ".safetensors";
  SaveSafetensors(path, t);
  const SafetensorsReader reader(path);
  EXPECT_EQ(reader.Find("nope"), nullptr);
  EXPECT_ERROR_CONTAINS(reader.Read("nope"),
                        "SafetensorsReader: '" + path + "' has no tensor 'nope' (it has 2: 's', 'w')");
  EXPECT_ERROR_CONTAINS(reader.ReadRows("w", 2, 9), "SafetensorsReader::ReadRows: rows [2, 9) of tensor 'w' in '" +
                                                        path + "' are not rows of its 5");
  EXPECT_ERROR_CONTAINS(reader.ReadRows("w", 3, 2), "rows [3, 2) of tensor 'w'");
  EXPECT_ERROR_CONTAINS(reader.ReadRows("s", 0, 0), "tensor 's' in '" + path + "' is 0-d: it has no rows");
  EXPECT_ERROR_CONTAINS(reader.ReadRowsInto("w", 0, 2, at::empty({3, 3})),
                        "SafetensorsReader::ReadRowsInto: the destination of rows [0, 2) of tensor 'w' in '" + path +
                            "' has size [3, 3], not [2, 3]");
  EXPECT_ERROR_CONTAINS(reader.ReadInto("w", at::Tensor()),
                        "SafetensorsReader::ReadInto: the destination of tensor 'w' is an undefined tensor");
  EXPECT_ERROR_CONTAINS(reader.ReadInto("s", at::empty({1})), "the destination of tensor 's' (0-d) in '");
  char buffer[8];
  EXPECT_ERROR_CONTAINS(reader.ReadBytes("w", 56, 64, buffer),
                        "SafetensorsReader::ReadBytes: bytes [56, 64) of "
                        "tensor 'w' in '" +
                            path + "' are not inside its 60 bytes");
  EXPECT_ERROR_CONTAINS((void)SafetensorsReader(path + ".missing"),
                        "SafetensorsReader: cannot open '" + path + ".missing' for reading (");
  EXPECT_ERROR_CONTAINS((void)SafetensorsReader(::testing::TempDir()), "' is not a regular file");
}

// ------------------------------------------------------------------ interop with Python
using fsdp::testing::PeerPython;
using fsdp::testing::RunCommand;

constexpr char kScript[] = "checkpoint/testdata/safetensors_interop.py";

TensorDict MetaTensors() {
  TensorDict t;
  t.insert("w", Pattern(at::kBFloat16, {3, 2}));
  t.insert("b", Pattern(at::kInt, {4}));
  return t;
}
const SafetensorsMetadata kMeta = {{"format", "pt"}, {"source", "libtorch-fsdp"}, {"note", "caf\u00e9 \"quoted\""}};

TEST(SafetensorsInterop, FilesPythonWroteReadHere) {
  std::string why_not;
  const std::string python = PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << why_not;
  const std::string dir = NewTestPath("py_wrote");
  std::filesystem::create_directories(dir);
  std::string output;
  ASSERT_EQ(RunCommand(absl::StrCat(python, " ", kScript, " write ", dir), &output), 0) << output;
  ASSERT_TRUE(absl::StrContains(output, "WROTE")) << output;

  const std::string path = dir + "/python.safetensors";
  const SafetensorsReader reader(path);
  EXPECT_EQ(reader.metadata(), (SafetensorsMetadata{{"format", "pt"}}));
  const TensorDict want = TestTensors();
  ASSERT_EQ(reader.entries().size(), want.size());
  for (const auto& item : want) {
    ASSERT_NE(reader.Find(item.key()), nullptr) << item.key();
    ExpectSameTensor(reader.Read(item.key()), item.value(), item.key());
  }
  // Our writer writes the same bytes for the same tensors.
  EXPECT_EQ(SerializeSafetensors(want, SafetensorsMetadata{{"format", "pt"}}), ReadFile(path, "test"));

  const SafetensorsReader meta(dir + "/python_meta.safetensors");
  EXPECT_EQ(meta.metadata(), kMeta);
  for (const auto& item : MetaTensors()) ExpectSameTensor(meta.Read(item.key()), item.value(), item.key());
}

TEST(SafetensorsInterop, FilesWrittenHereLoadInPythonAndAreItsBytes) {
  std::string why_not;
  const std::string python = PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << why_not;
  const std::string dir = NewTestPath("cpp_wrote");
  std::filesystem::create_directories(dir);
  SaveSafetensors(dir + "/cpp.safetensors", TestTensors(), SafetensorsMetadata{{"format", "pt"}});
  SaveSafetensors(dir + "/cpp_meta.safetensors", MetaTensors(), kMeta);
  std::string output;
  EXPECT_EQ(RunCommand(absl::StrCat(python, " ", kScript, " check ", dir), &output), 0) << output;
  EXPECT_TRUE(absl::StrContains(output, "IDENTICAL")) << output;
}

}  // namespace
}  // namespace fsdp::checkpoint::safetensors_test
