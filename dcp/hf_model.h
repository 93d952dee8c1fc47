// The model side of //dcp's Hugging Face load and save (hf.h), internal to //dcp:core: each
// tensor a Hugging Face checkpoint holds for a model, with its keys and, when the model's
// adapter shards it, its layout.
//
// Contract: HfModelTensors lists the parameters and buffers in PyTorch's state_dict() order
// (each module in pre-order: its own parameters, then its own buffers), a tied parameter once
// (at its first name in named_parameters()) with every name's key; keys are key_of(fqn)
// (null: the FQN). Errors (c10::Error starting with `caller`): key_of giving an
// empty key, or one key for two tensors. Local, no communication.
#ifndef FSDP_DCP_HF_MODEL_H_
#define FSDP_DCP_HF_MODEL_H_

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "dcp/adapter.h"
#include "dcp/hf.h"

namespace fsdp::dcp::internal {

struct HfModelTensor {
  std::vector<std::string> keys;  // the first is the tensor's first name's
  std::vector<std::string> fqns;  // the names, as keys
  at::Tensor tensor;              // the module's (a parameter or buffer)
  const ShardedParam* sharded = nullptr;
  std::vector<int64_t> global_size;
};

std::vector<HfModelTensor> HfModelTensors(torch::nn::Module& model, const ModelAdapter& adapter, const HfKeyFn& key_of,
                                          const char* caller);

}  // namespace fsdp::dcp::internal

#endif  // FSDP_DCP_HF_MODEL_H_
