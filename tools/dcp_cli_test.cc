// //tools:dcp_cli_test: the dcp tool, run in process through dcp_cli::Run. from-torch then
// to-torch gives the state dict back as DCP nests it; ls lists chunks where the metadata puts
// them; bad input is one clear error line and a non-zero status; and, with the peer PyTorch
// (FSDP_PEER_PYTHON; skipped without it), to-torch of a checkpoint Python's dcp.save wrote (from
// one process, and DTensor-sharded from two) equals Python's own dcp_to_torch_save and loads
// with torch.load's default weights_only=True, and from-torch writes what dcp.load and
// torch_save_to_dcp agree with. from-hf then to-hf gives a Hugging Face directory's tensors
// back bitwise (to-hf --dtype bf16: tensor.to(bfloat16)), streamed in bounded memory.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/dcp_metadata.h"
#include "checkpoint/dcp_storage.h"
#include "checkpoint/file_io.h"
#include "checkpoint/hf_checkpoint.h"
#include "checkpoint/safetensors.h"
#include "testing/allocation_counter.h"
#include "testing/peer_python.h"
#include "tools/dcp_cli_lib.h"

namespace dcp_cli {
namespace {

using fsdp::checkpoint::DcpBytesItem;
using fsdp::checkpoint::DcpFragment;
using fsdp::checkpoint::DcpMetadata;
using fsdp::checkpoint::DcpPathElement;
using fsdp::checkpoint::DcpTensorItem;
using fsdp::checkpoint::ReadFile;
using fsdp::checkpoint::ReadMetadata;
using fsdp::checkpoint::WriteCheckpoint;
using fsdp::checkpoint::WriteMetadata;
using fsdp::checkpoint::WriteRankData;
using PyDict = c10::impl::GenericDict;
using PyList = c10::impl::GenericList;

std::string NewPath(const std::string& name) {
  static int counter = 0;
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/", name, "_", getpid(), "_", counter++);
}

bool Exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
  std::fclose(f);
}

// The tool's status, stdout and stderr.
struct Result {
  int status;
  std::string out, err;
};
Result Dcp(const std::vector<std::string>& args) {
  std::ostringstream out, err;
  const int status = Run(args, out, err);
  return {status, out.str(), err.str()};
}

// A failed run: `status`, nothing but one "dcp: error: ..." line on stderr, containing `what`.
void ExpectError(const std::vector<std::string>& args, int status, const std::string& what) {
  const Result r = Dcp(args);
  EXPECT_EQ(r.status, status) << args[0] << ": " << r.err;
  EXPECT_TRUE(absl::StartsWith(r.err, "dcp: error: ")) << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "not one line: " << r.err;
  EXPECT_TRUE(absl::StrContains(r.err, what)) << "message: " << r.err << "expected: " << what;
}

PyDict NewDict() { return PyDict(c10::AnyType::get(), c10::AnyType::get()); }
PyList NewList(std::vector<c10::IValue> items) {
  PyList list(c10::AnyType::get());
  for (auto& v : items) list.push_back(std::move(v));
  return list;
}

// `got` and `want` are the same value: the same kinds, dict keys in the same order, floats and
// tensors bit for bit.
void ExpectSameValue(const c10::IValue& got, const c10::IValue& want, const std::string& where) {
  ASSERT_EQ(got.tagKind(), want.tagKind()) << where;
  if (want.isTensor()) {
    const at::Tensor g = got.toTensor().contiguous(), w = want.toTensor().contiguous();
    ASSERT_EQ(g.scalar_type(), w.scalar_type()) << where;
    ASSERT_EQ(g.sizes(), w.sizes()) << where;
    // memcmp of empty tensors would pass null pointers (undefined, UBSan's complaint).
    if (w.nbytes() > 0) {
      EXPECT_EQ(std::memcmp(g.const_data_ptr(), w.const_data_ptr(), w.nbytes()), 0)
          << where << ": " << g << " vs " << w;
    }
  } else if (want.isDouble()) {
    const double g = got.toDouble(), w = want.toDouble();
    EXPECT_EQ(std::memcmp(&g, &w, sizeof(double)), 0) << where << ": " << g << " vs " << w;
  } else if (want.isTuple() || want.isList()) {
    const auto g = want.isTuple() ? got.toTupleRef().elements().vec() : got.toListRef().vec();
    const auto w = want.isTuple() ? want.toTupleRef().elements().vec() : want.toListRef().vec();
    ASSERT_EQ(g.size(), w.size()) << where;
    for (size_t i = 0; i < w.size(); ++i) ExpectSameValue(g[i], w[i], absl::StrCat(where, "[", i, "]"));
  } else if (want.isGenericDict()) {
    const PyDict g = got.toGenericDict(), w = want.toGenericDict();
    ASSERT_EQ(g.size(), w.size()) << where;
    auto gi = g.begin();
    for (auto wi = w.begin(); wi != w.end(); ++wi, ++gi) {
      const std::string key = absl::StrCat(where, "[", wi->key().isString() ? wi->key().toStringRef() : "?", "]");
      ASSERT_EQ(gi->key(), wi->key()) << key;
      ExpectSameValue(gi->value(), wi->value(), key);
    }
  } else {
    EXPECT_EQ(got, want) << where;
  }
}

c10::IValue Load(const std::string& path) {
  const std::vector<char> bytes = ReadFile(path, "test");
  return fsdp::checkpoint::ReadCheckpoint(bytes.data(), bytes.size(), path);
}

std::vector<DcpPathElement> Path(std::vector<DcpPathElement> p) { return p; }

TEST(DcpCli, FromTorchThenToTorchGivesTheStateDictBackNestedAsDcpDoes) {
  const at::Tensor w = at::randn({4, 3}), b = at::randn({4}).to(at::kBFloat16), e = at::arange(10, at::kLong);
  const at::Tensor step = at::scalar_tensor(3.0), avg = at::randn({4, 3}), ones = at::ones({2}, at::kHalf);
  const at::Tensor special = at::tensor({NAN, INFINITY, -0.0, 1.5}),
                   flags = at::tensor({1, 0, 1}, at::kByte).to(at::kBool);
  const at::Tensor cplx = at::randn({2}, at::kComplexFloat), empty = at::zeros({0, 3}), pair_t = at::arange(3);
  // As Python's optimizer state_dict(): int parameter ids, a list of param groups.
  const auto state_of = [&](c10::IValue id) {
    PyDict s0 = NewDict(), state = NewDict();
    s0.insert("step", step);
    s0.insert("exp_avg", avg);
    state.insert(std::move(id), s0);
    return state;
  };
  const auto group = [] {
    PyDict g = NewDict();
    g.insert("lr", 0.01);
    g.insert("betas", c10::ivalue::Tuple::create(0.9, 0.999));
    g.insert("foreach", c10::IValue());
    g.insert("amsgrad", false);
    g.insert("params", NewList({std::string("0.weight"), std::string("0.bias")}));
    return g;
  };
  const auto build = [&](c10::IValue state_key) {
    PyDict model = NewDict(), optim = NewDict(), extra = NewDict(), deep = NewDict(), root = NewDict();
    model.insert("0.weight", w);
    model.insert("0.bias", b);
    model.insert("emb", e);
    optim.insert("state", state_of(std::move(state_key)));
    optim.insert("param_groups", NewList({group()}));
    deep.insert("deep", special);
    extra.insert("mixed", NewList({ones, int64_t{5}, std::string("x"), deep}));
    extra.insert("pair", c10::ivalue::Tuple::create(pair_t, std::string("a")));
    extra.insert("big", int64_t{1} << 40);
    extra.insert("neg", int64_t{-7});
    extra.insert("flags", flags);
    extra.insert("cplx", cplx);
    extra.insert("empty", empty);
    extra.insert("gone", NewDict());  // an empty dict has no leaf: DCP drops it
    root.insert("model", model);
    root.insert("optim", optim);
    root.insert("extra", extra);
    return root;
  };
  const std::string orig = NewPath("orig") + ".pt", dir = NewPath("ckpt"), out = NewPath("back") + ".pt";
  fsdp::checkpoint::WriteFileAtomically(orig, WriteCheckpoint(c10::IValue(build(int64_t{0}))), "test");

  Result r = Dcp({"from-torch", orig, dir});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "wrote '" + dir + "': __0_0.distcp and .metadata, 10 tensors and 10 bytes entries\n");
  // The flattened keys in state-dict order, bytes entries among them, with their paths.
  const DcpMetadata md = ReadMetadata(dir);
  const std::vector<std::string> keys = {"model.0.weight",
                                         "model.0.bias",
                                         "model.emb",
                                         "optim.state.0.step",
                                         "optim.state.0.exp_avg",
                                         "optim.param_groups.0.lr",
                                         "optim.param_groups.0.betas",
                                         "optim.param_groups.0.foreach",
                                         "optim.param_groups.0.amsgrad",
                                         "optim.param_groups.0.params",
                                         "extra.mixed.0",
                                         "extra.mixed.1",
                                         "extra.mixed.2",
                                         "extra.mixed.3.deep",
                                         "extra.pair",
                                         "extra.big",
                                         "extra.neg",
                                         "extra.flags",
                                         "extra.cplx",
                                         "extra.empty"};
  // (extra.mixed.3.deep counts once: 12 tensors + 9 bytes = 21 keys, 20 listed + "extra.mixed.3.deep".)
  std::vector<std::string> got_keys;
  for (const auto& entry : md.entries) got_keys.push_back(entry.fqn);
  EXPECT_EQ(got_keys, keys);
  EXPECT_EQ(md.Find("optim.state.0.step")->object_path,
            Path({std::string("optim"), std::string("state"), std::string("0"), std::string("step")}));
  EXPECT_EQ(md.Find("optim.param_groups.0.lr")->object_path,
            Path({std::string("optim"), std::string("param_groups"), int64_t{0}, std::string("lr")}));
  EXPECT_EQ(md.Find("extra.mixed.3.deep")->object_path,
            Path({std::string("extra"), std::string("mixed"), int64_t{3}, std::string("deep")}));
  EXPECT_TRUE(md.Find("extra.pair")->is_bytes);      // a tuple is a leaf, even holding a tensor
  EXPECT_FALSE(md.Find("extra.mixed.0")->is_bytes);  // a list holding a tensor is not
  EXPECT_EQ(md.Find("model.0.bias")->properties.dtype, at::kBFloat16);
  EXPECT_EQ(md.Find("extra.empty")->size, (std::vector<int64_t>{0, 3}));

