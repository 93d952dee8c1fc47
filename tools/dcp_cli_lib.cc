#include "tools/dcp_cli_lib.h"

#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <utility>
#include <variant>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/dcp_metadata.h"
#include "checkpoint/dcp_storage.h"
#include "checkpoint/file_io.h"
#include "checkpoint/hf_checkpoint.h"

namespace dcp_cli {

std::string Printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) {
      absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

namespace {

using fsdp::checkpoint::DcpEntry;
using fsdp::checkpoint::DcpMetadata;
using fsdp::checkpoint::DcpPathElement;
using fsdp::checkpoint::DcpStorageInfo;
using fsdp::checkpoint::JoinPath;

constexpr char kUsageText[] =
    "usage: dcp ls DIR\n"
    "       dcp to-torch [--skip-unreadable] DIR FILE\n"
    "       dcp from-torch FILE DIR\n"
    "       dcp from-hf [--prefix P] HF_DIR DIR\n"
    "       dcp to-hf [--prefix P] [--dtype bf16] [--max-shard-size 5GB] DIR HF_DIR\n"
    "\n"
    "PyTorch distributed-checkpoint (torch.distributed.checkpoint) directories:\n"
    "  ls          list the entries of DIR/.metadata: tensors (dtype, shape, chunks and where\n"
    "              each is stored) and bytes entries; check the data files are all there\n"
    "  to-torch    write DIR as one torch.save FILE of full tensors, nested as saved (what\n"
    "              format_utils.dcp_to_torch_save writes); --skip-unreadable leaves out bytes\n"
    "              entries holding Python objects this tool cannot read\n"
    "  from-torch  write the state dict in torch.save FILE as a one-rank checkpoint in DIR\n"
    "              (what format_utils.torch_save_to_dcp writes)\n"
    "\n"
    "Hugging Face directories (model.safetensors, or model-*.safetensors with\n"
    "model.safetensors.index.json; ls also lists one):\n"
    "  from-hf     write HF_DIR's tensors as a checkpoint in DIR, each under 'model.<key>' (or\n"
    "              'P<key>'), streamed: no whole tensor in memory\n"
    "  to-hf       write DIR's tensors under 'model.' (or P) as HF_DIR, save_pretrained's layout,\n"
    "              files split at --max-shard-size (default 50GB), --dtype converting floats\n";

constexpr char kCommands[] = "ls, to-torch, from-torch, from-hf or to-hf";
constexpr const char* kValueFlags[] = {"--prefix", "--dtype", "--max-shard-size"};

// A bad command line (exit status kUsage), as opposed to bad input (a c10::Error).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string Reason(int error) { return std::strerror(error); }

// A planner_data path as Python prints the tuple: ('optim', 'param_groups', 0, 'lr').
std::string PathRepr(const std::vector<DcpPathElement>& path) {
  std::vector<std::string> parts;
  for (const DcpPathElement& p : path) {
    parts.push_back(std::holds_alternative<int64_t>(p) ? std::to_string(std::get<int64_t>(p))
                                                       : "'" + Printable(std::get<std::string>(p)) + "'");
  }
  return absl::StrCat("(", absl::StrJoin(parts, ", "), parts.size() == 1 ? ",)" : ")");
}

// The Python type of a value, for messages: 'int', 'dict', 'Tensor', ...
std::string TypeName(const c10::IValue& v) {
  const char* name = v.isNone()          ? "NoneType"
                     : v.isBool()        ? "bool"
                     : v.isInt()         ? "int"
                     : v.isDouble()      ? "float"
                     : v.isString()      ? "str"
                     : v.isTuple()       ? "tuple"
                     : v.isList()        ? "list"
                     : v.isGenericDict() ? "dict"
                     : v.isTensor()      ? "Tensor"
                                         : nullptr;
  return absl::StrCat("'", name != nullptr ? name : v.tagKind(), "'");
}

std::string Range(const DcpStorageInfo& s) {
  return absl::StrCat(Printable(s.relative_path), " bytes [", s.offset, ", ", s.offset + s.length, ")");
}

// The checkpoint's metadata, after telling a missing, foreign or unfinished directory apart.
DcpMetadata OpenCheckpoint(const std::string& dir) {
  struct stat st {};
  TORCH_CHECK(::stat(dir.c_str(), &st) == 0, "cannot access the checkpoint directory '", dir, "' (", Reason(errno),
              ")");
  TORCH_CHECK(S_ISDIR(st.st_mode), "'", dir,
              "' is not a directory (a DCP checkpoint is a directory of .metadata and *.distcp files)");
  const std::string metadata = JoinPath(dir, ".metadata");
  if (::stat(metadata.c_str(), &st) != 0 && errno == ENOENT) {
    bool has_data = false;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (const dirent* e = ::readdir(d)) has_data = has_data || absl::EndsWith(e->d_name, ".distcp");
      ::closedir(d);
    }
    TORCH_CHECK(false, "'", dir, "' has no .metadata file: ",
                has_data ? "its *.distcp files are from a save that did not finish (DCP writes .metadata last)"
                         : "it is not a DCP checkpoint directory");
  }
  return fsdp::checkpoint::ReadMetadata(dir);
}

// ------------------------------------------------------------------------------------- ls

void ListEntry(const DcpEntry& e, std::ostream& out) {
  out << Printable(e.fqn) << ": ";
  if (e.is_bytes) {
    out << "bytes, " << Range(e.bytes_storage);
  } else {
    out << "tensor " << fsdp::checkpoint::DcpDtypeName(e.properties.dtype) << " " << c10::str(c10::IntArrayRef(e.size))
        << ", " << e.chunks.size() << (e.chunks.size() == 1 ? " chunk" : " chunks");
  }
  // The nesting to-torch restores, where it is not just the key.
  const bool flat = e.object_path.empty() || (e.object_path.size() == 1 && e.object_path[0] == DcpPathElement(e.fqn));
  if (!flat) out << ", path " << PathRepr(e.object_path);
  out << "\n";
  for (const auto& c : e.chunks) {
    out << "  offsets " << c10::str(c10::IntArrayRef(c.offsets)) << " sizes " << c10::str(c10::IntArrayRef(c.sizes))
        << ": " << Range(c.storage) << "\n";
  }
}

}  // namespace

