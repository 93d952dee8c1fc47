#include "comm/profiler_range.h"

#include <utility>

#include "comm/internal/interned_string.h"

namespace fsdp::comm {
namespace {

thread_local const ProfilerRange* innermost = nullptr;
// Whether the innermost open range found no profiler listening: ranges nested in it (an
// FSDP pre-forward's all-gather and copy-out) skip the check, which costs as much as ATen's
// per-op one (docs/development/benchmarks.md, instruction counts).
thread_local bool innermost_unprofiled = false;

}  // namespace

ProfilerLabel::ProfilerLabel() : ProfilerLabel(std::string_view()) {}

ProfilerLabel::ProfilerLabel(std::string_view name) : name_(internal::InternString(name)) {}

// USER_SCOPE: the scope torch.profiler.record_function records under. A RecordFunction is
// built only when callbacks want this scope (its constructor and destructor cost more than
// the check).
ProfilerRange::ProfilerRange(const ProfilerLabel& label)
    : name_(&label.str()), enclosing_(innermost), enclosing_unprofiled_(innermost_unprofiled) {
  bool unprofiled = true;
  if (innermost == nullptr || !innermost_unprofiled) {
    if (std::optional<at::StepCallbacks> callbacks = at::getStepCallbacksUnlessEmpty(at::RecordScope::USER_SCOPE)) {
      record_.emplace(std::move(*callbacks));
      if (record_->isActive()) record_->before(label.str());
      unprofiled = false;
    }
  }
  innermost = this;
  innermost_unprofiled = unprofiled;
}

ProfilerRange::~ProfilerRange() {
  innermost = enclosing_;
  innermost_unprofiled = enclosing_unprofiled_;
}

const std::string* CurrentProfilerRange() { return innermost != nullptr ? innermost->name_ : nullptr; }

int OpenProfilerRanges(const std::string** names, int max) {
  int n = 0;
  for (const ProfilerRange* range = innermost; range != nullptr && n < max; range = range->enclosing_) {
    names[n++] = range->name_;
  }
  return n;
}

}  // namespace fsdp::comm
