// Forwarding header: the zip layer is checkpoint/checkpoint_zip.h (//checkpoint); this one
// keeps the name fsdp::per_param::internal::CheckpointZip compiling. New code includes that
// header.
#ifndef FSDP_FSDP_PER_PARAM_CHECKPOINT_ZIP_H_
#define FSDP_FSDP_PER_PARAM_CHECKPOINT_ZIP_H_

#include "checkpoint/checkpoint_zip.h"

namespace fsdp::per_param::internal {

using CheckpointZip = checkpoint::internal::CheckpointZip;

}  // namespace fsdp::per_param::internal

#endif  // FSDP_FSDP_PER_PARAM_CHECKPOINT_ZIP_H_