void List(const std::string& dir, std::ostream& out) {
  if (IsHuggingFaceDir(dir)) return ListHuggingFace(dir, out);
  const DcpMetadata md = OpenCheckpoint(dir);
  int64_t tensors = 0;
  std::vector<std::string> files;                  // in order of first use
  absl::flat_hash_map<std::string, int64_t> ends;  // file -> the end of the last range in it
  const auto use = [&](const DcpStorageInfo& s) {
    auto [it, added] = ends.emplace(s.relative_path, 0);
    if (added) files.push_back(s.relative_path);
    it->second = std::max(it->second, s.offset + s.length);
  };
  for (const DcpEntry& e : md.entries) {
    if (e.is_bytes) {
      use(e.bytes_storage);
    } else {
      ++tensors;
      for (const auto& c : e.chunks) use(c.storage);
    }
  }
  out << Printable(dir) << ": DCP checkpoint, version " << md.version.value_or("(none)") << ", " << md.entries.size()
      << " entries (" << tensors << " tensors, " << md.entries.size() - tensors << " bytes)\n";
  for (const DcpEntry& e : md.entries) ListEntry(e, out);
  out << files.size() << (files.size() == 1 ? " data file:\n" : " data files:\n");
  std::vector<std::string> problems;
  for (const std::string& f : files) {
    const std::string path = JoinPath(dir, f);
    struct stat st {};
    out << "  " << Printable(f) << ": ";
    if (::stat(path.c_str(), &st) != 0) {
      problems.push_back(absl::StrCat("cannot access '", path, "' (", Reason(errno), ")"));
      out << "MISSING\n";
      continue;
    }
    out << st.st_size << " bytes, data up to byte " << ends[f];
    if (st.st_size < ends[f]) {
      out << ": TRUNCATED";
      problems.push_back(absl::StrCat("'", path, "' has ", st.st_size,
                                      " bytes, but the metadata stores data up to byte ", ends[f],
                                      " in it (truncated?)"));
    }
    out << "\n";
  }
  out.flush();
  TORCH_CHECK(problems.empty(), problems[0],
              problems.size() > 1 ? absl::StrCat(" (and ", problems.size() - 1, " more data file problems)") : "");
}

