// DTensor: a local tensor plus the DTensorSpec that says which part of a global tensor it is.
#ifndef FSDP_DTENSOR_DTENSOR_H_
#define FSDP_DTENSOR_DTENSOR_H_

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "dtensor/dtensor_spec.h"
#include "dtensor/placement.h"
#include "mesh/device_mesh.h"

namespace fsdp::dtensor {

// LibTorch has no tensor subclasses, so a DTensor is a value holding the local tensor (an
// ordinary autograd tensor) and its spec; ops run on to_local(). Autograd flows through
// the local tensors: from_local / to_local are identities, and redistribute's backward
// redistributes the gradient back to the input's placements, except that a Partial input
// receives its gradient Replicated (PyTorch's rule: the gradient of each partial term is
// the whole output gradient). Copying a DTensor shares the local tensor.
class DTensor {
 public:
  DTensor() = default;  // undefined

  // Wraps this rank's `local` as the part of a global tensor laid out by `placements` on
  // `mesh`. With `shape`, the local tensor's shape must be exactly this rank's part of it
  // (else a c10::Error naming both shapes); without, the global shape assumes even shards
  // (each sharded dim = local size * number of shards), as PyTorch does. No communication.
  static DTensor from_local(at::Tensor local, mesh::DeviceMeshPtr mesh, Placements placements,
                            std::optional<std::vector<int64_t>> shape = std::nullopt,
                            std::optional<std::vector<int64_t>> stride = std::nullopt);
  // Wraps `local` with a spec the caller vouches for, unchecked (FSDP: its own chunk of a
  // tensor-parallel shard can differ from the StridedShard layout when sizes are uneven,
  // exactly as in PyTorch).
  static DTensor FromSpec(at::Tensor local, DTensorSpec spec);

  bool defined() const { return local_.defined(); }
  const at::Tensor& to_local() const { return local_; }
  const DTensorSpec& spec() const { return spec_; }
  const Placements& placements() const { return spec_.placements; }
  const mesh::DeviceMeshPtr& device_mesh() const { return spec_.mesh; }
  const std::vector<int64_t>& sizes() const { return spec_.shape; }
  c10::ScalarType dtype() const { return spec_.dtype; }
  bool requires_grad() const { return local_.requires_grad(); }

  // The DTensor with new placements on the same mesh (collective over the mesh dimensions
  // whose placement changes). Differentiable.
  DTensor redistribute(const Placements& placements) const;
  // As above; `mesh` must have the same layout as device_mesh() (PyTorch cannot
  // redistribute across meshes either).
  DTensor redistribute(const mesh::DeviceMeshPtr& mesh, const Placements& placements) const;
  // The global tensor on every rank (redistribute to all-Replicate). Differentiable.
  at::Tensor full_tensor() const;

  // "DTensor(local=Float[2, 3], spec=...)".
  std::string ToString() const;

 private:
  DTensor(at::Tensor local, DTensorSpec spec) : local_(std::move(local)), spec_(std::move(spec)) {}

  at::Tensor local_;
  DTensorSpec spec_;
};

// Shards or replicates `tensor` (the same shape on every rank) over `mesh`. With
// src_data_rank set, the data of that group rank on each mesh dimension is broadcast first
// (PyTorch's default 0: one source of truth); with std::nullopt every rank uses its own
// tensor and nothing is communicated. Partial is rejected (as PyTorch). The result's local
// tensor is a leaf with tensor.requires_grad().
DTensor distribute_tensor(const at::Tensor& tensor, const mesh::DeviceMeshPtr& mesh, const Placements& placements,
                          std::optional<int> src_data_rank = 0);

// The layouts a redistribute's gradient travels between, backwards. By default (PyTorch's
// rule, torch/distributed/tensor/_redistribute.py) the output's gradient arrives laid out
// as the output and leaves laid out as the input, Partial taken as Replicate on both
// sides. Tensor-parallel styles override them where the computation between two
// redistributes changes the gradient's layout (a column-sharded Linear's input gradient
// is Partial where its input was Replicate), so one collective serves both.
struct RedistributeGradLayouts {
  std::optional<Placements> output_grad;  // how the output's gradient arrives
  std::optional<Placements> input_grad;   // how the input's gradient must leave
};

// Redistributes a local tensor from `src` to `dst` placements, recording autograd when
// `local` requires grad (the building block of DTensor::redistribute). With gradient
// layouts that differ, an unchanged forward still records the backward redistribute.
at::Tensor RedistributeLocal(const at::Tensor& local, const DTensorSpec& src, const Placements& dst,
                             const RedistributeGradLayouts& grad_layouts = {});

// Whether two meshes lay out the same ranks in the same shape.
bool SameMesh(const mesh::DeviceMesh& a, const mesh::DeviceMesh& b);

}  // namespace fsdp::dtensor

#endif  // FSDP_DTENSOR_DTENSOR_H_
