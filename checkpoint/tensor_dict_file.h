// Full state dict files: a str -> Tensor dict as torch.save writes it (Python's
// torch.load(path) returns the dict; torch/serialization.py, v2.15.0) and back. Both FSDPs'
// full model state dicts (fsdp::fsdp2::FullStateDict, fsdp::fsdp1::FullStateDict)
// are this type, so a file written by either loads into the other.
//
// Loading reads untrusted bytes with the validating reader (checkpoint_reader.h): a truncated
// or corrupted file is a c10::Error naming the file and the bad value. Python's torch.save of
// a dict or of a module's state_dict() (an OrderedDict) of tensors loads too.
#ifndef FSDP_CHECKPOINT_TENSOR_DICT_FILE_H_
#define FSDP_CHECKPOINT_TENSOR_DICT_FILE_H_

#include <ATen/core/Tensor.h>
#include <torch/ordered_dict.h>

#include <string>
#include <vector>

namespace fsdp::checkpoint {

// Name -> tensor, in insertion order.
using TensorDict = torch::OrderedDict<std::string, at::Tensor>;

// Tensors are detached and saved from the CPU. The file is written atomically (file_io.h).
void SaveTensorDict(const TensorDict& dict, const std::string& path);
TensorDict LoadTensorDict(const std::string& path);

// The same bytes in memory. `caller` starts every error message; `source` names the bytes.
std::vector<char> SerializeTensorDict(const TensorDict& dict);
TensorDict DeserializeTensorDict(const std::vector<char>& bytes, const std::string& source,
                                 const std::string& caller = "LoadTensorDict");

// What SaveTensorDict / LoadTensorDict do, with `caller` naming the public function in errors
// (the FSDPs' SaveFullStateDict / LoadFullStateDictFile).
void SaveTensorDictAs(const TensorDict& dict, const std::string& path, const std::string& caller);
TensorDict LoadTensorDictAs(const std::string& path, const std::string& caller);

}  // namespace fsdp::checkpoint

#endif  // FSDP_CHECKPOINT_TENSOR_DICT_FILE_H_
