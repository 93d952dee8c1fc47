// The model tensors of a Hugging Face checkpoint (hf_model.h).
#include "dcp/hf_model.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "absl/container/flat_hash_map.h"

namespace fsdp::dcp::internal {

std::vector<HfModelTensor> HfModelTensors(torch::nn::Module& model, const ModelAdapter& adapter,
                                          const HfKeyFn& key_of, const char* caller) {
  std::vector<HfModelTensor> out;
  absl::flat_hash_map<const void*, size_t> by_impl;  // a tied parameter's tensor -> its entry
  absl::flat_hash_map<std::string, std::string> fqn_of_key;
  const auto key = [&](const std::string& fqn) {
    std::string k = key_of ? key_of(fqn) : fqn;
    TORCH_CHECK(!k.empty(), caller, ": key_of('", fqn, "') is empty");
    auto [it, inserted] = fqn_of_key.emplace(k, fqn);
    TORCH_CHECK(inserted, caller, ": key_of gives '", k, "' for both '", it->second, "' and '", fqn, "'");
    return k;
  };
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!p.defined()) continue;
    auto [it, first] = by_impl.emplace(p.unsafeGetTensorImpl(), out.size());
    if (!first) {
      out[it->second].keys.push_back(key(item.key()));
      continue;
    }
    const ShardedParam* sharded = adapter.Sharded(item.key());
    out.push_back({{key(item.key())}, p, sharded, sharded ? sharded->global_size() : p.sizes().vec()});
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    if (item.value().defined()) out.push_back({{key(item.key())}, item.value(), nullptr, item.value().sizes().vec()});
  }
  return out;
}

}  // namespace fsdp::dcp::internal