  r = Dcp({"to-torch", dir, out});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "wrote '" + out + "': 10 tensors (" +
                       std::to_string(w.nbytes() + b.nbytes() + e.nbytes() + step.nbytes() + avg.nbytes() +
                                      ones.nbytes() + special.nbytes() + flags.nbytes() + cplx.nbytes()) +
                       " bytes of data) and 10 values of bytes entries\n");
  PyDict want = build(std::string("0"));  // the int key comes back a str, as in Python
  ASSERT_EQ(want.at("extra").toGenericDict().erase("gone"), 1u);
  ExpectSameValue(Load(out), want, "root");
  EXPECT_FALSE(Exists(out + ".tmp." + std::to_string(getpid())));
}

TEST(DcpCli, ToTorchAssemblesTensorsFromTheChunksOfEveryRank) {
  const at::Tensor w = at::randn({6, 5}), v = at::arange(24, at::kInt).reshape({4, 6});
  const std::string dir = NewPath("ranks"), out = NewPath("full") + ".pt";
  std::vector<DcpFragment> fragments = {
      WriteRankData(
          dir, 0,
          {{"w", {6, 5}, at::kFloat, {0, 0}, w.narrow(0, 0, 2)}, {"v", {4, 6}, at::kInt, {0, 0}, v.narrow(1, 0, 4)}},
          {{"step", WriteCheckpoint(c10::IValue(int64_t{9}))}}),
      WriteRankData(dir, 1,
                    {{"w", {6, 5}, at::kFloat, {2, 0}, w.narrow(0, 2, 4).narrow(1, 0, 3)},
                     {"w", {6, 5}, at::kFloat, {2, 3}, w.narrow(0, 2, 4).narrow(1, 3, 2)},
                     {"v", {4, 6}, at::kInt, {0, 4}, v.narrow(1, 4, 2)}}),
  };
  WriteMetadata(dir, fragments);
  const DcpMetadata md = ReadMetadata(dir);

  // ls: every chunk where the metadata puts it, then the files, their sizes checked.
  const Result ls = Dcp({"ls", dir});
  ASSERT_EQ(ls.status, 0) << ls.err;
  const auto range = [](const fsdp::checkpoint::DcpStorageInfo& s) {
    return absl::StrCat(s.relative_path, " bytes [", s.offset, ", ", s.offset + s.length, ")");
  };
  const auto& wc = md.Find("w")->chunks;
  const auto& vc = md.Find("v")->chunks;
  const int64_t size0 = ReadFile(dir + "/__0_0.distcp", "test").size();
  const int64_t size1 = ReadFile(dir + "/__1_0.distcp", "test").size();
  EXPECT_EQ(ls.out, absl::StrCat(dir, ": DCP checkpoint, version 1.0.0, 3 entries (2 tensors, 1 bytes)\n",
                                 "step: bytes, ", range(md.Find("step")->bytes_storage), "\n",  //
                                 "w: tensor float32 [6, 5], 3 chunks\n",                        //
                                 "  offsets [0, 0] sizes [2, 5]: ", range(wc[0].storage), "\n",
                                 "  offsets [2, 0] sizes [4, 3]: ", range(wc[1].storage), "\n",
                                 "  offsets [2, 3] sizes [4, 2]: ", range(wc[2].storage), "\n",
                                 "v: tensor int32 [4, 6], 2 chunks\n",  //
                                 "  offsets [0, 0] sizes [4, 4]: ", range(vc[0].storage), "\n",
                                 "  offsets [0, 4] sizes [4, 2]: ", range(vc[1].storage), "\n",
                                 "2 data files:\n",  //
                                 "  __0_0.distcp: ", size0, " bytes, data up to byte ", size0, "\n",
                                 "  __1_0.distcp: ", size1, " bytes, data up to byte ", size1, "\n"));
  EXPECT_EQ(md.Find("step")->bytes_storage.offset, 0);  // bytes first in the file, as DCP writes

  const Result to = Dcp({"to-torch", dir, out});
  ASSERT_EQ(to.status, kOk) << to.err;
  PyDict want = NewDict();
  want.insert("step", int64_t{9});  // the entries in metadata order: rank 0's first
  want.insert("w", w);
  want.insert("v", v);
  ExpectSameValue(Load(out), want, "root");
}

