// Moved to checkpoint/checkpoint_zip.h (//checkpoint); this header keeps the old name
// fsdp::per_param::internal::CheckpointZip compiling. New code includes the new header.
#ifndef FSDP_FSDP_PER_PARAM_CHECKPOINT_ZIP_H_
#define FSDP_FSDP_PER_PARAM_CHECKPOINT_ZIP_H_

#include "checkpoint/checkpoint_zip.h"

namespace fsdp::per_param::internal {

using CheckpointZip = checkpoint::internal::CheckpointZip;

}  // namespace fsdp::per_param::internal

#endif  // FSDP_FSDP_PER_PARAM_CHECKPOINT_ZIP_H_
