#include "tools/fr_trace_lib.h"

#include <c10/util/Exception.h>
#include <dirent.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pickle/py_value.h"

namespace fsdp::tools {
namespace {

// Bounds on untrusted dumps: far above what a ring of PyTorch's maximum size holds.
constexpr size_t kMaxDumpBytes = size_t{1} << 30;
constexpr size_t kMaxListedRanks = size_t{1} << 22;

using pickle::PyRef;
using pickle::PyValue;
using Kind = PyValue::Kind;

// ------------------------------------------------------------------ typed access

class Reader {
 public:
  explicit Reader(const std::string& what) : what_(what) {}

  // nullptr when `dict` has no `key`.
  const PyValue* FieldOrNull(const PyValue& dict, const char* key, const std::string& where) const {
    Typed(dict, Kind::kDict, where);
    for (size_t k = 0; k < dict.items.size(); k += 2) {
      const PyValue& name = *dict.items[k];
      if (name.kind == Kind::kStr && name.str == key) return dict.items[k + 1].get();
    }
    return nullptr;
  }
  const PyValue& Field(const PyValue& dict, const char* key, const std::string& where) const {
    const PyValue* v = FieldOrNull(dict, key, where);
    TORCH_CHECK(v != nullptr, what_, ": ", where, " has no '", key, "'");
    return *v;
  }
  const PyValue& Typed(const PyValue& v, Kind kind, const std::string& where) const {
    TORCH_CHECK(v.kind == kind, what_, ": ", where, " is ", pickle::Describe(v.kind), ", expected ",
                pickle::Describe(kind));
    return v;
  }
  std::string Str(const PyValue& dict, const char* key, const std::string& where) const {
    return Typed(Field(dict, key, where), Kind::kStr, absl::StrCat(where, ".", key)).str;
  }
  int64_t Int(const PyValue& dict, const char* key, const std::string& where) const {
    return Typed(Field(dict, key, where), Kind::kInt, absl::StrCat(where, ".", key)).i;
  }
  const std::vector<PyRef>& Items(const PyValue& v, const std::string& where) const {
    TORCH_CHECK(v.kind == Kind::kList || v.kind == Kind::kTuple, what_, ": ", where, " is ", pickle::Describe(v.kind),
                ", expected a list");
    return v.items;
  }
  std::vector<std::vector<int64_t>> Sizes(const PyValue& dict, const char* key, const std::string& where) const {
    std::vector<std::vector<int64_t>> out;
    const std::string field = absl::StrCat(where, ".", key);
    for (const PyRef& shape : Items(Field(dict, key, where), field)) {
      out.emplace_back();
      for (const PyRef& d : Items(*shape, field)) out.back().push_back(Typed(*d, Kind::kInt, field).i);
    }
    return out;
  }
  std::vector<std::string> Strs(const PyValue& dict, const char* key, const std::string& where) const {
    std::vector<std::string> out;
    const std::string field = absl::StrCat(where, ".", key);
    for (const PyRef& s : Items(Field(dict, key, where), field)) out.push_back(Typed(*s, Kind::kStr, field).str);
    return out;
  }

