#include "comm/flight_recorder.h"

#include <c10/util/Exception.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/internal/entry_clock.h"
#include "comm/internal/interned_string.h"
#include "comm/profiler_range.h"
#include "env/environment.h"
#include "pickle/opcodes.h"
#include "pickle/pickler.h"

namespace fsdp::comm {
namespace {

using internal::Tsc;
using internal::TscKeepsTime;
using internal::WallNs;

// PyTorch's defaults (torch/csrc/distributed/c10d/FlightRecorder.hpp, ProcessGroupNCCL.cpp).
constexpr int64_t kDefaultCapacity = 2000;
constexpr const char* kDefaultPrefix = "/tmp/nccl_trace_rank_";
// The dump format version torch/distributed/flight_recorder/components/loader.py reads.
constexpr const char* kVersion = "2.10";

// The dump's dicts and lists as PyTorch's C++ pickler writes them: EMPTY_DICT / EMPTY_LIST,
// MARK, the items, then SETITEMS / APPENDS.
void BeginDumpDict(pickle::Pickler& w) {
  w.EmptyDict();
  w.Mark();
}
void BeginDumpList(pickle::Pickler& w) {
  w.EmptyList();
  w.Mark();
}
// Names come from users (groups, threads, profiler ranges): one that is not UTF-8, which
// pickle.load could not read, is written C-escaped rather than failing the dump.
void DumpStr(pickle::Pickler& w, std::string_view s) {
  if (pickle::IsUtf8(s)) {
    w.Str(s);
  } else {
    w.Str(absl::CHexEscape(absl::string_view(s.data(), s.size())));
  }
}
// Innermost profiler ranges kept per entry: the collective's own range and its phase.
constexpr int kMaxFrames = 2;

int64_t ReadCapacity() {
  const std::optional<std::string> set = env::Get(env::kTorchFrBufferSize);
  if (!set || set->empty()) return kDefaultCapacity;
  const char* value = set->c_str();
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  TORCH_CHECK(end != nullptr && *end == '\0' && parsed >= 0 && parsed <= (int64_t{1} << 24),
              "TORCH_FR_BUFFER_SIZE must be an entry count in [0, 16777216], got '", value, "'");
  return parsed;
}

// This thread's name, interned for the life of the process (an entry keeps the pointer; the
// thread may end before the dump). Names repeat (pools), so the set stays small.
const std::string* ThisThreadName() {
  thread_local const std::string* name = [] {
    char buffer[64] = {0};
    if (pthread_getname_np(pthread_self(), buffer, sizeof(buffer)) != 0) buffer[0] = '\0';
    return internal::InternString(buffer);
  }();
  return name;
}

}  // namespace

namespace internal {

// The ring's lock: held for a few stores per collective by the rank's thread(s), rarely
// contended (a dump, a second thread of the same rank); a pthread mutex's lock and unlock
// cost several times its instructions (docs/development/benchmarks.md).
class SpinLock {
 public:
  void lock() {
    while (locked_.exchange(true, std::memory_order_acquire)) {
      while (locked_.load(std::memory_order_relaxed)) std::this_thread::yield();
    }
  }
  void unlock() { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

// One tensor argument as recorded: inline, so a ring entry is rewritten without allocating
// (dims beyond kInlineDims spill to a vector that then stays allocated).
struct TensorRecord {
  static constexpr int kInlineDims = 6;
  bool present = false;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int dim = 0;
  int64_t sizes[kInlineDims] = {};
  std::vector<int64_t> more;

  void Assign(const FlightTensor* t) {
    present = t != nullptr;
    if (!present) return;
    dtype = t->dtype;
    dim = static_cast<int>(t->sizes.size());
    const int inline_dims = std::min(dim, kInlineDims);
    std::copy(t->sizes.begin(), t->sizes.begin() + inline_dims, sizes);
    if (dim > kInlineDims) more.assign(t->sizes.begin() + kInlineDims, t->sizes.end());
  }
  void WriteSizes(pickle::Pickler& w) const {
    BeginDumpList(w);
    if (present) {
      BeginDumpList(w);
      for (int i = 0; i < dim; ++i) w.Int(i < kInlineDims ? sizes[i] : more[i - kInlineDims]);
      w.Appends();
    }
    w.Appends();
  }
  void WriteDtypes(pickle::Pickler& w) const {
    BeginDumpList(w);
    if (present) DumpStr(w, c10::toString(dtype));
    w.Appends();
  }
};

}  // namespace internal

// The per-group state a ring keeps for pg_config / pg_status.
struct FlightRecorder::GroupSlot {
  std::shared_ptr<const FlightGroup> group;
  std::string backend;
  int64_t last_enqueued = -1;  // collectives
  int64_t last_completed = -1;
  bool listed = false;  // recorded an op since registration or Reset: in pg_config / pg_status
};

struct FlightRecorder::Ring {
  struct Entry {
    int64_t id = -1;
    GroupSlot* group = nullptr;
    int64_t seq = 0;
    int64_t op_id = 0;
    FlightOp op = FlightOp::kBarrier;
    bool p2p = false;
    FlightPeer peer;
    internal::TensorRecord input;
    internal::TensorRecord output;
    const std::string* frames[kMaxFrames] = {};  // interned profiler labels: never freed
    int frame_count = 0;
    int64_t created_ticks = 0;    // Ring::Ticks()
    int64_t completed_ticks = 0;  // 0 while not completed
    int64_t timeout_ms = 0;
    uint64_t thread_id = 0;
    const std::string* thread_name = nullptr;
  };

