#include "fsdp/fsdp1/flat_shard_conversion.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "fsdp/common/flat_layout.h"
#include "fsdp/fsdp1/flat_param.h"
#include "fsdp/fsdp1/fsdp_state.h"

namespace fsdp::fsdp1 {

std::map<std::string, at::Tensor> UnflattenShard(const FlatParamHandle& handle, const at::Tensor& shard,
                                                 const comm::ProcessGroupPtr& shard_group, const std::string& prefix) {
  const FlatParameter& fp = handle.flat_param();
  const at::Tensor local = shard.contiguous().view(-1);
  at::Tensor full = local;
  if (shard_group && shard_group->size() > 1) {
    full = at::empty({local.numel() * shard_group->size()}, local.options());
    shard_group->all_gather_into_tensor(full, local)->wait();
  }
  const int64_t total = FlatTotalNumel(fp.segments);
  TORCH_CHECK(full.numel() >= total, "UnflattenShard: the gathered tensor has ", full.numel(),
              " elements but the flat parameter holding [", prefix, absl::StrJoin(fp.fqns, ", " + prefix), "] has ",
              total);
  std::map<std::string, at::Tensor> out;
  for (const FlatSegment& seg : fp.segments) {
    if (seg.param_index < 0) continue;  // padding
    out[prefix + fp.fqns[seg.param_index]] =
        full.narrow(0, seg.start, seg.numel).view(fp.shapes[seg.param_index]).clone();
  }
  return out;
}

at::Tensor FlatShardOf(const FlatParamHandle& handle, const std::map<std::string, const at::Tensor*>& tensors,
                       int64_t rank, int64_t world_size, c10::ScalarType dtype, const std::string& prefix) {
  const FlatParameter& fp = handle.flat_param();
  const int64_t total = FlatTotalNumel(fp.segments);
  at::Tensor flat = at::zeros({total}, at::TensorOptions(dtype));
  for (const FlatSegment& seg : fp.segments) {
    if (seg.param_index < 0) continue;
    const std::string fqn = prefix + fp.fqns[seg.param_index];
    auto it = tensors.find(fqn);
    if (it == tensors.end() || it->second == nullptr) continue;
    const at::Tensor& t = *it->second;
    TORCH_CHECK(t.sizes() == c10::IntArrayRef(fp.shapes[seg.param_index]),
                "Tensor optimizer state does not have same shape as its "
                "parameter: [",
                absl::StrJoin(t.sizes(), ", "), "] [", absl::StrJoin(fp.shapes[seg.param_index], ", "), "] (", fqn,
                ")");
    flat.narrow(0, seg.start, seg.numel).copy_(t.reshape(-1));
  }
  const FlatChunk chunk = MakeFlatChunk(total, world_size, rank);
  at::Tensor shard = at::zeros({chunk.chunk}, flat.options());
  if (chunk.end > chunk.start) {
    shard.narrow(0, 0, chunk.end - chunk.start).copy_(flat.narrow(0, chunk.start, chunk.end - chunk.start));
  }
  return shard;
}

std::string HandlePrefix(torch::nn::Module& root, const FlatParamHandle& handle) {
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    FSDPState* state = GetState(*item.value());
    if (state == nullptr || state->handle() != &handle) continue;
    // Every FSDP1 model / optimizer state conversion names its handles here first.
    state->CheckNotPoisoned("FSDP1 model / optimizer state dict");
    return item.key().empty() ? "" : item.key() + ".";
  }
  TORCH_CHECK(false, "HandlePrefix: the handle does not belong to a module under the root");
}

}  // namespace fsdp::fsdp1
