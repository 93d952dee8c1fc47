#include "fsdp/fsdp1/state_dict.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <map>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_join.h"
#include "fsdp/fsdp1/flat_param.h"
#include "fsdp/fsdp1/flat_shard_conversion.h"
#include "fsdp/fsdp1/fsdp_state.h"

namespace fsdp::fsdp1 {
namespace {

std::vector<FlatParamHandle*> IdleHandles(const FullyShardedDataParallel& root, const char* caller) {
  // Lazy init (collective-free) sets up the handles' shards, so state dicts work before the
  // first forward too (e.g. loading a checkpoint into a new model).
  TORCH_CHECK(root.is_root(), caller, ": call it on the root FSDP module");
  std::vector<FlatParamHandle*> handles;
  for (FSDPState* s : CollectStates(root.module())) {
    s->CheckNotPoisoned(caller);
    TORCH_CHECK(s->training_state() == FSDPTrainingState::IDLE, caller, ": FSDP module '", s->name(),
                "' is in training state ", ToString(s->training_state()), "; call it outside forward/backward");
    if (s->handle() == nullptr) continue;
    TORCH_CHECK(s->handle()->flat_param().local_shard.defined(), caller, ": the flat parameter of '", s->name(),
                "' has no local shard yet");
    handles.push_back(s->handle());
  }
  return handles;
}

// The shard group a handle gathers over (null when the flat parameter is not sharded).
comm::ProcessGroupPtr ShardGroup(const FlatParamHandle& h) {
  return h.uses_sharded_strategy() ? h.process_group() : nullptr;
}

}  // namespace

FullStateDict GetFullStateDict(const FullyShardedDataParallel& root, bool rank0_only) {
  torch::nn::Module& module = root.module();
  std::map<std::string, at::Tensor> by_name;
  bool keep = true;
  at::NoGradGuard no_grad;
  for (FlatParamHandle* h : IdleHandles(root, "GetFullStateDict")) {
    keep = keep && (!rank0_only || h->process_group()->rank() == 0);
    auto part = UnflattenShard(*h, h->flat_param().local_shard, ShardGroup(*h), HandlePrefix(module, *h));
    if (keep) by_name.merge(part);
  }
  FullStateDict out;
  if (!keep) return out;
  // Tied parameters: the flat parameter holds the first name; other names share it.
  absl::flat_hash_map<const c10::TensorImpl*, std::string> first_name;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    first_name.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    auto it = by_name.find(item.key());
    if (it == by_name.end()) it = by_name.find(first_name[item.value().unsafeGetTensorImpl()]);
    out.insert(item.key(), it != by_name.end() ? it->second : item.value().detach().clone());
  }
  // buffer_dtype: the buffers in the dtypes they had at wrap time (the state-dict hooks'
  // _get_orig_buffer_dtypes, torch/distributed/fsdp/_state_dict_utils.py), for every FSDP
  // module with buffer_dtype set, except its ignored buffers; the module keeps its cast ones.
  absl::flat_hash_map<const c10::TensorImpl*, c10::ScalarType> orig_dtype;
  for (FSDPState* s : CollectStates(module)) {
    const auto& mp = s->options().mixed_precision;
    if (!mp || !mp->buffer_dtype) continue;
    for (const auto& [buffer, dtype] : s->orig_buffer_dtypes) {
      if (!s->ignored.buffers.contains(buffer.unsafeGetTensorImpl())) orig_dtype[buffer.unsafeGetTensorImpl()] = dtype;
    }
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    at::Tensor b = item.value().detach().clone();
    if (auto it = orig_dtype.find(item.value().unsafeGetTensorImpl()); it != orig_dtype.end()) b = b.to(it->second);
    out.insert(item.key(), b);
  }
  return out;
}

