// DiagnoseFlightDumps (tools/fr_trace_lib.h): the analysis of parsed dumps, apart from reading
// them (fr_trace_lib.cc).
#include "tools/fr_trace_lib.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp::tools {
namespace {
std::string FormatSizes(const std::vector<std::vector<int64_t>>& sizes) {
  std::vector<std::string> parts;
  for (const auto& s : sizes) parts.push_back(absl::StrCat("[", absl::StrJoin(s, ", "), "]"));
  return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
}

std::string FormatRanks(const std::set<int>& ranks) { return absl::StrCat("{", absl::StrJoin(ranks, ", "), "}"); }

void DescribeEntry(std::ostringstream& out, const FlightEntry& e, const std::string& group_name,
                   const FlightGroupConfig& group) {
  out << "internal record id: " << e.record_id << "\n";
  out << "group info: " << group_name << ":" << group.desc << "\n";
  out << "collective: " << e.profiling_name << "\n";
}

void DescribeTail(std::ostringstream& out, const FlightEntry& e, const FlightGroupConfig& group) {
  out << "input sizes: " << FormatSizes(e.input_sizes) << "\n";
  out << "output sizes: " << FormatSizes(e.output_sizes) << "\n";
  out << "world size: " << group.ranks.size() << "\n";
  out << "expected ranks: " << FormatRanks(std::set<int>(group.ranks.begin(), group.ranks.end())) << "\n";
  out << "collective state: " << e.state << "\n";
  out << "collective stack trace: \n " << absl::StrJoin(e.frames, "\n") << "\n";
}

// What makes two ranks' entries the same collective.
std::string Signature(const FlightEntry& e) {
  return absl::StrCat(e.op(), " in ", FormatSizes(e.input_sizes), " out ", FormatSizes(e.output_sizes), " ",
                      absl::StrJoin(e.input_dtypes, ","), "/", absl::StrJoin(e.output_dtypes, ","));
}

const char* MismatchType(const FlightEntry& expected, const FlightEntry& found) {
  if (expected.op() != found.op()) return "COLLECTIVE_TYPE_MISMATCH";
  if (expected.input_sizes != found.input_sizes || expected.output_sizes != found.output_sizes) {
    return "SIZE_OR_SYNTAX_MISMATCH";
  }
  return "COLLECTIVE_DTYPE_MISMATCH";
}

}  // namespace

