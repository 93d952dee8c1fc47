// Profiler ranges under PyTorch's names: what torch.profiler.record_function is to PyTorch's
// FSDP ("FSDP::pre_forward (layers.0)"), so a Kineto trace of a C++ step reads like
// PyTorch's. The innermost range of a thread also names who issues the collectives inside it.
//
// Contract: a range is named by a ProfilerLabel, interned for the life of the process, so the
// flight recorder keeps a pointer to the name instead of copying it per collective, and a
// dump after the labelling module is gone still reads it. Build labels once (per FSDP
// parameter group, or a function-local static), not per range: interning takes a mutex.
// Ranges nest per thread and must be destroyed in reverse order (scoped objects). With no
// profiler listening the cost is one check for callbacks (what ATen's dispatcher checks per
// op; skipped inside a range that found none, so a profiler started while a range is open
// sees the ranges opened after it closes) plus a few thread-local writes. Not copyable or
// movable. Thread-safe: labels may be built and ranges opened on any thread.
#ifndef FSDP_COMM_PROFILER_RANGE_H_
#define FSDP_COMM_PROFILER_RANGE_H_

#include <ATen/record_function.h>

#include <optional>
#include <string>
#include <string_view>

namespace fsdp::comm {

// A profiler range's name, interned: equal names share one string that is never freed (so
// the set grows with the distinct names a process uses, e.g. one per FSDP group and phase).
// Default: the empty name. Cheap to copy.
class ProfilerLabel {
 public:
  ProfilerLabel();
  explicit ProfilerLabel(std::string_view name);
  const std::string& str() const { return *name_; }

 private:
  const std::string* name_;
};

class ProfilerRange {
 public:
  explicit ProfilerRange(const ProfilerLabel& label);
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

// The name of the innermost ProfilerRange open on this thread, or nullptr. Names returned
// here and by OpenProfilerRanges are interned (valid for the life of the process).
const std::string* CurrentProfilerRange();

// Up to `max` names of the ranges open on this thread, innermost first, into `names`;
// returns how many (what the flight recorder lists as the issuer of a collective).
int OpenProfilerRanges(const std::string** names, int max);

}  // namespace fsdp::comm

#endif  // FSDP_COMM_PROFILER_RANGE_H_
