// Forwarding header: the reader is checkpoint/checkpoint_reader.h (//checkpoint); this one
// keeps the name fsdp::per_param::ReadCheckpoint compiling. New code includes that header.
#ifndef FSDP_FSDP_PER_PARAM_CHECKPOINT_READER_H_
#define FSDP_FSDP_PER_PARAM_CHECKPOINT_READER_H_

#include "checkpoint/checkpoint_reader.h"

namespace fsdp::per_param {

using checkpoint::ReadCheckpoint;

}  // namespace fsdp::per_param

#endif  // FSDP_FSDP_PER_PARAM_CHECKPOINT_READER_H_