TEST(DcpCli, BadInputIsOneClearErrorLine) {
  // Usage.
  ExpectError({}, kUsage, "no subcommand");
  ExpectError({"cat", "x"}, kUsage, "unknown subcommand 'cat'");
  ExpectError({"ls"}, kUsage, "ls takes DIR, got 0 arguments");
  ExpectError({"to-torch", "a"}, kUsage, "to-torch takes DIR FILE, got 1 argument");
  ExpectError({"from-torch", "--force", "a", "b"}, kUsage, "from-torch: unknown option '--force'");
  const Result help = Dcp({"--help"});
  EXPECT_EQ(help.status, 0);
  EXPECT_TRUE(absl::StartsWith(help.out, "usage: dcp ls DIR\n")) << help.out;

  // Directories that are not checkpoints.
  const std::string base = NewPath("bad");
  ExpectError({"ls", base + "/none"}, kFailed,
              "cannot access the checkpoint directory '" + base + "/none' (No such file or directory)");
  ASSERT_EQ(::mkdir(base.c_str(), 0755), 0);
  ExpectError({"to-torch", base, base + "/x.pt"}, kFailed,
              "'" + base + "' has no .metadata file: it is not a DCP checkpoint directory");
  WriteBytes(base + "/file", "not a directory");
  ExpectError({"ls", base + "/file"}, kFailed, "'" + base + "/file' is not a directory");
  WriteBytes(base + "/__0_0.distcp", "");
  ExpectError({"ls", base}, kFailed, "has no .metadata file: its *.distcp files are from a save that did not finish");
  WriteBytes(base + "/.metadata", "\x80\x04garbage");
  ExpectError({"ls", base}, kFailed, "'" + base + "/.metadata' is not a valid DCP metadata file: ");

  // A data file cut short: ls lists, then fails naming it; to-torch writes nothing.
  const at::Tensor t = at::arange(12, at::kFloat).reshape({4, 3});
  const std::string dir = NewPath("cut"), out = NewPath("cut") + ".pt";
  WriteMetadata(dir, {WriteRankData(dir, 0, {{"t", {4, 3}, at::kFloat, {0, 0}, t.narrow(0, 0, 2)}}),
                      WriteRankData(dir, 1, {{"t", {4, 3}, at::kFloat, {2, 0}, t.narrow(0, 2, 2)}})});
  const std::string file = dir + "/__1_0.distcp";
  const std::vector<char> data = ReadFile(file, "test");
  WriteBytes(file, std::string(data.begin(), data.end() - 7));
  const std::string cut = std::to_string(data.size() - 7), full = std::to_string(data.size());
  const Result ls = Dcp({"ls", dir});
  EXPECT_EQ(ls.status, kFailed);
  EXPECT_TRUE(absl::StrContains(ls.out, "  __1_0.distcp: " + cut + " bytes, data up to byte " + full + ": TRUNCATED\n"))
      << ls.out;
  EXPECT_EQ(ls.err, "dcp: error: '" + file + "' has " + cut + " bytes, but the metadata stores data up to byte " +
                        full + " in it (truncated?)\n");
  ExpectError({"to-torch", dir, out}, kFailed, "of '" + file + "', which has only " + cut + " bytes (truncated?)");
  EXPECT_FALSE(Exists(out));
  EXPECT_FALSE(Exists(out + ".tmp." + std::to_string(getpid())));
  ::unlink(file.c_str());
  ExpectError({"to-torch", dir, out}, kFailed, "cannot open '" + file + "'");
  ExpectError({"ls", dir}, kFailed, "cannot access '" + file + "' (No such file or directory)");

  // The output's directory does not exist.
  ExpectError({"to-torch", dir, base + "/no/x.pt"}, kFailed, "cannot create '" + base + "/no/x.pt.tmp.");

  // from-torch of files that are not a state dict's torch.save.
  ExpectError({"from-torch", base + "/missing.pt", base + "/d"}, kFailed,
              "cannot open '" + base + "/missing.pt' for reading (No such file or directory)");
  ExpectError({"from-torch", base + "/file", base + "/d"}, kFailed, "'" + base + "/file' is not a valid checkpoint");
  const std::string tensor_file = base + "/tensor.pt";
  fsdp::checkpoint::WriteFileAtomically(tensor_file, WriteCheckpoint(c10::IValue(t)), "test");
  ExpectError({"from-torch", tensor_file, base + "/d"}, kFailed,
              "holds a value of type 'Tensor', not a state dict (a dict)");
  PyDict twice = NewDict(), a = NewDict();
  a.insert("b", t);
  twice.insert("a.b", t);
  twice.insert("a", a);
  fsdp::checkpoint::WriteFileAtomically(tensor_file, WriteCheckpoint(c10::IValue(twice)), "test");
  ExpectError({"from-torch", tensor_file, base + "/d"}, kFailed,
              "the values at ('a', 'b') and an earlier one both flatten to the DCP key 'a.b'");
  PyDict float_key = NewDict();
  float_key.insert(1.5, t);
  fsdp::checkpoint::WriteFileAtomically(tensor_file, WriteCheckpoint(c10::IValue(float_key)), "test");
  ExpectError({"from-torch", tensor_file, base + "/d"}, kFailed,
              "has a key of type 'float'; only str, int and bool keys");
}

