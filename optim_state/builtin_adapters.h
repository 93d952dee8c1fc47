// The adapters optim_state ships (optimizer_adapter.h registers them before any other).
// Internal to //optim_state.
#ifndef FSDP_OPTIM_STATE_BUILTIN_ADAPTERS_H_
#define FSDP_OPTIM_STATE_BUILTIN_ADAPTERS_H_

#include <memory>
#include <vector>

#include "optim_state/optimizer_adapter.h"

namespace fsdp::optim_state::internal {

// Adam, AdamW, SGD, Adagrad, RMSprop.
std::vector<std::shared_ptr<const OptimizerAdapter>> BuiltinOptimizerAdapters();

}  // namespace fsdp::optim_state::internal

#endif  // FSDP_OPTIM_STATE_BUILTIN_ADAPTERS_H_
