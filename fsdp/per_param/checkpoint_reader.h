// Moved to checkpoint/checkpoint_reader.h (//checkpoint); this header keeps the old name
// fsdp::per_param::ReadCheckpoint compiling. New code includes the new header.
#ifndef FSDP_FSDP_PER_PARAM_CHECKPOINT_READER_H_
#define FSDP_FSDP_PER_PARAM_CHECKPOINT_READER_H_

#include "checkpoint/checkpoint_reader.h"

namespace fsdp::per_param {

using checkpoint::ReadCheckpoint;

}  // namespace fsdp::per_param

#endif  // FSDP_FSDP_PER_PARAM_CHECKPOINT_READER_H_