TEST(DcpCli, UnreadableBytesAndConflictingPathsAreNamed) {
  const at::Tensor t = at::randn({3});
  const std::string dir = NewPath("odd"), out = NewPath("odd") + ".pt";
  DcpFragment f = WriteRankData(dir, 0, {{"w", {3}, at::kFloat, {0}, t}},
                                {{"obj", std::vector<char>{'n', 'o', 't', ' ', 'z', 'i', 'p'}}});
  WriteMetadata(dir, {f});
  ExpectError({"to-torch", dir, out}, kFailed,
              "bytes entry 'obj' (" + dir + "/__0_0.distcp bytes [0, 7)) is not a valid checkpoint: ");
  ExpectError({"to-torch", dir, out}, kFailed, "(to-torch --skip-unreadable leaves such entries out)");
  EXPECT_FALSE(Exists(out));
  const Result r = Dcp({"to-torch", "--skip-unreadable", dir, out});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "wrote '" + out +
                       "': 1 tensors (12 bytes of data) and 0 values of bytes entries; left out 1 "
                       "unreadable bytes entries: 'obj'\n");
  PyDict want = NewDict();
  want.insert("w", t);
  ExpectSameValue(Load(out), want, "root");

  // planner_data paths that cannot both hold: through a value, and a str index into a list.
  f = WriteRankData(dir, 0, {{"a.b", {3}, at::kFloat, {0}, t}, {"l.x", {3}, at::kFloat, {0}, t}},
                    {{"a", WriteCheckpoint(c10::IValue(int64_t{1}))}, {"l.0", WriteCheckpoint(c10::IValue(2.0))}});
  for (auto& e : f.entries) {
    const size_t dot = e.fqn.find('.');
    if (dot != std::string::npos) e.object_path = {e.fqn.substr(0, dot), e.fqn.substr(dot + 1)};
    if (e.fqn == "l.0") e.object_path = {std::string("l"), int64_t{0}};
  }
  WriteMetadata(dir, {f});
  ExpectError(
      {"to-torch", dir, out}, kFailed,
      "the planner_data path ('a', 'b') of 'a.b' at element 1 goes into a value of type 'int', not a dict or a list");
  f.entries.erase(f.entries.begin());      // "a"
  f.entries.erase(f.entries.begin() + 1);  // "a.b" (now second)
  WriteMetadata(dir, {f});
  ExpectError({"to-torch", dir, out}, kFailed,
              "the planner_data path ('l', 'x') of 'l.x' at element 1 is a str, but indexes a list");
}