std::vector<LocalFlatPiece> LocalFlatPieces(const FullyShardedDataParallel& root) {
  torch::nn::Module& module = root.module();
  std::vector<LocalFlatPiece> out;
  for (FlatParamHandle* h : IdleHandles(root, "LocalFlatPieces")) {
    const FlatParameter& fp = h->flat_param();
    const std::string prefix = HandlePrefix(module, *h);
    for (const ShardParamInfo& info : fp.shard_param_infos) {
      LocalFlatPiece piece{prefix + fp.fqns[info.index], fp.shapes[info.index], 0, at::Tensor(), ShardGroup(*h)};
      piece.flat_param_key = prefix + "_flat_param";
      piece.shard_numel = fp.local_shard.numel();
      if (info.in_shard && info.numel_in_shard > 0) {
        piece.flat_start = info.intra_param_start_idx;
        piece.offset_in_shard = info.offset_in_shard;
        piece.local = fp.local_shard.narrow(0, info.offset_in_shard, info.numel_in_shard);
      }
      out.push_back(std::move(piece));
    }
  }
  return out;
}

void LoadFullStateDict(const FullyShardedDataParallel& root, const FullStateDict& state_dict) {
  torch::nn::Module& module = root.module();
  const std::vector<FlatParamHandle*> handles = IdleHandles(root, "LoadFullStateDict");
  std::vector<std::string> missing, unexpected;
  absl::flat_hash_map<std::string, bool> known;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    known[item.key()] = true;
    if (state_dict.find(item.key()) == nullptr) missing.push_back(item.key());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    known[item.key()] = true;
    if (state_dict.find(item.key()) == nullptr) missing.push_back(item.key());
  }
  for (const auto& item : state_dict) {
    if (!known.contains(item.key())) unexpected.push_back(item.key());
  }
  TORCH_CHECK(missing.empty() && unexpected.empty(), "LoadFullStateDict: Missing key(s) in state_dict: [",
              absl::StrJoin(missing, ", "), "]. Unexpected key(s) in state_dict: [", absl::StrJoin(unexpected, ", "),
              "].");
  std::map<std::string, const at::Tensor*> tensors;
  for (const auto& item : state_dict) tensors[item.key()] = &item.value();
  at::NoGradGuard no_grad;
  for (FlatParamHandle* h : handles) {
    at::Tensor& local = h->flat_param().local_shard;
    const int64_t rank = h->uses_sharded_strategy() ? h->rank() : 0;
    const int64_t world = h->uses_sharded_strategy() ? h->world_size() : 1;
    const at::Tensor shard = FlatShardOf(*h, tensors, rank, world, local.scalar_type(), HandlePrefix(module, *h));
    TORCH_CHECK(shard.numel() == local.numel(), "LoadFullStateDict: flat shard of ", shard.numel(),
                " elements for a local shard of ", local.numel());
    local.view(-1).copy_(shard);  // sharded original-parameter views alias it
  }
  // Parameters no handle manages (ignored_modules / ignored_states): loaded as they are, as
  // module.load_state_dict does for them in PyTorch.
  absl::flat_hash_map<const c10::TensorImpl*, bool> managed;
  for (FlatParamHandle* h : handles) {
    for (const at::Tensor& p : h->orig_params()) managed[p.unsafeGetTensorImpl()] = true;
  }
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (managed.contains(item.value().unsafeGetTensorImpl())) continue;
    const at::Tensor& src = state_dict[item.key()];
    TORCH_CHECK(src.sizes() == item.value().sizes(), "LoadFullStateDict: size mismatch for ", item.key(),
                ": copying a param with shape [", absl::StrJoin(src.sizes(), ", "),
                "], the shape in current model is [", absl::StrJoin(item.value().sizes(), ", "), "].");
    item.value().copy_(src);
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) item.value().copy_(state_dict[item.key()]);
}

void SaveFullStateDict(const FullStateDict& state_dict, const std::string& path) {
  checkpoint::SaveTensorDictAs(state_dict, path, "SaveFullStateDict");
}

FullStateDict LoadFullStateDictFile(const std::string& path) {
  return checkpoint::LoadTensorDictAs(path, "LoadFullStateDictFile");
}

}  // namespace fsdp::fsdp1
