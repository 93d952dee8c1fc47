// The flight recorder: what each rank issued last, for every backend, in PyTorch's dump format.
//
// Every collective a backend group runs (fake, threaded, Gloo, the c10d adapter incl. NCCL; a
// decorator such as FaultyProcessGroup or CommTrace records nothing itself, its inner group
// does) is recorded as an entry of a bounded ring of its rank: the group's name, description
// and global ranks, a per-group sequence id, the op, input/output sizes and dtypes, the
// state (scheduled, then completed once a wait succeeded) with its times, and who issued it:
// the open profiler ranges of the issuing thread, innermost first, e.g.
// "FSDP::all_gather (layers.3)" inside "FSDP::pre_backward (layers.3)" (comm/profiler_range.h).
//
// A rank's ring is written to `<prefix><rank>` (prefix: TORCH_FR_DUMP_TEMP_FILE, default
// PyTorch's /tmp/nccl_trace_rank_) when one of its collectives times out or fails (a lost peer
// included), when RunMain ends the process after an error (comm/main_guard.h), on SIGUSR1
// where RunMain installed the handler, and on request (DumpFlightRecorders). The bytes are
// the pickle PyTorch 2.15's flight recorder writes (version "2.10": version, pg_config,
// pg_status, entries with PyTorch's field names), so
//   python -m torch.distributed.flight_recorder.fr_trace <dir>
// analyzes them; so does tools/fr_trace without Python.
//
// Configuration (read once per process): TORCH_FR_BUFFER_SIZE entries per rank (default
// 2000, PyTorch's; 0 turns recording off), TORCH_FR_DUMP_TEMP_FILE (the prefix).
//
// Thread-safety: every function is thread-safe (one spin lock per rank's ring; the recording
// path takes it once per collective, without allocating once the ring is warm: it keeps the
// interned profiler labels by pointer and the time-stamp counter as the time).
#ifndef FSDP_COMM_FLIGHT_RECORDER_H_
#define FSDP_COMM_FLIGHT_RECORDER_H_

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::comm {

// A group as a dump lists it (pg_config and pg_status).
struct FlightGroup {
  std::string name;        // "0" for a root group; "<parent>.<k>" for its k-th subgroup
  std::string desc;        // "default_pg" for a root group, "mesh_<dim>", else "undefined"
  std::vector<int> ranks;  // global ranks, in group-rank order
};

// The collectives and point-to-point ops, named in dumps as PyTorch's ProcessGroupNCCL names them.
enum class FlightOp : uint8_t { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kAllToAll, kBarrier, kSend, kRecv };
// "_all_gather_base", "_reduce_scatter_base", "all_reduce", "broadcast", "all_to_all", "barrier",
// "send", "recv".
const char* FlightOpName(FlightOp op);

// A point-to-point op's ranks in its group: dumped as PyTorch's "send <self>-><peer>" /
// "recv <self><-<peer>" with is_p2p and its p2p_seq_id.
struct FlightPeer {
  int self = -1;
  int peer = -1;
};

// Bytes a rank's collectives moved, by op, since the process started: all-gather outputs,
// reduce-scatter inputs, all-reduce / broadcast tensors, all-to-all inputs. Counted whether
// or not recording is on.
struct CollectiveTraffic {
  int64_t all_gather = 0;
  int64_t reduce_scatter = 0;
  int64_t all_reduce = 0;
  int64_t broadcast = 0;
  int64_t all_to_all = 0;
};

// One tensor argument of a collective as recorded.
struct FlightTensor {
  c10::ScalarType dtype;
  c10::IntArrayRef sizes;
};

class FlightRecorder {
 public:
  // The ring of global rank `rank` in this process (created on first use; lives until exit).
  static FlightRecorder& ForRank(int rank);
  // Entries per ring (TORCH_FR_BUFFER_SIZE); 0 when recording is off.
  static int64_t Capacity();
  // The dump file prefix (TORCH_FR_DUMP_TEMP_FILE).
  static std::string DumpPrefix();

  // The handle Record() takes for `group`, whose collectives run on `backend` ("gloo", ...):
  // registered once per group identity (it lists the group in dumps from then on).
  struct GroupSlot;
  GroupSlot* Register(std::shared_ptr<const FlightGroup> group, const std::string& backend);
  // Records an op of a registered group as scheduled and returns its record id, or -1 when
  // recording is off: a collective (this rank's `seq`-th collective in the group, from 1), or
  // with `p2p` a point-to-point op (its `seq`-th send or recv there); `op_id` counts both.
  // `input` / `output`: the op's tensor on each side, or null (a barrier's, a recv's input).
  int64_t Record(GroupSlot* group, int64_t seq, int64_t op_id, FlightOp op, const FlightTensor* input,
                 const FlightTensor* output, std::chrono::milliseconds timeout, const FlightPeer* p2p = nullptr);
  // Adds `bytes` to this rank's traffic of `op` (lock-free).
  void AddTraffic(FlightOp op, int64_t bytes);
  CollectiveTraffic traffic() const;

  // Marks record `id` completed (a wait succeeded); nothing when it left the ring.
  void Complete(int64_t id);

  // The dump: PyTorch's pickle of this rank's entries, oldest first.
  std::string Pickle() const;
  // Writes Pickle() to DumpPrefix() + rank; returns the path. Throws c10::Error naming the
  // path when it cannot be written.
  std::string Dump() const;
  // Dump() after a failure of a collective of this rank, once per `reason` text: prints
  // "[rank R] flight recorder: <reason>; wrote <path>" to stderr. Never throws (a failed
  // write is printed instead). Nothing when recording is off or nothing was recorded.
  void DumpAfterFailure(const std::string& reason) const;

  int rank() const { return rank_; }
  // Entries recorded so far (including those the ring dropped).
  int64_t recorded() const;
  // Drops every entry; groups stay registered, listed again once they record (tests).
  void Reset();

  explicit FlightRecorder(int rank);
  ~FlightRecorder();
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

 private:
  struct Ring;
  int rank_;
  std::unique_ptr<Ring> ring_;
  std::atomic<int64_t> traffic_[8] = {};  // by FlightOp
};

// Dumps every rank of this process that recorded something (Dump() each); returns the paths.
std::vector<std::string> DumpFlightRecorders();
// After an error: DumpAfterFailure(reason) for every rank of this process. Never throws.
void DumpFlightRecordersAfterFailure(const std::string& reason);
// On `signo` (e.g. SIGUSR1), every rank of this process dumps (from a helper thread; the
// handler only writes one byte to a pipe). Installed only where the signal's disposition is
// the default (which would end the process); returns whether it was installed. Idempotent.
bool InstallFlightRecorderDumpSignal(int signo);

}  // namespace fsdp::comm

#endif  // FSDP_COMM_FLIGHT_RECORDER_H_