// ------------------------------------------------------------------ interop with PyTorch
using fsdp::testing::PeerPython;
using fsdp::testing::RunCommand;

constexpr char kScript[] = "tools/testdata/dcp_cli_interop.py";

// Runs the interop script with `args` and expects it to print `done`.
void RunScript(const std::string& python, const std::string& args, const std::string& done) {
  std::string output;
  const int status = RunCommand(absl::StrCat(python, " ", kScript, " ", args), &output);
  ASSERT_EQ(status, 0) << output;
  ASSERT_TRUE(absl::StrContains(output, done)) << output;
}

// to-torch of `dir` equals `ref`, Python's dcp_to_torch_save of it, as Python loads both (ours
// with weights_only=True) and as the C++ reader does.
void ExpectToTorchEqualsPythons(const std::string& python, const std::string& dir, const std::string& ref) {
  const std::string ours = dir + "_ours.pt";
  const Result r = Dcp({"to-torch", dir, ours});
  ASSERT_EQ(r.status, 0) << r.err;
  RunScript(python, absl::StrCat("compare ", ours, " ", ref), "OK");
  const c10::IValue want = Load(ref);
  ExpectSameValue(Load(ours), want, "root");
  ASSERT_TRUE(want.toGenericDict().at("optim").toGenericDict().at("param_groups").isList());
}

