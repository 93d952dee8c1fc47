// The model tensors of a Hugging Face checkpoint (hf_model.h).
#include "dcp/hf_model.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>

#include "absl/container/flat_hash_map.h"

namespace fsdp::dcp::internal {

std::vector<HfModelTensor> HfModelTensors(torch::nn::Module& model, const ModelAdapter& adapter, const HfKeyFn& key_of,
                                          const char* caller) {
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
      out[it->second].fqns.push_back(item.key());
      continue;
    }
    const ShardedParam* sharded = adapter.Sharded(item.key());
    out.push_back({{key(item.key())}, {item.key()}, p, sharded, sharded ? sharded->global_size() : p.sizes().vec()});
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    if (item.value().defined())
      out.push_back({{key(item.key())}, {item.key()}, item.value(), nullptr, item.value().sizes().vec()});
  }
  // PyTorch's state_dict() order (what save_pretrained splits files by): each module in
  // pre-order, its own parameters, then its own buffers. Names it does not list stay last.
  absl::flat_hash_map<std::string, size_t> position;
  for (const auto& m : model.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const std::string prefix = m.key().empty() ? "" : m.key() + ".";
    for (const auto& p : m.value()->named_parameters(/*recurse=*/false))
      position.emplace(prefix + p.key(), position.size());
    for (const auto& b : m.value()->named_buffers(/*recurse=*/false))
      position.emplace(prefix + b.key(), position.size());
  }
  std::vector<size_t> rank(out.size());
  for (size_t i = 0; i < out.size(); ++i) {
    rank[i] = position.size() + i;
    for (const std::string& name : out[i].fqns) {
      const auto it = position.find(name);
      if (it != position.end()) rank[i] = std::min(rank[i], it->second);
    }
  }
  std::vector<size_t> order(out.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return rank[a] < rank[b]; });
  std::vector<HfModelTensor> sorted;
  sorted.reserve(out.size());
  for (size_t i : order) sorted.push_back(std::move(out[i]));
  return sorted;
}

}  // namespace fsdp::dcp::internal