// ------------------------------------------------------------------------------- to-torch
namespace {

using PyDict = c10::impl::GenericDict;
using PyList = c10::impl::GenericList;

// Longest list planner_data may ask for: a bound for a corrupt index, far above any real list
// of tensors or dicts in a state dict.
constexpr int64_t kMaxListIndex = int64_t{1} << 20;

c10::IValue Key(const DcpPathElement& p) {
  return std::holds_alternative<int64_t>(p) ? c10::IValue(std::get<int64_t>(p)) : c10::IValue(std::get<std::string>(p));
}

// Places values along planner_data paths as torch/distributed/checkpoint/_traverse.py
// set_element does: a missing container on the way is a dict when the next path element is a
// str and a list when it is an int; lists grow with None up to the index. Where Python would
// raise (a path through a value that is not a container, a str index into a list) or build a
// huge list, this names the entry.
class Nester {
 public:
  Nester() : root_(c10::AnyType::get(), c10::AnyType::get()) {}
  const PyDict& root() const { return root_; }

  void Place(const DcpEntry& e, const c10::IValue& value) {
    if (e.object_path.empty()) {  // no planner_data entry: under its key (_EmptyStateDictLoadPlanner)
      root_.insert_or_assign(e.fqn, value);
      return;
    }
    const auto& path = e.object_path;
    c10::IValue cur(root_);
    for (size_t i = 1; i < path.size(); ++i) {
      const bool next_is_str = std::holds_alternative<std::string>(path[i]);
      c10::IValue fresh = next_is_str ? c10::IValue(PyDict(c10::AnyType::get(), c10::AnyType::get()))
                                      : c10::IValue(PyList(c10::AnyType::get()));
      cur = Child(cur, path[i - 1], std::move(fresh), e, i - 1);
    }
    if (cur.isGenericDict()) {
      cur.toGenericDict().insert_or_assign(Key(path.back()), value);
    } else {
      const size_t i = Index(cur, path.back(), e, path.size() - 1);
      cur.toList().set(i, value);
    }
  }

 private:
  // `container`[key], set to `fresh` when absent (or None in a list).
  c10::IValue Child(const c10::IValue& container, const DcpPathElement& key, c10::IValue fresh, const DcpEntry& e,
                    size_t at) {
    if (container.isGenericDict()) {
      PyDict dict = container.toGenericDict();
      auto it = dict.find(Key(key));
      if (it != dict.end()) return it->value();
      dict.insert(Key(key), fresh);
      return fresh;
    }
    const size_t i = Index(container, key, e, at);
    PyList list = container.toList();
    if (list.get(i).isNone()) list.set(i, fresh);
    return list.get(i);
  }

  // The list index path[at] of `container`, which must be a list; the list grows to hold it.
  size_t Index(const c10::IValue& container, const DcpPathElement& key, const DcpEntry& e, size_t at) {
    const std::string where =
        absl::StrCat("the planner_data path ", PathRepr(e.object_path), " of '", Printable(e.fqn), "' at element ", at);
    TORCH_CHECK(container.isList(), where, " goes into a value of type ", TypeName(container),
                ", not a dict or a list");
    TORCH_CHECK(std::holds_alternative<int64_t>(key), where, " is a str, but indexes a list");
    const int64_t index = std::get<int64_t>(key);
    TORCH_CHECK(index >= 0 && index < kMaxListIndex, where, " is the list index ", index, ", outside [0, ",
                kMaxListIndex, ")");
    PyList list = container.toList();
    while (static_cast<int64_t>(list.size()) <= index) list.push_back(c10::IValue());
    return static_cast<size_t>(index);
  }