  mutable internal::SpinLock mu;
  // Entry times in ticks: the TSC where it keeps time (reading it is one instruction, a clock
  // read a library call; docs/development/benchmarks.md), else the wall clock's ns. A dump
  // converts TSC ticks to wall-clock ns through two (ticks, ns) pairs: `base`, read when the
  // ring was mapped, and one read at the dump; the error is that of two clock reads.
  bool tsc = false;
  int64_t base_ticks = 0, base_ns = 0;
  int64_t Ticks() const { return tsc ? Tsc() : WallNs(); }
  // {Ticks(), WallNs()} read as close together as a few tries get them (a preemption between
  // the two reads would shift every converted time by its length).
  std::pair<int64_t, int64_t> ClockPair() const {
    std::pair<int64_t, int64_t> best{Ticks(), WallNs()};
    if (!tsc) return best;
    int64_t best_gap = INT64_MAX;
    for (int attempt = 0; attempt < 5 && best_gap > 10'000; ++attempt) {
      const int64_t before = WallNs(), ticks = Ticks(), after = WallNs();
      if (after - before < best_gap) best = {ticks, before + (after - before) / 2}, best_gap = after - before;
    }
    return best;
  }
  // Capacity() slots, mapped on the first record and never freed (entries outlive threads and
  // groups). Mapped apart from the heap: a megabyte taken from malloc's heap would move the
  // allocations of everything else (see docs/development/benchmarks.md).
  Entry* entries = nullptr;
  int64_t capacity = 0;

