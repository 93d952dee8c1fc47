// fr_trace without Python: reads flight recorder dumps (comm/flight_recorder.h, or PyTorch's
// own, pickle protocol 2 to 5 as pickle.load reads them) and says which rank and which
// collective a hang or mismatch comes from, in the words of PyTorch's analyzer
// (python -m torch.distributed.flight_recorder.fr_trace).
//
// Files are untrusted: every reader validates and throws c10::Error naming the file, the
// byte offset or the field and the bad value (fuzz/fr_trace_fuzz.cc); nothing is executed
// (GLOBAL, REDUCE and friends are rejected).
#ifndef FSDP_TOOLS_FR_TRACE_LIB_H_
#define FSDP_TOOLS_FR_TRACE_LIB_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp::tools {

// One collective of one rank's dump.
struct FlightEntry {
  int64_t record_id = 0;
  std::string group_name;      // process_group[0]
  std::string group_desc;      // process_group[1]
  int64_t seq = 0;             // collective_seq_id (0 for a point-to-point op)
  bool is_p2p = false;         // a send or recv ("send 0->1", "recv 1<-0")
  int64_t p2p_seq = 0;         // p2p_seq_id
  std::string profiling_name;  // "gloo:_all_gather_base"
  std::vector<std::vector<int64_t>> input_sizes, output_sizes;
  std::vector<std::string> input_dtypes, output_dtypes;
  std::string state;                         // scheduled, started, completed
  int64_t time_created_ns = 0;               // wall clock, ns since the epoch
  std::optional<int64_t> time_completed_ns;  // time_discovered_completed_ns, None until then
  std::vector<std::string> frames;           // "name" or "name at file:line", innermost first

  // The op after the last ':' and any " peer" suffix ("_all_gather_base").
  std::string op() const;
};

struct FlightGroupConfig {
  std::string desc;
  std::vector<int> ranks;  // global
};

struct FlightDump {
  int rank = 0;
  std::string version;
  std::map<std::string, FlightGroupConfig> groups;  // pg_config by group name
  std::vector<FlightEntry> entries;                 // in record order
};

// Parses one dump's bytes; `rank` is the file's (the number ending its name).
FlightDump ParseFlightDump(std::string_view bytes, int rank, const std::string& what = "flight recorder dump");
// Reads every file in `dir` whose name is `prefix` followed by a rank number (prefix ""
// infers the one prefix all such files share, as PyTorch's loader does).
std::vector<FlightDump> ReadFlightDumps(const std::string& dir, const std::string& prefix = "");

// The analysis: per group, the first collective sequence number some member did not issue
// ("Not all ranks joining collective ...: missing ranks: {2}") or issued differently
// ("Collective sequence number: N has errors ... Culprit rank R; Error type: ..."), with the
// group, the collective, its sizes, its state and its issuer (frames); then, per rank, the
// last collective it enqueued and whether it completed. Ends with one summary line.
std::string DiagnoseFlightDumps(const std::vector<FlightDump>& dumps);

}  // namespace fsdp::tools

#endif  // FSDP_TOOLS_FR_TRACE_LIB_H_