  PyDict root_;
};

// Writes `path` through a temporary file next to it, renamed over it by Commit; a failure
// (an exception before Commit) leaves `path` as it was.
class OutputFile {
 public:
  explicit OutputFile(std::string path) : path_(std::move(path)) {
    tmp_ = absl::StrCat(path_, ".tmp.", ::getpid());
    file_ = std::fopen(tmp_.c_str(), "wb");
    TORCH_CHECK(file_ != nullptr, "cannot create '", tmp_, "' to write '", path_, "' (", Reason(errno), ")");
  }
  ~OutputFile() {
    if (file_ != nullptr) {
      std::fclose(file_);
      ::unlink(tmp_.c_str());
    }
  }
  // Takes all `n` bytes; a write error is kept for Commit to report.
  void Write(const char* data, size_t n) {
    if (error_ == 0 && std::fwrite(data, 1, n, file_) != n) error_ = errno != 0 ? errno : EIO;
  }
  void Commit() {
    if (error_ == 0 && (std::fflush(file_) != 0 || ::fsync(fileno(file_)) != 0)) error_ = errno;
    FILE* f = std::exchange(file_, nullptr);
    if (std::fclose(f) != 0 && error_ == 0) error_ = errno;
    if (error_ == 0 && ::rename(tmp_.c_str(), path_.c_str()) != 0) error_ = errno;
    if (error_ != 0) {
      ::unlink(tmp_.c_str());
      TORCH_CHECK(false, "writing '", path_, "' failed (", Reason(error_), ")");
    }
  }

 private:
  std::string path_, tmp_;
  FILE* file_ = nullptr;
  int error_ = 0;
};

}  // namespace

void ToTorch(const std::string& dir, const std::string& file, bool skip_unreadable, std::ostream& out) {
  const DcpMetadata md = OpenCheckpoint(dir);
  OutputFile output(file);
  Nester nested;
  int64_t tensors = 0, data_bytes = 0, values = 0;
  std::vector<std::string> skipped;
  {
    fsdp::checkpoint::TorchSaveWriter writer([&output](const char* data, size_t n) { output.Write(data, n); },
                                             "to-torch");
    for (const DcpEntry& e : md.entries) {
      if (!e.is_bytes) {
        // One full tensor at a time: written to the archive, then only its stand-in is kept.
        at::Tensor full = at::empty(e.size, at::TensorOptions().dtype(e.properties.dtype));
        fsdp::checkpoint::ReadInto(dir, md, e.fqn, std::vector<int64_t>(e.size.size(), 0), full);
        nested.Place(e, writer.Add(full));
        ++tensors;
        data_bytes += static_cast<int64_t>(full.nbytes());
        continue;
      }
      // DCP torch.save'd the value (filesystem.py _write_item); Python's load_bytes torch.loads it.
      const std::vector<char> bytes = fsdp::checkpoint::ReadBytes(dir, md, e.fqn);
      const std::string source =
          absl::StrCat("bytes entry '", Printable(e.fqn), "' (", JoinPath(dir, Range(e.bytes_storage)), ")");
      c10::IValue value;
      try {
        value = fsdp::checkpoint::ReadCheckpoint(bytes.data(), bytes.size(), source);
      } catch (const c10::Error& error) {
        TORCH_CHECK(skip_unreadable, error.what_without_backtrace(),
                    " (to-torch --skip-unreadable leaves such entries out)");
        skipped.push_back("'" + Printable(e.fqn) + "'");
        continue;
      }
      nested.Place(e, value);
      ++values;
    }
    writer.Finish(c10::IValue(nested.root()));
  }
  output.Commit();
  out << "wrote '" << Printable(file) << "': " << tensors << " tensors (" << data_bytes << " bytes of data) and "
      << values << " values of bytes entries";
  if (!skipped.empty()) {
    out << "; left out " << skipped.size() << " unreadable bytes entries: " << absl::StrJoin(skipped, ", ");
  }
  out << "\n";
}

// ----------------------------------------------------------------------------- from-torch
namespace {

// One value of the flattened state dict, in the order flattening visits them.
struct Leaf {
  std::string fqn;
  std::vector<DcpPathElement> path;
  c10::IValue value;
};

// torch/distributed/checkpoint/_traverse.py traverse_state_dict: a value is a leaf unless it
// is a dict, or a list holding a tensor, a dict or (nested) such a list. Tuples are leaves.
bool IsLeaf(const c10::IValue& v) {
  if (v.isGenericDict()) return false;
  if (!v.isList()) return true;
  for (const auto& item : v.toListRef()) {
    if (item.isTensor() || ((item.isGenericDict() || item.isList()) && !IsLeaf(item))) return false;
  }
  return true;
}

class Flattener {
 public:
  explicit Flattener(std::string file) : file_(std::move(file)) {}