  Entry& Slot(int64_t id) { return entries[id % capacity]; }
  void Map(int64_t n) {
    void* memory = ::mmap(nullptr, sizeof(Entry) * n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(memory != MAP_FAILED, "flight recorder: cannot map ", n,
                " entries (TORCH_FR_BUFFER_SIZE): ", std::strerror(errno));
    entries = static_cast<Entry*>(memory);
    for (int64_t k = 0; k < n; ++k) new (&entries[k]) Entry();
    capacity = n;
    tsc = TscKeepsTime();
    std::tie(base_ticks, base_ns) = ClockPair();
  }
  // Converts ticks to wall-clock ns; `now` = ClockPair() at the dump.
  int64_t ToNs(int64_t ticks, std::pair<int64_t, int64_t> now) const {
    if (!tsc) return ticks;
    const int64_t span = now.first - base_ticks;
    if (span <= 0) return base_ns;
    const long double ns_per_tick = static_cast<long double>(now.second - base_ns) / span;
    return base_ns + static_cast<int64_t>(std::llround(static_cast<long double>(ticks - base_ticks) * ns_per_tick));
  }
  int64_t next_id = 0;
  // In registration order; never erased before Reset (entries point to them).
  std::vector<std::unique_ptr<GroupSlot>> groups;
};

FlightRecorder::FlightRecorder(int rank) : rank_(rank), ring_(std::make_unique<Ring>()) {}
FlightRecorder::~FlightRecorder() = default;

namespace {
std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
// Never destroyed: recorders are referenced by process groups that may outlive statics.
std::map<int, std::unique_ptr<FlightRecorder>>& Registry() {
  static auto* registry = new std::map<int, std::unique_ptr<FlightRecorder>>();
  return *registry;
}
}  // namespace

FlightRecorder& FlightRecorder::ForRank(int rank) {
  TORCH_CHECK(rank >= 0, "FlightRecorder::ForRank: rank must be >= 0, got ", rank);
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto& slot = Registry()[rank];
  if (!slot) slot = std::make_unique<FlightRecorder>(rank);
  return *slot;
}

int64_t FlightRecorder::Capacity() {
  static const int64_t capacity = ReadCapacity();
  return capacity;
}

std::string FlightRecorder::DumpPrefix() {
  const std::optional<std::string> value = env::Get(env::kTorchFrDumpTempFile);
  return value && !value->empty() ? *value : kDefaultPrefix;
}

FlightRecorder::GroupSlot* FlightRecorder::Register(std::shared_ptr<const FlightGroup> group,
                                                    const std::string& backend) {
  std::lock_guard<internal::SpinLock> lock(ring_->mu);
  ring_->groups.push_back(std::make_unique<GroupSlot>());
  ring_->groups.back()->group = std::move(group);
  ring_->groups.back()->backend = backend;
  return ring_->groups.back().get();
}

int64_t FlightRecorder::Record(GroupSlot* group, int64_t seq, int64_t op_id, FlightOp op, const FlightTensor* input,
                               const FlightTensor* output, std::chrono::milliseconds timeout, const FlightPeer* p2p) {
  const int64_t capacity = Capacity();
  if (capacity == 0) return -1;
  const std::string* ranges[kMaxFrames];
  const int frame_count = OpenProfilerRanges(ranges, kMaxFrames);  // interned: kept by pointer
  const std::string* thread_name = ThisThreadName();
  std::lock_guard<internal::SpinLock> lock(ring_->mu);
  // Allocated once: from the first collective on recording does not allocate.
  if (ring_->entries == nullptr) ring_->Map(capacity);
  const int64_t now = ring_->Ticks();
  if (p2p == nullptr) group->last_enqueued = seq;
  group->listed = true;
  const int64_t id = ring_->next_id++;
  Ring::Entry& e = ring_->Slot(id);
  e.id = id;
  e.group = group;
  e.seq = seq;
  e.op_id = op_id;
  e.op = op;
  e.p2p = p2p != nullptr;
  e.peer = p2p != nullptr ? *p2p : FlightPeer{};
  e.input.Assign(input);
  e.output.Assign(output);
  for (int i = 0; i < frame_count; ++i) e.frames[i] = ranges[i];
  e.frame_count = frame_count;
  e.created_ticks = now;
  e.completed_ticks = 0;
  e.timeout_ms = timeout.count();
  e.thread_id = static_cast<uint64_t>(pthread_self());
  e.thread_name = thread_name;
  return id;
}

const char* FlightOpName(FlightOp op) {
  switch (op) {
    case FlightOp::kAllGather: return "_all_gather_base";
    case FlightOp::kReduceScatter: return "_reduce_scatter_base";
    case FlightOp::kAllReduce: return "all_reduce";
    case FlightOp::kBroadcast: return "broadcast";
    case FlightOp::kAllToAll: return "all_to_all";
    case FlightOp::kBarrier: return "barrier";
    case FlightOp::kSend: return "send";
    case FlightOp::kRecv: return "recv";
  }
  return "unknown";
}

void FlightRecorder::AddTraffic(FlightOp op, int64_t bytes) {
  traffic_[static_cast<int>(op)].fetch_add(bytes, std::memory_order_relaxed);
}

CollectiveTraffic FlightRecorder::traffic() const {
  auto get = [&](FlightOp op) { return traffic_[static_cast<int>(op)].load(std::memory_order_relaxed); };
  return {get(FlightOp::kAllGather), get(FlightOp::kReduceScatter), get(FlightOp::kAllReduce),
          get(FlightOp::kBroadcast), get(FlightOp::kAllToAll)};
}

void FlightRecorder::Complete(int64_t id) {
  if (id < 0) return;
  std::lock_guard<internal::SpinLock> lock(ring_->mu);
  if (ring_->entries == nullptr) return;
  Ring::Entry& e = ring_->Slot(id);
  if (e.id != id || e.completed_ticks != 0) return;
  e.completed_ticks = ring_->Ticks();
  if (!e.p2p) e.group->last_completed = std::max(e.group->last_completed, e.seq);
}

int64_t FlightRecorder::recorded() const {
  std::lock_guard<internal::SpinLock> lock(ring_->mu);
  return ring_->next_id;
}

void FlightRecorder::Reset() {
  std::lock_guard<internal::SpinLock> lock(ring_->mu);
  for (int64_t k = 0; k < ring_->capacity; ++k) ring_->entries[k].id = -1;
  ring_->next_id = 0;
  // Process groups keep their slots: a slot stays, unlisted until its group records again.
  for (auto& slot : ring_->groups) {
    slot->last_enqueued = slot->last_completed = -1;
    slot->listed = false;
  }
}

std::string FlightRecorder::Pickle() const {
  pickle::Pickler w("flight recorder dump");
  std::lock_guard<internal::SpinLock> lock(ring_->mu);
  const std::pair<int64_t, int64_t> now = ring_->ClockPair();
  BeginDumpDict(w);
  DumpStr(w, "version");
  DumpStr(w, kVersion);
  DumpStr(w, "pg_config");
  BeginDumpDict(w);
  for (const auto& slot : ring_->groups) {
    if (!slot->listed) continue;  // nothing recorded since registration or Reset
    const FlightGroup& g = *slot->group;
    DumpStr(w, g.name);
    BeginDumpDict(w);
    DumpStr(w, "name");
    DumpStr(w, g.name);
    DumpStr(w, "desc");
    DumpStr(w, g.desc);
    // A string, as PyTorch writes it (the analyzer literal_evals it).
    DumpStr(w, "ranks");
    DumpStr(w, absl::StrCat("[", absl::StrJoin(g.ranks, ", "), "]"));
    w.SetItems();
  }
  w.SetItems();
  DumpStr(w, "comm_lib_version");
  DumpStr(w, "");
  DumpStr(w, "pg_status");
  BeginDumpDict(w);
  for (const auto& slot : ring_->groups) {
    if (!slot->listed) continue;
    DumpStr(w, slot->group->name);
    BeginDumpDict(w);
    DumpStr(w, "last_enqueued_collective");
    w.Int(slot->last_enqueued);
    DumpStr(w, "last_started_collective");
    w.Int(-1);  // no backend here reports a start apart from completion
    DumpStr(w, "last_completed_collective");
    w.Int(slot->last_completed);
    w.SetItems();
  }
  w.SetItems();
  DumpStr(w, "entries");
  BeginDumpList(w);
  const int64_t capacity = ring_->capacity;
  for (int64_t id = std::max<int64_t>(0, ring_->next_id - capacity); id < ring_->next_id; ++id) {
    const Ring::Entry& e = ring_->Slot(id);
    const FlightGroup& g = *e.group->group;
    BeginDumpDict(w);
    DumpStr(w, "record_id");
    w.Int(e.id);
    DumpStr(w, "pg_id");
    w.Int(0);  // ProcessGroupNCCL's uid_, which no analysis reads; the group is process_group
    DumpStr(w, "process_group");
    DumpStr(w, g.name);
    DumpStr(w, g.desc);
    w.Tuple2();
    DumpStr(w, "collective_seq_id");
    w.Int(e.p2p ? 0 : e.seq);
    DumpStr(w, "p2p_seq_id");
    w.Int(e.p2p ? e.seq : 0);
    DumpStr(w, "op_id");
    w.Int(e.op_id);
    DumpStr(w, "profiling_name");
    if (!e.p2p) {
      DumpStr(w, absl::StrCat(e.group->backend, ":", FlightOpName(e.op)));
    } else {
      DumpStr(w, absl::StrCat(e.group->backend, ":", FlightOpName(e.op), " ", e.peer.self,
                              e.op == FlightOp::kSend ? "->" : "<-", e.peer.peer));
    }
    DumpStr(w, "time_created_ns");
    w.Int(ring_->ToNs(e.created_ticks, now));
    DumpStr(w, "input_sizes");
    e.input.WriteSizes(w);
    DumpStr(w, "input_dtypes");
    e.input.WriteDtypes(w);
    DumpStr(w, "output_sizes");
    e.output.WriteSizes(w);
    DumpStr(w, "output_dtypes");
    e.output.WriteDtypes(w);
    DumpStr(w, "state");
    DumpStr(w, e.completed_ticks != 0 ? "completed" : "scheduled");
    DumpStr(w, "time_discovered_started_ns");
    w.None();
    DumpStr(w, "time_discovered_completed_ns");
    if (e.completed_ticks != 0) {
      w.Int(ring_->ToNs(e.completed_ticks, now));
    } else {
      w.None();
    }
    DumpStr(w, "retired");
    w.Bool(e.completed_ticks != 0);
    DumpStr(w, "timeout_ms");
    w.Int(e.timeout_ms);
    DumpStr(w, "is_p2p");
    w.Bool(e.p2p);
    DumpStr(w, "thread_id");
    DumpStr(w, std::to_string(e.thread_id));
    DumpStr(w, "thread_name");
    DumpStr(w, *e.thread_name);
    // Who issued it: the open profiler ranges, innermost first (PyTorch: the Python stack).
    DumpStr(w, "frames");
    BeginDumpList(w);
    for (int i = 0; i < e.frame_count; ++i) {
      BeginDumpDict(w);
      DumpStr(w, "name");
      DumpStr(w, *e.frames[i]);
      DumpStr(w, "filename");
      DumpStr(w, "");
      DumpStr(w, "line");
      w.Int(0);
      w.SetItems();
    }
    w.Appends();
    w.SetItems();
  }
  w.Appends();
  w.SetItems();
  const std::vector<char> bytes = w.Finish();
  return std::string(bytes.begin(), bytes.end());
}

std::string FlightRecorder::Dump() const {
  const std::string path = DumpPrefix() + std::to_string(rank_);
  const std::string bytes = Pickle();
  // Written beside the target, then renamed: a reader never sees half a dump.
  const std::string partial = path + ".partial";
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out.good(), "flight recorder: cannot open ", partial, " for writing: ", std::strerror(errno));
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    TORCH_CHECK(out.good(), "flight recorder: cannot write ", partial, ": ", std::strerror(errno));
  }
  TORCH_CHECK(std::rename(partial.c_str(), path.c_str()) == 0, "flight recorder: cannot rename ", partial, " to ", path,
              ": ", std::strerror(errno));
  return path;
}

namespace {
// PyTorch's knob for the dump after a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT, default on); "0"
// turns the dumps after failures off (the test suite does: it injects failures by the
// hundred). Read at each failure, so a program may change it.
bool DumpAfterFailureEnabled() { return env::Get(env::kTorchNcclDumpOnTimeout) != std::optional<std::string>("0"); }
}  // namespace

void FlightRecorder::DumpAfterFailure(const std::string& reason) const {
  if (Capacity() == 0 || recorded() == 0 || !DumpAfterFailureEnabled()) return;
  try {
    const std::string path = Dump();
    std::fprintf(stderr, "[rank %d] flight recorder: %s; wrote %s\n", rank_, reason.c_str(), path.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] flight recorder: %s; no dump: %s\n", rank_, reason.c_str(), e.what());
  }
}

namespace {
std::vector<FlightRecorder*> RecordersWithEntries() {
  std::vector<FlightRecorder*> out;
  std::lock_guard<std::mutex> lock(RegistryMutex());
  for (auto& [_, recorder] : Registry()) {
    if (recorder->recorded() > 0) out.push_back(recorder.get());
  }
  return out;
}
}  // namespace

std::vector<std::string> DumpFlightRecorders() {
  std::vector<std::string> paths;
  for (FlightRecorder* recorder : RecordersWithEntries()) paths.push_back(recorder->Dump());
  return paths;
}

void DumpFlightRecordersAfterFailure(const std::string& reason) {
  try {
    for (FlightRecorder* recorder : RecordersWithEntries()) recorder->DumpAfterFailure(reason);
  } catch (...) {
    // Never let a dump turn an error exit into another error.
  }
}

namespace {
int signal_pipe[2] = {-1, -1};

void OnDumpSignal(int) {
  const char byte = 1;
  // Async-signal-safe: the helper thread does the work.
  [[maybe_unused]] ssize_t n = ::write(signal_pipe[1], &byte, 1);
}
}  // namespace

bool InstallFlightRecorderDumpSignal(int signo) {
  static std::mutex mu;
  static std::map<int, bool> installed;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = installed.find(signo); it != installed.end()) return it->second;
  struct sigaction current {};
  TORCH_CHECK(::sigaction(signo, nullptr, &current) == 0, "InstallFlightRecorderDumpSignal: signo ", signo,
              " is not a signal: ", std::strerror(errno));
  if (current.sa_handler != SIG_DFL || (current.sa_flags & SA_SIGINFO) != 0) return installed[signo] = false;
  if (signal_pipe[0] < 0) {
    TORCH_CHECK(::pipe(signal_pipe) == 0, "InstallFlightRecorderDumpSignal: pipe failed: ", std::strerror(errno));
    std::thread([] {
      char byte;
      while (::read(signal_pipe[0], &byte, 1) == 1) {
        try {
          for (const std::string& path : DumpFlightRecorders()) {
            std::fprintf(stderr, "flight recorder: on request, wrote %s\n", path.c_str());
          }
        } catch (const std::exception& e) {
          std::fprintf(stderr, "flight recorder: on request, no dump: %s\n", e.what());
        }
      }
    }).detach();
  }
  struct sigaction action {};
  action.sa_handler = OnDumpSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  TORCH_CHECK(::sigaction(signo, &action, nullptr) == 0, "InstallFlightRecorderDumpSignal: sigaction(", signo,
              ") failed: ", std::strerror(errno));
  return installed[signo] = true;
}

}  // namespace fsdp::comm
