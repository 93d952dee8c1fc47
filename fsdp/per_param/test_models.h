// FSDP2's names for the shared test models (fsdp/common/test_models.h): blocks are
// FullySharded<BlockImpl>.
#ifndef FSDP_FSDP_PER_PARAM_TEST_MODELS_H_
#define FSDP_FSDP_PER_PARAM_TEST_MODELS_H_

#include "fsdp/common/test_models.h"
#include "fsdp/per_param/fully_shard.h"

namespace fsdp::per_param::testing {

using test_models::Batch;
using test_models::Block;
using test_models::BlockImpl;
using test_models::InitDeterministic;
using test_models::Net;
using test_models::NetImpl;
using test_models::NetOptions;
using test_models::TiedLinear;
using test_models::TiedLinearImpl;
using test_models::TrainSteps;
using test_models::UniqueParameters;

}  // namespace fsdp::per_param::testing

#endif  // FSDP_FSDP_PER_PARAM_TEST_MODELS_H_
