// Profiler ranges under PyTorch's names: what torch.profiler.record_function is to PyTorch's
// FSDP ("FSDP::pre_forward (layers.0)"), so a Kineto trace of a C++ step reads like
// PyTorch's. The innermost range of a thread also names who issues the collectives inside it.
//
// Contract: `name` must outlive the range (callers build their labels once, e.g. per FSDP
// parameter group). Ranges nest per thread and must be destroyed in reverse order (scoped
// objects). With no profiler listening the cost is one check for callbacks (what ATen's
// dispatcher checks per op; skipped inside a range that found none, so a profiler started
// while a range is open sees the ranges opened after it closes) plus a few thread-local
// writes. Not copyable or movable.
#ifndef FSDP_COMM_PROFILER_RANGE_H_
#define FSDP_COMM_PROFILER_RANGE_H_

#include <ATen/record_function.h>

#include <optional>
#include <string>

namespace fsdp::comm {

class ProfilerRange {
 public:
  explicit ProfilerRange(const std::string& name);
  ~ProfilerRange();
  ProfilerRange(const ProfilerRange&) = delete;
  ProfilerRange& operator=(const ProfilerRange&) = delete;

 private:
  friend int OpenProfilerRanges(const std::string** names, int max);
  friend const std::string* CurrentProfilerRange();

  std::optional<at::RecordFunction> record_;  // only while a profiler listens
  const std::string* name_;
  const ProfilerRange* enclosing_;
  bool enclosing_unprofiled_;
};

// The name of the innermost ProfilerRange open on this thread, or nullptr.
const std::string* CurrentProfilerRange();

// Up to `max` names of the ranges open on this thread, innermost first, into `names`;
// returns how many (what the flight recorder lists as the issuer of a collective).
int OpenProfilerRanges(const std::string** names, int max);

}  // namespace fsdp::comm

#endif  // FSDP_COMM_PROFILER_RANGE_H_