  void Visit(const c10::IValue& v, std::vector<DcpPathElement>& path) {
    if (v.isGenericDict()) {
      for (const auto& item : v.toGenericDict()) {
        path.push_back(KeyString(item.key(), path));
        Visit(item.value(), path);
        path.pop_back();
      }
    } else if (IsLeaf(v)) {
      std::vector<std::string> parts;
      for (const DcpPathElement& p : path) {
        parts.push_back(std::holds_alternative<int64_t>(p) ? std::to_string(std::get<int64_t>(p))
                                                           : std::get<std::string>(p));
      }
      std::string fqn = absl::StrJoin(parts, ".");
      TORCH_CHECK(seen_.emplace(fqn, path.size()).second, "'", file_, "': the values at ", PathRepr(path),
                  " and an earlier one both flatten to the DCP key '", Printable(fqn), "'");
      leaves_.push_back({std::move(fqn), path, v});
    } else {
      int64_t i = 0;
      for (const auto& item : v.toListRef()) {
        path.push_back(i++);
        Visit(item, path);
        path.pop_back();
      }
    }
  }
  std::vector<Leaf>& leaves() { return leaves_; }

 private:
  // Python's str(key): the path element of a dict key.
  DcpPathElement KeyString(const c10::IValue& key, const std::vector<DcpPathElement>& path) const {
    if (key.isString()) return key.toStringRef();
    if (key.isInt()) return std::to_string(key.toInt());
    TORCH_CHECK(key.isBool(), "'", file_, "': ", path.empty() ? "the state dict" : "the dict at " + PathRepr(path),
                " has a key of type ", TypeName(key), "; only str, int and bool keys become DCP keys here");
    return std::string(key.toBool() ? "True" : "False");
  }

  std::string file_;
  std::vector<Leaf> leaves_;
  absl::flat_hash_map<std::string, size_t> seen_;
};

}  // namespace

void FromTorch(const std::string& file, const std::string& dir, std::ostream& out) {
  const std::vector<char> bytes = fsdp::checkpoint::ReadFile(file, "from-torch");
  const c10::IValue root = fsdp::checkpoint::ReadCheckpoint(bytes.data(), bytes.size(), "'" + file + "'");
  TORCH_CHECK(root.isGenericDict(), "'", file, "' holds a value of type ", TypeName(root),
              ", not a state dict (a dict)");
  Flattener flattener(file);
  std::vector<DcpPathElement> path;
  flattener.Visit(root, path);
  std::vector<Leaf>& leaves = flattener.leaves();

  std::vector<fsdp::checkpoint::DcpTensorItem> tensors;
  std::vector<fsdp::checkpoint::DcpBytesItem> values;
  for (const Leaf& leaf : leaves) {
    if (leaf.value.isTensor()) {  // one chunk: the whole tensor (one rank, no sharding)
      const at::Tensor& t = leaf.value.toTensor();
      tensors.push_back({leaf.fqn, t.sizes().vec(), t.scalar_type(), std::vector<int64_t>(t.dim(), 0), t});
    } else {
      values.push_back({leaf.fqn, fsdp::checkpoint::WriteCheckpoint(leaf.value)});  // DCP torch.saves a non-tensor
    }
  }
  fsdp::checkpoint::DcpFragment fragment = fsdp::checkpoint::WriteRankData(dir, 0, tensors, values);
  // WriteRankData lists bytes entries first; DCP's metadata follows the flattened state dict
  // (default_planner.py create_default_local_save_plan), with each key's object path.
  absl::flat_hash_map<std::string, size_t> index;
  for (size_t i = 0; i < fragment.entries.size(); ++i) index.emplace(fragment.entries[i].fqn, i);
  std::vector<DcpEntry> ordered;
  for (Leaf& leaf : leaves) {
    ordered.push_back(std::move(fragment.entries[index.at(leaf.fqn)]));
    ordered.back().object_path = std::move(leaf.path);
  }
  fragment.entries = std::move(ordered);
  fsdp::checkpoint::WriteMetadata(dir, {fragment});
  out << "wrote '" << Printable(dir) << "': " << fsdp::checkpoint::DcpDataFileName(0) << " and .metadata, "
      << tensors.size() << " tensors and " << values.size() << " bytes entries\n";
}