TEST(DcpCliInterop, ToTorchOfPythonsCheckpointEqualsDcpToTorchSave) {
  std::string why_not;
  const std::string python = PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << why_not;
  const std::string dir = NewPath("py_saved"), ref = dir + "_ref.pt", orig = dir + "_orig.pt";
  ASSERT_NO_FATAL_FAILURE(RunScript(python, absl::StrCat("save ", dir, " ", ref, " ", orig), "SAVED"));

  const Result ls = Dcp({"ls", dir});
  ASSERT_EQ(ls.status, 0) << ls.err;
  EXPECT_TRUE(absl::StrContains(ls.out,
                                "\nmodel.0.weight: tensor float32 [4, 3], 1 chunk, path ('model', '0.weight')\n"
                                "  offsets [0, 0] sizes [4, 3]: __0_0.distcp bytes ["))
      << ls.out;
  EXPECT_TRUE(absl::StrContains(ls.out, "\noptim.param_groups.0.lr: bytes, __0_0.distcp bytes [")) << ls.out;
  EXPECT_TRUE(absl::StrContains(ls.out, ", path ('optim', 'param_groups', 0, 'lr')\n")) << ls.out;
  EXPECT_TRUE(absl::StrContains(ls.out, "\nextra.scalar: tensor float64 [], 1 chunk, path ('extra', 'scalar')\n"))
      << ls.out;

  ExpectToTorchEqualsPythons(python, dir, ref);
}