 private:
  const std::string& what_;
};

// pg_config ranks: the string "[0, 1, 2]" (as PyTorch writes it) or a list of ints.
std::vector<int> ParseRanks(const PyValue& v, const std::string& what, const std::string& where) {
  std::vector<int> ranks;
  if (v.kind == Kind::kList || v.kind == Kind::kTuple) {
    for (const PyRef& r : v.items) {
      TORCH_CHECK(r->kind == Kind::kInt && r->i >= 0 && r->i <= INT32_MAX, what, ": ", where,
                  " holds a rank that is not a non-negative int");
      ranks.push_back(static_cast<int>(r->i));
    }
    return ranks;
  }
  TORCH_CHECK(v.kind == Kind::kStr, what, ": ", where, " is ", pickle::Describe(v.kind), ", expected '[0, 1, ...]'");
  const std::string& s = v.str;
  TORCH_CHECK(s.size() >= 2 && s.front() == '[' && s.back() == ']', what, ": ", where, " = '", s,
              "' is not a list of ranks");
  std::string body = s.substr(1, s.size() - 2);
  std::stringstream in(body);
  std::string token;
  while (std::getline(in, token, ',')) {
    const size_t b = token.find_first_not_of(' ');
    const size_t e = token.find_last_not_of(' ');
    TORCH_CHECK(b != std::string::npos, what, ": ", where, " = '", s, "' has an empty rank");
    token = token.substr(b, e - b + 1);
    TORCH_CHECK(!token.empty() && token.size() <= 9 && token.find_first_not_of("0123456789") == std::string::npos, what,
                ": ", where, " = '", s, "' holds '", token, "', not a rank");
    ranks.push_back(std::stoi(token));
  }
  return ranks;
}

}  // namespace

std::string FlightEntry::op() const {
  const size_t colon = profiling_name.rfind(':');
  std::string name = colon == std::string::npos ? profiling_name : profiling_name.substr(colon + 1);
  return name.substr(0, name.find(' '));
}

FlightDump ParseFlightDump(std::string_view bytes, int rank, const std::string& what) {
  TORCH_CHECK(bytes.size() <= kMaxDumpBytes, what, ": ", bytes.size(), " bytes is more than a dump holds");
  const PyRef root_ref = pickle::UnpicklePlainData(bytes, what + ": ");
  const PyValue& root = *root_ref;
  Reader r(what);
  FlightDump dump;
  dump.rank = rank;
  dump.version = r.Str(root, "version", "the dump");
  const PyValue& config = r.Typed(r.Field(root, "pg_config", "the dump"), Kind::kDict, "pg_config");
  // Parsed once per value: a pickle may reference one ranks string from every group (memo).
  std::map<const PyValue*, std::vector<int>> parsed_ranks;
  size_t total_ranks = 0;
  for (size_t k = 0; k < config.items.size(); k += 2) {
    const std::string name = r.Typed(*config.items[k], Kind::kStr, "a pg_config key").str;
    const PyValue& group = *config.items[k + 1];
    const std::string where = absl::StrCat("pg_config['", name, "']");
    FlightGroupConfig g;
    g.desc = r.Str(group, "desc", where);
    const PyValue& ranks = r.Field(group, "ranks", where);
    auto it = parsed_ranks.find(&ranks);
    if (it == parsed_ranks.end()) it = parsed_ranks.emplace(&ranks, ParseRanks(ranks, what, where + ".ranks")).first;
    g.ranks = it->second;
    total_ranks += g.ranks.size();
    TORCH_CHECK(total_ranks <= kMaxListedRanks, what, ": pg_config lists more than ", kMaxListedRanks,
                " ranks in all groups (a rank is in a few groups of at most the world)");
    dump.groups[name] = std::move(g);
  }
  const auto& entries = r.Items(r.Field(root, "entries", "the dump"), "entries");
  for (size_t k = 0; k < entries.size(); ++k) {
    const PyValue& e = *entries[k];
    const std::string where = absl::StrCat("entries[", k, "]");
    FlightEntry entry;
    entry.record_id = r.Int(e, "record_id", where);
    const auto& pg = r.Items(r.Field(e, "process_group", where), where + ".process_group");
    TORCH_CHECK(pg.size() == 2, what, ": ", where, ".process_group has ", pg.size(), " items, expected (name, desc)");
    entry.group_name = r.Typed(*pg[0], Kind::kStr, where + ".process_group[0]").str;
    entry.group_desc = r.Typed(*pg[1], Kind::kStr, where + ".process_group[1]").str;
    entry.seq = r.Int(e, "collective_seq_id", where);
    entry.profiling_name = r.Str(e, "profiling_name", where);
    // Absent from dumps of versions before point-to-point ops were recorded.
    if (const PyValue* p2p = r.FieldOrNull(e, "is_p2p", where); p2p != nullptr) {
      entry.is_p2p = r.Typed(*p2p, Kind::kBool, where + ".is_p2p").b;
      entry.p2p_seq = r.Int(e, "p2p_seq_id", where);
    }
    entry.input_sizes = r.Sizes(e, "input_sizes", where);
    entry.output_sizes = r.Sizes(e, "output_sizes", where);
    entry.input_dtypes = r.Strs(e, "input_dtypes", where);
    entry.output_dtypes = r.Strs(e, "output_dtypes", where);
    entry.state = r.Str(e, "state", where);
    entry.time_created_ns = r.Int(e, "time_created_ns", where);
    const PyValue& completed = r.Field(e, "time_discovered_completed_ns", where);
    if (completed.kind != Kind::kNone) {
      entry.time_completed_ns = r.Typed(completed, Kind::kInt, where + ".time_discovered_completed_ns").i;
    }
    // Absent from PyTorch's dumps without stack traces.
    const PyValue* frames_value = r.FieldOrNull(e, "frames", where);
    static const std::vector<PyRef> kNoFrames;
    const auto& frames = frames_value == nullptr ? kNoFrames : r.Items(*frames_value, where + ".frames");
    for (size_t f = 0; f < frames.size(); ++f) {
      const std::string fw = absl::StrCat(where, ".frames[", f, "]");
      std::string frame = r.Str(*frames[f], "name", fw);
      const std::string file = r.Str(*frames[f], "filename", fw);
      if (!file.empty()) absl::StrAppend(&frame, " at ", file, ":", r.Int(*frames[f], "line", fw));
      entry.frames.push_back(std::move(frame));
    }
    dump.entries.push_back(std::move(entry));
  }
  return dump;
}

std::vector<FlightDump> ReadFlightDumps(const std::string& dir, const std::string& prefix_in) {
  DIR* d = ::opendir(dir.c_str());
  TORCH_CHECK(d != nullptr, "fr_trace: cannot read directory ", dir, ": ", std::strerror(errno));
  std::vector<std::string> files;
  while (const dirent* ent = ::readdir(d)) {
    const std::string name = ent->d_name;
    if (name != "." && name != "..") files.push_back(name);
  }
  ::closedir(d);
  std::sort(files.begin(), files.end());
  // A dump's name is <prefix><rank>.
  auto split = [](const std::string& name) -> std::pair<std::string, std::string> {
    size_t k = name.size();
    while (k > 0 && std::isdigit(static_cast<unsigned char>(name[k - 1]))) --k;
    return {name.substr(0, k), name.substr(k)};
  };
  std::string prefix = prefix_in;
  if (prefix.empty()) {
    std::set<std::string> prefixes;
    for (const auto& f : files) {
      auto [p, digits] = split(f);
      if (!digits.empty()) prefixes.insert(p);
    }
    TORCH_CHECK(prefixes.size() == 1, "fr_trace: cannot infer the dump file prefix in ", dir, " (candidates: [",
                absl::StrJoin(prefixes, ", "), "]); pass --prefix");
    prefix = *prefixes.begin();
  }
  std::vector<FlightDump> dumps;
  for (const auto& f : files) {
    auto [p, digits] = split(f);
    if (p != prefix || digits.empty()) continue;
    TORCH_CHECK(digits.size() <= 9, "fr_trace: ", f, ": rank ", digits, " is out of range");
    const std::string path = dir + "/" + f;
    std::ifstream in(path, std::ios::binary);
    TORCH_CHECK(in.good(), "fr_trace: cannot open ", path);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    dumps.push_back(ParseFlightDump(bytes, std::stoi(digits), path));
  }
  TORCH_CHECK(!dumps.empty(), "fr_trace: no dump named ", prefix, "<rank> in ", dir);
  return dumps;
}

}  // namespace fsdp::tools