std::string DiagnoseFlightDumps(const std::vector<FlightDump>& dumps) {
  std::ostringstream out;
  std::map<int, const FlightDump*> by_rank;
  for (const FlightDump& d : dumps) {
    TORCH_CHECK(by_rank.emplace(d.rank, &d).second, "fr_trace: two dumps of rank ", d.rank);
  }
  // Groups by name and members (PyTorch's analyzer keys them so too).
  std::map<std::pair<std::string, std::vector<int>>, FlightGroupConfig> groups;
  for (const FlightDump& d : dumps) {
    for (const auto& [name, g] : d.groups) groups.emplace(std::make_pair(name, g.ranks), g);
  }
  // Each dump's entries by group name, in record order.
  std::map<int, std::map<std::string, std::vector<const FlightEntry*>>> by_group;
  for (const FlightDump& d : dumps) {
    // Collectives only: sends and recvs are not in a group's collective order.
    for (const FlightEntry& e : d.entries) {
      if (!e.is_p2p) by_group[d.rank][e.group_name].push_back(&e);
    }
  }
  int problems = 0;
  for (const auto& [key, group] : groups) {
    const std::string& name = key.first;
    // Each member's entries in this group, by sequence number.
    std::map<int, std::map<int64_t, const FlightEntry*>> seqs;
    std::set<int> without_dump;  // the first few
    size_t without_dump_count = 0;
    for (int r : group.ranks) {
      auto it = by_rank.find(r);
      if (it == by_rank.end()) {
        if (++without_dump_count <= 16) without_dump.insert(r);
        continue;
      }
      // A member that never issued in the group has no pg_config entry for it: still a member.
      auto& mine = seqs[r];
      auto config = it->second->groups.find(name);
      if (config != it->second->groups.end() && config->second.ranks != group.ranks) continue;
      for (const FlightEntry* e : by_group[r][name]) mine[e->seq] = e;
    }
    if (without_dump_count > 0) {
      out << "group " << name << ":" << group.desc << ": no dump from ranks " << FormatRanks(without_dump)
          << (without_dump_count > without_dump.size()
                  ? absl::StrCat(" and ", without_dump_count - without_dump.size(), " more")
                  : "")
          << " (analysis of the others only)\n";
      ++problems;
    }
    if (seqs.empty()) continue;
    // The ring may have dropped early entries: start where every rank still has them. Only
    // the sequence numbers some rank recorded are visited (a dump's numbers are untrusted).
    int64_t first = INT64_MIN;
    std::set<int64_t> recorded;
    for (const auto& [r, m] : seqs) {
      if (m.empty()) continue;
      first = std::max(first, m.begin()->first);
      for (const auto& [seq, _] : m) recorded.insert(seq);
    }
    for (auto it = recorded.lower_bound(first); it != recorded.end(); ++it) {
      const int64_t seq = *it;
      std::map<std::string, std::set<int>> by_signature;
      std::set<int> missing;
      const FlightEntry* example = nullptr;
      for (const auto& [r, m] : seqs) {
        auto it = m.find(seq);
        if (it == m.end()) {
          missing.insert(r);
          continue;
        }
        by_signature[Signature(*it->second)].insert(r);
        if (example == nullptr) example = it->second;
      }
      if (example == nullptr) continue;
      if (!missing.empty()) {
        out << "Not all ranks joining collective, sequence number: " << seq << "\n";
        DescribeEntry(out, *example, name, group);
        out << "missing ranks: " << FormatRanks(missing) << "\n";
        DescribeTail(out, *example, group);
        for (int r : missing) {
          const auto& m = seqs[r];
          if (m.empty()) {
            out << "rank " << r << " issued nothing in this group\n";
          } else {
            const FlightEntry& e = *m.rbegin()->second;
            out << "rank " << r << " last issued sequence number " << e.seq << ": " << e.profiling_name << " ("
                << e.state << ")" << (e.frames.empty() ? "" : " from " + e.frames.front()) << "\n";
          }
        }
        ++problems;
        break;
      }
      if (by_signature.size() > 1) {
        // The culprits: the ranks outside the largest agreeing set.
        auto majority = std::max_element(by_signature.begin(), by_signature.end(), [](const auto& a, const auto& b) {
          return a.second.size() < b.second.size();
        });
        const FlightEntry* expected = seqs[*majority->second.begin()][seq];
        std::set<int> culprits;
        const FlightEntry* found = nullptr;
        for (const auto& [signature, ranks] : by_signature) {
          if (signature == majority->first) continue;
          culprits.insert(ranks.begin(), ranks.end());
          if (found == nullptr) found = seqs[*ranks.begin()][seq];
        }
        out << "Collective sequence number: " << seq << " has errors\n";
        DescribeEntry(out, *expected, name, group);
        DescribeTail(out, *expected, group);
        out << "error msg: Culprit rank " << absl::StrJoin(culprits, ", ")
            << "; Error type: " << MismatchType(*expected, *found) << ", Expected '" << Signature(*expected)
            << "' does not match found '" << Signature(*found) << "'"
            << (found->frames.empty() ? "" : " from " + found->frames.front()) << "\n";
        ++problems;
        break;
      }
    }
  }
  // Where each rank stands.
  for (const FlightDump& d : dumps) {
    if (d.entries.empty()) {
      out << "rank " << d.rank << ": no collectives recorded\n";
      continue;
    }
    const FlightEntry& e = d.entries.back();
    out << "rank " << d.rank << ": last " << (e.is_p2p ? "op " : "collective ") << e.profiling_name << " #"
        << (e.is_p2p ? e.p2p_seq : e.seq) << " in group " << e.group_name << " (" << e.state << ")"
        << (e.frames.empty() ? "" : " from " + e.frames.front()) << "\n";
  }
  out << (problems == 0 ? "no mismatch: every group's collectives agree on all ranks that dumped"
                        : absl::StrCat(problems, " group(s) with a mismatch or a missing rank"))
      << "\n";
  return out.str();
}

}  // namespace fsdp::tools