TEST(DcpCliInterop, ToTorchOfPythonsTwoRankShardedCheckpointEqualsDcpToTorchSave) {
  std::string why_not;
  const std::string python = PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << why_not;
  const std::string dir = NewPath("py_sharded"), ref = dir + "_ref.pt";
  ASSERT_NO_FATAL_FAILURE(RunScript(python, absl::StrCat("save-sharded ", dir, " ", ref), "SAVED"));
  const Result ls = Dcp({"ls", dir});
  ASSERT_EQ(ls.status, 0) << ls.err;
  EXPECT_TRUE(absl::StrContains(ls.out,
                                "\nmodel.0.weight: tensor float32 [4, 3], 2 chunks, path ('model', '0.weight')\n"
                                "  offsets [0, 0] sizes [2, 3]: __0_0.distcp bytes ["))
      << ls.out;
  EXPECT_TRUE(absl::StrContains(ls.out, "\n  offsets [2, 0] sizes [2, 3]: __1_0.distcp bytes [")) << ls.out;
  EXPECT_TRUE(absl::StrContains(ls.out, "\n2 data files:\n")) << ls.out;
  ExpectToTorchEqualsPythons(python, dir, ref);
}

TEST(DcpCliInterop, FromTorchOfPythonsFileLoadsWithDcpLoad) {
  std::string why_not;
  const std::string python = PeerPython(&why_not);
  if (python.empty()) GTEST_SKIP() << why_not;
  const std::string base = NewPath("py_file"), orig = base + "_orig.pt", dir = base + "_dcp";
  ASSERT_NO_FATAL_FAILURE(RunScript(python, absl::StrCat("save ", base + "_saved ", base + "_ref.pt ", orig), "SAVED"));
  const Result r = Dcp({"from-torch", orig, dir});
  ASSERT_EQ(r.status, 0) << r.err;
  RunScript(python, absl::StrCat("check-dcp ", dir, " ", orig), "OK");
}

// ------------------------------------------------------------------- Hugging Face (hf)

// A Hugging Face directory written with the safetensors writer alone: bf16, f32 (one tensor
// larger than kStreamBytes, so conversions go in pieces), i64 and 0-d, in two files + index.
fsdp::checkpoint::TensorDict WriteHfDir(const std::string& dir) {
  at::manual_seed(3);
  fsdp::checkpoint::TensorDict all, a, b;
  all.insert("model.embed_tokens.weight", at::randn({4200, 4200}));  // 70.6 MB > kStreamBytes + 1 MiB
  all.insert("model.layers.0.mlp.up_proj.weight", at::randn({24, 16}).to(at::kBFloat16));
  all.insert("model.norm.weight", at::randn({16}));
  all.insert("positions", at::arange(7, at::kLong));
  all.insert("scale", at::scalar_tensor(0.5));
  std::string map;
  int i = 0;
  for (const auto& item : all) {
    (i % 2 == 0 ? a : b).insert(item.key(), item.value());
    absl::StrAppend(&map, map.empty() ? "" : ",", "\"", item.key(), "\":\"", i++ % 2 == 0 ? "a" : "b",
                    ".safetensors\"");
  }
  ::mkdir(dir.c_str(), 0755);
  fsdp::checkpoint::SaveSafetensors(dir + "/a.safetensors", a);
  fsdp::checkpoint::SaveSafetensors(dir + "/b.safetensors", b);
  WriteBytes(dir + "/model.safetensors.index.json", "{\"weight_map\":{" + map + "}}");
  return all;
}

void ExpectHfDirHolds(const std::string& dir, const fsdp::checkpoint::TensorDict& want) {
  const fsdp::checkpoint::HfCheckpointReader reader(dir);
  EXPECT_EQ(reader.tensors().size(), want.size()) << dir;
  for (const auto& item : want) {
    const fsdp::checkpoint::HfTensor* t = reader.Find(item.key());
    ASSERT_NE(t, nullptr) << item.key();
    at::Tensor got = at::empty(t->size, t->dtype);
    reader.ReadInto(item.key(), std::vector<int64_t>(t->size.size(), 0), got);
    EXPECT_TRUE(at::equal(got, item.value())) << item.key();
  }
}

