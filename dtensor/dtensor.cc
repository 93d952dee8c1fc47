#include "dtensor/dtensor.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/profiler_range.h"
#include "dtensor/redistribute.h"
#include "torch_compat/autograd_node.h"

namespace fsdp::dtensor {
namespace {

// The backward of a redistribute: the gradient arrives laid out as the forward output and
// leaves laid out as the forward input, Partial inputs getting it Replicated.
class RedistributeBackward : public torch::autograd::Node {
 public:
  RedistributeBackward(DTensorSpec grad_src, Placements grad_dst)
      : grad_src_(std::move(grad_src)), grad_dst_(std::move(grad_dst)) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    const auto plan = PlanRedistribute(grad_src_, grad_dst_);
    return {RunRedistributePlan(grads[0], grad_src_, *plan)};
  }
  // PyTorch's name of the node (its autograd Function's backward), as traces show it.
  std::string name() const override { return "RedistributeBackward"; }

 private:
  DTensorSpec grad_src_;
  Placements grad_dst_;
};

// PyTorch's compute_global_tensor_info (torch/csrc/distributed/...; called by
// DTensor.from_local): a shard of tensor dim d multiplies every other dim's stride that is
// at least d's stride by the mesh dim's size, so a permuted local tensor keeps its layout.
std::vector<int64_t> InferGlobalStride(const at::Tensor& local, const mesh::DeviceMesh& mesh,
                                       const Placements& placements) {
  std::vector<int64_t> stride = local.strides().vec();
  for (size_t m = 0; m < placements.size(); ++m) {
    if (!placements[m].is_shard()) continue;
    const int64_t d = placements[m].dim();
    const int64_t size = mesh.size(static_cast<int>(m));
    const int64_t shard_stride = stride[d];
    for (size_t i = 0; i < stride.size(); ++i) {
      if (static_cast<int64_t>(i) != d && stride[i] >= shard_stride) stride[i] *= size;
    }
  }
  return stride;
}

std::vector<int64_t> InferGlobalShape(const at::Tensor& local, const mesh::DeviceMesh& mesh,
                                      const Placements& placements) {
  std::vector<int64_t> shape = local.sizes().vec();
  for (size_t m = 0; m < placements.size(); ++m) {
    if (placements[m].is_shard()) shape[placements[m].dim()] *= mesh.size(static_cast<int>(m));
  }
  return shape;
}

}  // namespace

bool SameMesh(const mesh::DeviceMesh& a, const mesh::DeviceMesh& b) {
  return a.shape() == b.shape() && a.ranks() == b.ranks();
}

DTensor DTensor::from_local(at::Tensor local, mesh::DeviceMeshPtr mesh, Placements placements,
                            std::optional<std::vector<int64_t>> shape, std::optional<std::vector<int64_t>> stride) {
  TORCH_CHECK(local.defined(), "DTensor::from_local: local tensor is undefined");
  TORCH_CHECK(mesh != nullptr, "DTensor::from_local: mesh is null");
  placements = ValidatePlacements(placements, mesh->ndim(), local.dim(), "DTensor::from_local");
  std::vector<int64_t> global = shape ? *shape : InferGlobalShape(local, *mesh, placements);
  // Without a stride: inferred from the local layout when the shape is inferred too (as
  // PyTorch); contiguous for a given shape (PyTorch wants both or neither).
  std::vector<int64_t> global_stride = stride  ? *stride
                                       : shape ? std::vector<int64_t>{}
                                               : InferGlobalStride(local, *mesh, placements);
  DTensorSpec spec = DTensorSpec::Make(std::move(mesh), std::move(placements), std::move(global), local.scalar_type(),
                                       std::move(global_stride));
  const std::vector<int64_t> expected = spec.local_shape();
  TORCH_CHECK(local.sizes().vec() == expected, "DTensor::from_local: local tensor of shape [",
              absl::StrJoin(local.sizes(), ", "), "] does not match the spec: global shape [",
              absl::StrJoin(spec.shape, ", "), "] with ", dtensor::ToString(spec.placements),
              " gives this rank (coordinate [", absl::StrJoin(spec.mesh->coordinate(), ", "), "]) a local shape of [",
              absl::StrJoin(expected, ", "), "]");
  return DTensor(std::move(local), std::move(spec));
}

DTensor DTensor::FromSpec(at::Tensor local, DTensorSpec spec) { return DTensor(std::move(local), std::move(spec)); }

at::Tensor RedistributeLocal(const at::Tensor& local, const DTensorSpec& src, const Placements& dst,
                             const RedistributeGradLayouts& grad_layouts) {
  const auto plan = PlanRedistribute(src, dst);
  Placements grad_src = grad_layouts.output_grad ? *grad_layouts.output_grad : ReplicatePartials(plan->dst);
  Placements grad_dst = grad_layouts.input_grad ? *grad_layouts.input_grad : ReplicatePartials(src.placements);
  const bool backward_moves = grad_src != grad_dst;
  const bool records_grad = local.requires_grad() && at::GradMode::is_enabled();
  if (plan->steps.empty() && (!backward_moves || !records_grad)) return local;
  // PyTorch's trace shows its autograd Function (torch/distributed/tensor/_redistribute.py
  // Redistribute) under its class name.
  static const comm::ProfilerLabel kLabel("Redistribute");
  comm::ProfilerRange range(kLabel);
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    // An unchanged forward whose backward moves: an alias made without grad (as a custom
    // autograd Function returning its input), whose history is the backward alone.
    out = plan->steps.empty() ? local.view_as(local) : RunRedistributePlan(local, src, *plan);
  }
  if (records_grad) {
    // A fresh tensor carries the new grad_fn; a view of the input would rebase its history.
    if (!plan->steps.empty() && (out.is_view() || out.is_alias_of(local))) out = out.clone();
    auto node =
        torch_compat::MakeNode<RedistributeBackward>(src.WithPlacements(std::move(grad_src)), std::move(grad_dst));
    node->set_next_edges(torch::autograd::collect_next_edges(local));
    torch::autograd::set_history(out, node);
  }
  return out;
}

