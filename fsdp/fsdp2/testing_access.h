// Tests' access to the runtime behind an FSDPModule handle (FSDPState, FSDPParamGroup:
// fsdp_state.h, fsdp_param_group.h), which the public header keeps private. Testonly
// (//fsdp/fsdp2:testing_access); a module's state is also GetState(module) (fsdp_state.h).
#ifndef FSDP_FSDP_FSDP2_TESTING_ACCESS_H_
#define FSDP_FSDP_FSDP2_TESTING_ACCESS_H_

#include "fsdp/fsdp2/fsdp_param_group.h"
#include "fsdp/fsdp2/fsdp_state.h"
#include "fsdp/fsdp2/fully_shard.h"

namespace fsdp::fsdp2 {

struct FSDPModuleTestAccess {
  // The handle's state; throws a c10::Error when its module is gone (or the handle is empty).
  static FSDPState* state(const FSDPModule& module) { return module.state(); }
  // The state's parameter group; null when fully_shard found no parameters to manage.
  static FSDPParamGroup* param_group(const FSDPModule& module) { return module.param_group(); }
};

}  // namespace fsdp::fsdp2

#endif  // FSDP_FSDP_FSDP2_TESTING_ACCESS_H_
