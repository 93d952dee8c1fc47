// parallelize_module: PyTorch 2.15's torch/distributed/tensor/parallel/api.py.
//
//   tensor_parallel::parallelize_module(*model, (*mesh)["tp"], {
//       {"layers.*.self_attn.q_proj", tensor_parallel::ColwiseParallel()},
//       {"layers.*.self_attn.o_proj", tensor_parallel::RowwiseParallel({.output_layouts = Shard(1)})}});
//
// A plan key is a module path whose atoms (split at '.') are fnmatch patterns over child
// names ('*', '?', '[seq]', '[!seq]'), as PyTorch matches them; "" is the root itself.
// Entries apply in plan order, each to every module its key matches.
//
// Contract: collective over `tp_mesh` (the styles broadcast parameters). `tp_mesh` is 1-D:
// slice a 2-D mesh first (mesh["tp"]), then fully_shard on the other dimension. A key that
// matches no module is an error naming it (PyTorch warns and skips the entry; a typo in a
// plan would leave a block unsharded), raised before any module changes; a module a style
// cannot take is an error naming its FQN and the style.
#ifndef FSDP_TENSOR_PARALLEL_PARALLELIZE_MODULE_H_
#define FSDP_TENSOR_PARALLEL_PARALLELIZE_MODULE_H_

#include <torch/nn/module.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mesh/device_mesh.h"
#include "tensor_parallel/parallel_style.h"

namespace fsdp::tensor_parallel {

// Ordered (PyTorch's dict keeps insertion order): (module path pattern, style).
using ParallelizePlan = std::vector<std::pair<std::string, ParallelStylePtr>>;

// Applies each style of `plan` to the modules its key matches; returns `module`.
torch::nn::Module& parallelize_module(torch::nn::Module& module, const mesh::DeviceMeshPtr& tp_mesh,
                                      const ParallelizePlan& plan, std::optional<int> src_data_rank = 0);
// Applies `style` to `module` itself.
torch::nn::Module& parallelize_module(torch::nn::Module& module, const mesh::DeviceMeshPtr& tp_mesh,
                                      const ParallelStylePtr& style, std::optional<int> src_data_rank = 0);

// The FQNs (relative to `module`) a plan key matches, in module order; empty if none.
std::vector<std::string> MatchModulePath(torch::nn::Module& module, const std::string& key);
// Python's fnmatch.fnmatchcase on one name.
bool FnMatch(const std::string& pattern, const std::string& name);

}  // namespace fsdp::tensor_parallel

#endif  // FSDP_TENSOR_PARALLEL_PARALLELIZE_MODULE_H_
