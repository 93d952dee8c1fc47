// DiagnoseFlightDumps (tools/fr_trace_lib.h): the analysis of parsed dumps, apart from reading
// them (fr_trace_lib.cc).
#include "tools/fr_trace_lib.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
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

namespace {

// A send or recv of a dump: its channel (group, sender, receiver; global ranks) and itself.
struct PointToPoint {
  std::string group;
  int src = -1, dst = -1;
  bool send = false;
  const FlightEntry* entry = nullptr;
};

// "send 0->1" / "recv 1<-0" (group ranks) as global ranks; false for a name it cannot read or
// ranks outside the group (a dump is untrusted).
bool ParsePointToPoint(const FlightEntry& e, const FlightDump& d, PointToPoint* out) {
  const size_t space = e.profiling_name.rfind(' ');
  if (space == std::string::npos) return false;
  const std::string ranks = e.profiling_name.substr(space + 1);
  out->send = e.op() == "send";
  if (!out->send && e.op() != "recv") return false;
  const size_t arrow = ranks.find(out->send ? "->" : "<-");
  if (arrow == std::string::npos) return false;
  int self = -1, peer = -1;
  try {
    size_t used = 0;
    self = std::stoi(ranks.substr(0, arrow), &used);
    if (used != arrow) return false;
    peer = std::stoi(ranks.substr(arrow + 2), &used);
    if (used != ranks.size() - arrow - 2) return false;
  } catch (const std::exception&) {
    return false;
  }
  auto g = d.groups.find(e.group_name);
  if (g == d.groups.end()) return false;
  const std::vector<int>& members = g->second.ranks;
  if (self < 0 || peer < 0 || self >= static_cast<int>(members.size()) || peer >= static_cast<int>(members.size())) {
    return false;
  }
  out->group = e.group_name;
  out->src = members[out->send ? self : peer];
  out->dst = members[out->send ? peer : self];
  out->entry = &e;
  return true;
}

// Point-to-point ops pair up per (group, sender, receiver) in issue order: the k-th send of a
// channel with its k-th recv. A recv beyond the sends names the rank that never sent (a hung
// pipeline's stage), a send beyond the recvs the rank that never received. Returns the problems.
int DiagnosePointToPoint(const std::vector<FlightDump>& dumps, std::ostream& out) {
  std::set<int> dumped;
  for (const FlightDump& d : dumps) dumped.insert(d.rank);
  std::map<std::tuple<std::string, int, int>,
           std::pair<std::vector<const FlightEntry*>, std::vector<const FlightEntry*>>>
      channels;                                     // (sends, recvs)
  std::set<std::pair<int, std::string>> truncated;  // (rank, group) whose ring dropped early ops
  for (const FlightDump& d : dumps) {
    std::map<std::string, int64_t> first_p2p;
    for (const FlightEntry& e : d.entries) {
      if (!e.is_p2p) continue;
      first_p2p.emplace(e.group_name, e.p2p_seq);
      PointToPoint p;
      if (!ParsePointToPoint(e, d, &p)) {
        out << "rank " << d.rank << ": unreadable point-to-point entry '" << e.profiling_name << "' (skipped)\n";
        continue;
      }
      auto& channel = channels[{p.group, p.src, p.dst}];
      (p.send ? channel.first : channel.second).push_back(p.entry);
    }
    for (const auto& [group, seq] : first_p2p) {
      if (seq != 1) truncated.insert({d.rank, group});
    }
  }
  int problems = 0;
  for (const auto& [key, ops] : channels) {
    const auto& [group, src, dst] = key;
    if (!dumped.count(src) || !dumped.count(dst) || truncated.count({src, group}) || truncated.count({dst, group})) {
      continue;
    }
    const auto& [sends, recvs] = ops;
    if (recvs.size() > sends.size()) {
      const FlightEntry& waiting = *recvs[sends.size()];
      out << "group " << group << ": rank " << dst << " waits in " << waiting.profiling_name << " (p2p #"
          << waiting.p2p_seq << ", " << waiting.state << ") for a send rank " << src << " never issued: rank " << src
          << " sent " << sends.size() << " to rank " << dst << ", rank " << dst << " posted " << recvs.size()
          << " recvs from it\n";
      ++problems;
    } else if (sends.size() > recvs.size()) {
      const FlightEntry& unmatched = *sends[recvs.size()];
      out << "group " << group << ": rank " << src << "'s " << unmatched.profiling_name << " (p2p #"
          << unmatched.p2p_seq << ", " << unmatched.state << ") has no recv: rank " << dst << " posted " << recvs.size()
          << " recvs from rank " << src << ", which sent " << sends.size() << "\n";
      ++problems;
    }
  }
  return problems;
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
  problems += DiagnosePointToPoint(dumps, out);
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
                        : absl::StrCat(problems,
                                       " problem(s): a group with a mismatch or a missing rank, or an unpaired "
                                       "send or recv"))
      << "\n";
  return out.str();
}

}  // namespace fsdp::tools