// ------------------------------------------------------------------------------------ Run

int Run(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  try {
    if (!args.empty() && (args[0] == "-h" || args[0] == "--help" || args[0] == "help")) {
      out << kUsageText;
      return kOk;
    }
    if (args.empty()) throw UsageError("no subcommand (" + std::string(kCommands) + ")");
    const std::string& command = args[0];
    std::vector<std::string> flags, operands;
    std::map<std::string, std::string> values;  // --flag VALUE or --flag=VALUE
    bool only_operands = false;
    for (size_t i = 1; i < args.size(); ++i) {
      if (!only_operands && args[i] == "--") {
        only_operands = true;
      } else if (!only_operands && args[i].size() > 1 && args[i][0] == '-') {
        const size_t eq = args[i].find('=');
        const std::string name = args[i].substr(0, eq);
        flags.push_back(name);
        if (std::find(std::begin(kValueFlags), std::end(kValueFlags), name) == std::end(kValueFlags)) {
          if (eq != std::string::npos) throw UsageError(absl::StrCat(command, ": ", name, " takes no value"));
          continue;
        }
        if (eq != std::string::npos) {
          values[name] = args[i].substr(eq + 1);
        } else if (i + 1 < args.size()) {
          values[name] = args[++i];
        } else {
          throw UsageError(absl::StrCat(command, ": ", name, " needs a value"));
        }
      } else {
        operands.push_back(args[i]);
      }
    }
    const auto expect = [&](const char* what, size_t n, const std::vector<std::string>& allowed) {
      for (const std::string& f : flags) {
        if (std::find(allowed.begin(), allowed.end(), f) == allowed.end()) {
          throw UsageError(absl::StrCat(command, ": unknown option '", Printable(f), "'"));
        }
      }
      if (operands.size() != n) {
        throw UsageError(absl::StrCat(command, " takes ", what, ", got ", operands.size(),
                                      operands.size() == 1 ? " argument" : " arguments"));
      }
    };
    if (command == "ls") {
      expect("DIR", 1, {});
      List(operands[0], out);
    } else if (command == "to-torch") {
      expect("DIR FILE", 2, {"--skip-unreadable"});
      ToTorch(operands[0], operands[1], !flags.empty(), out);
    } else if (command == "from-torch") {
      expect("FILE DIR", 2, {});
      FromTorch(operands[0], operands[1], out);
    } else if (command == "from-hf") {
      expect("HF_DIR DIR", 2, {"--prefix"});
      FromHuggingFace(operands[0], operands[1], values.count("--prefix") ? values["--prefix"] : "model.", out);
    } else if (command == "to-hf") {
      expect("DIR HF_DIR", 2, {"--prefix", "--dtype", "--max-shard-size"});
      std::optional<at::ScalarType> dtype;
      if (values.count("--dtype")) dtype = ParseDtype(values["--dtype"]);
      const int64_t max_shard_size = values.count("--max-shard-size")
                                         ? fsdp::checkpoint::ParseHfSize(values["--max-shard-size"], "--max-shard-size")
                                         : int64_t{50'000'000'000};
      ToHuggingFace(operands[0], operands[1], values.count("--prefix") ? values["--prefix"] : "model.", dtype,
                    max_shard_size, out);
    } else {
      throw UsageError(absl::StrCat("unknown subcommand '", Printable(command), "' (", kCommands, ")"));
    }
    return kOk;
  } catch (const UsageError& e) {
    err << "dcp: error: " << e.what() << " (dcp --help shows the usage)\n";
    return kUsage;
  } catch (const c10::Error& e) {
    std::string message = e.what_without_backtrace();
    while (!message.empty() && (message.back() == '\n' || message.back() == ' ')) message.pop_back();
    absl::StrReplaceAll({{"\n", " | "}}, &message);
    err << "dcp: error: " << message << "\n";
    return kFailed;
  } catch (const std::exception& e) {  // e.g. std::bad_alloc for a tensor too large for memory
    err << "dcp: error: " << e.what() << "\n";
    return kFailed;
  }
}

}  // namespace dcp_cli