TEST(DcpCliHf, FromHfThenToHfGivesTheTensorsBackBitwiseStreamed) {
  const std::string hf = NewPath("hf_src"), ckpt = NewPath("hf_dcp"), back = NewPath("hf_back"),
                    bf16 = NewPath("hf_bf16");
  const fsdp::checkpoint::TensorDict want = WriteHfDir(hf);
  const Result ls = Dcp({"ls", hf});
  EXPECT_EQ(ls.status, kOk) << ls.err;
  EXPECT_TRUE(absl::StrContains(ls.out, "Hugging Face checkpoint, 5 tensors")) << ls.out;
  EXPECT_TRUE(absl::StrContains(ls.out, "model.layers.0.mlp.up_proj.weight: BF16 [24, 16], b.safetensors")) << ls.out;
  {
    // Streamed: the 70.6 MB tensor is never whole in memory.
    fsdp::testing::ScopedAllocationCounter counter;
    const Result from = Dcp({"from-hf", hf, ckpt});
    ASSERT_EQ(from.status, kOk) << from.err;
    const Result to = Dcp({"to-hf", "--max-shard-size", "20MB", ckpt, back});
    ASSERT_EQ(to.status, kOk) << to.err;
    EXPECT_LE(counter.peak(), kStreamBytes + (int64_t{1} << 20));
  }
  // The DCP checkpoint: dcp::Load's keys, the large tensor in two chunks.
  const DcpMetadata md = ReadMetadata(ckpt);
  const fsdp::checkpoint::DcpEntry* embed = md.Find("model.model.embed_tokens.weight");
  ASSERT_NE(embed, nullptr);
  EXPECT_EQ(embed->chunks.size(), 2u);
  EXPECT_EQ(embed->object_path,
            (std::vector<DcpPathElement>{std::string("model"), std::string("model.embed_tokens.weight")}));
  ExpectHfDirHolds(back, want);
  EXPECT_GE(fsdp::checkpoint::HfCheckpointReader(back).files().size(), 2u);  // split at 20 MB
  std::filesystem::remove_all(back);  // each copy holds 70 MB: keep the test's disk use small
  const Result to_bf16 = Dcp({"to-hf", "--dtype=bf16", ckpt, bf16});
  ASSERT_EQ(to_bf16.status, kOk) << to_bf16.err;
  fsdp::checkpoint::TensorDict converted;
  for (const auto& item : want) {
    const at::Tensor& t = item.value();
    converted.insert(item.key(), at::isFloatingType(t.scalar_type()) ? t.to(at::kBFloat16) : t);
  }
  ExpectHfDirHolds(bf16, converted);
  std::filesystem::remove_all(bf16);
  std::filesystem::remove_all(ckpt);
  // --prefix '': every tensor under its own key, and back.
  const std::string flat = NewPath("hf_flat"), flat_back = NewPath("hf_flat_back");
  const Result from_flat = Dcp({"from-hf", "--prefix", "", hf, flat});
  ASSERT_EQ(from_flat.status, kOk) << from_flat.err;
  EXPECT_NE(ReadMetadata(flat).Find("positions"), nullptr);
  const Result to_flat = Dcp({"to-hf", "--prefix=", flat, flat_back});
  ASSERT_EQ(to_flat.status, kOk) << to_flat.err;
  ExpectHfDirHolds(flat_back, want);
}

TEST(DcpCliHf, BadArgumentsAreOneClearErrorLine) {
  const std::string hf = NewPath("hf_bad"), ckpt = NewPath("hf_bad_dcp");
  WriteHfDir(hf);
  const Result from = Dcp({"from-hf", hf, ckpt});
  ASSERT_EQ(from.status, kOk) << from.err;
  ExpectError({"to-hf", "--dtype", "int8", ckpt, NewPath("x")}, kFailed,
              "--dtype: 'int8' is not a floating-point dtype");
  ExpectError({"to-hf", "--max-shard-size", "5GiB", ckpt, NewPath("x")}, kFailed,
              "--max-shard-size: '5GiB' is not a size");
  ExpectError({"to-hf", "--prefix", "optim.", ckpt, NewPath("x")}, kFailed, "has no tensor under 'optim.'");
  ExpectError({"to-hf", ckpt, NewPath("x"), "--dtype"}, kUsage, "--dtype needs a value");
  ExpectError({"from-hf", "--skip-unreadable", hf, ckpt}, kUsage, "unknown option '--skip-unreadable'");
  ExpectError({"from-hf", "--dtype=bf16", hf, ckpt}, kUsage, "unknown option '--dtype'");
  ExpectError({"from-hf", NewPath("missing"), ckpt}, kFailed, "is not a directory");
}

}  // namespace
}  // namespace dcp_cli