DTensor DTensor::redistribute(const Placements& placements) const {
  TORCH_CHECK(defined(), "DTensor::redistribute: undefined DTensor");
  DTensorSpec dst = spec_.WithPlacements(placements);
  // PyTorch's DTensor.redistribute (torch/distributed/tensor/_api.py) makes a Partial only
  // out of a Shard, and only Partial(sum) (a local zero-fill): Replicate -> Partial would
  // have to invent the ranks' terms, and Partial -> another Partial changes what is pending.
  for (size_t m = 0; m < dst.placements.size(); ++m) {
    const Placement& from = spec_.placements[m];
    const Placement& to = dst.placements[m];
    if (!to.is_partial() || from == to) continue;
    TORCH_CHECK(from.kind() == PlacementKind::kShard && to.reduce_op().kind() == comm::ReduceOpKind::kSum,
                "DTensor::redistribute: can not redistribute from ", from.ToString(), " to ", to.ToString(),
                " on mesh dim ", m, "; only Shard to Partial(sum) redistribution is supported");
  }
  at::Tensor out = RedistributeLocal(local_, spec_, dst.placements);
  return DTensor(std::move(out), std::move(dst));
}

DTensor DTensor::redistribute(const mesh::DeviceMeshPtr& mesh, const Placements& placements) const {
  TORCH_CHECK(mesh != nullptr, "DTensor::redistribute: mesh is null");
  TORCH_CHECK(defined() && SameMesh(*mesh, *spec_.mesh),
              "DTensor::redistribute: cannot redistribute across different meshes: the tensor is on ",
              defined() ? spec_.mesh->ToString() : "<undefined>", ", the target is ", mesh->ToString());
  return redistribute(placements);
}

at::Tensor DTensor::full_tensor() const {
  TORCH_CHECK(defined(), "DTensor::full_tensor: undefined DTensor");
  return RedistributeLocal(local_, spec_, Placements(spec_.placements.size(), Placement::Replicate()));
}

std::string DTensor::ToString() const {
  if (!defined()) return "DTensor(undefined)";
  return absl::StrCat("DTensor(local=", c10::toString(local_.scalar_type()), "[", absl::StrJoin(local_.sizes(), ", "),
                      "], spec=", spec_.ToString(), ")");
}

DTensor distribute_tensor(const at::Tensor& tensor, const mesh::DeviceMeshPtr& mesh, const Placements& placements,
                          std::optional<int> src_data_rank) {
  TORCH_CHECK(tensor.defined(), "distribute_tensor: tensor is undefined");
  TORCH_CHECK(mesh != nullptr, "distribute_tensor: mesh is null");
  const Placements normalized = ValidatePlacements(placements, mesh->ndim(), tensor.dim(), "distribute_tensor");
  for (size_t m = 0; m < normalized.size(); ++m) {
    TORCH_CHECK(!normalized[m].is_partial(), "distribute_tensor: placement ", m, " is ", normalized[m].ToString(),
                "; Partial cannot be distributed (use from_local)");
  }
  at::Tensor data = tensor.detach();
  if (src_data_rank.has_value()) {
    data = data.contiguous().clone();  // broadcast writes into it
    for (int m = 0; m < mesh->ndim(); ++m) {
      TORCH_CHECK(*src_data_rank >= 0 && *src_data_rank < mesh->size(m),
                  "distribute_tensor: "
                  "src_data_rank ",
                  *src_data_rank, " is not a rank of mesh dim ", m, " (size ", mesh->size(m), ")");
      // Broadcasting dim by dim from the same group rank reaches every rank from the one
      // whose coordinate is src_data_rank everywhere.
      if (mesh->size(m) > 1) mesh->group(m)->broadcast(data, *src_data_rank)->wait();
    }
  }
  DTensorSpec spec = DTensorSpec::Make(mesh, normalized, tensor.sizes().vec(), tensor.scalar_type());
  const DTensorSpec replicated = spec.WithPlacements(Placements(normalized.size(), Placement::Replicate()));
  at::Tensor local = RunRedistributePlan(data, replicated, *PlanRedistribute(replicated, normalized));
  // The DTensor owns exactly its shard: never the caller's storage, nor a chunk view that
  // would keep the whole (broadcast) tensor alive.
  const bool owns_storage = local.storage_offset() == 0 && local.storage().nbytes() == local.nbytes();
  if (local.is_alias_of(tensor) || !owns_storage) local = local.clone();
  local = local.detach().requires_grad_(tensor.requires_grad());
  return DTensor::FromSpec(std::move(local), std::move(spec));
}

}  // namespace fsdp::dtensor
