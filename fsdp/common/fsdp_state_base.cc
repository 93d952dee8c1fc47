#include "fsdp/common/fsdp_state_base.h"

namespace fsdp {

void FSDPStateBase::CheckNotPoisoned(const char* caller) const {
  const std::string& poisoned_by = poison_record();
  TORCH_CHECK(poisoned_by.empty(), caller, ": FSDP cannot continue after an earlier error on this rank (", poisoned_by,
              "): ", unsharded_what_,
              " may be unsharded and gradients partially reduced. Load the "
              "last state dict into a newly built model (on new process groups) to continue.");
}

void FSDPStateBase::Poison(const char* where, const char* what) const {
  std::string& record = poison_record();
  if (record.empty()) record = std::string(where) + ": " + what;
}

}  // namespace fsdp
