// DeviceMesh: an N-D arrangement of ranks with one process group per mesh dimension.
#ifndef FSDP_MESH_DEVICE_MESH_H_
#define FSDP_MESH_DEVICE_MESH_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/process_group.h"

namespace fsdp::mesh {

// Semantics follow torch.distributed.device_mesh: the mesh holds world ranks laid out
// row-major in `shape` (rank = sum(coord[d] * stride[d])); `group(d)` is the group of the
// ranks that differ from this rank only in coordinate d (its rank within the group is
// coordinate()[d]).
//
// Every mesh descends from one root mesh (a Create call) through slice / operator[] /
// flatten / Concatenate; each of its dimensions spans one or more root dimensions (several
// after flatten). Creation and flatten() are collective over the world group: every world
// rank calls them with the same arguments in the same order (they create sub-groups).
// Slicing and Concatenate are local. Not thread-safe; a mesh belongs to one rank.
class DeviceMesh {
 public:
  // Builds a mesh over all ranks of `world`: product(shape) must equal world->size().
  // dim_names: empty, or one unique non-empty name per dimension.
  static std::shared_ptr<DeviceMesh> Create(comm::ProcessGroupPtr world, std::vector<int64_t> shape,
                                            std::vector<std::string> dim_names = {});

  int ndim() const { return static_cast<int>(shape_.size()); }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t size() const;  // number of ranks in the mesh
  int64_t size(int dim) const;
  const std::vector<std::string>& dim_names() const { return dim_names_; }
  // Index of `name`; throws naming the known names when absent.
  int dim_index(const std::string& name) const;

  // World ranks of the mesh, row-major in shape().
  const std::vector<int>& ranks() const { return ranks_; }
  // This rank's world rank and coordinate in the mesh.
  int world_rank() const { return world_->rank(); }
  const std::vector<int64_t>& coordinate() const { return coordinate_; }
  // This rank's rank within group(dim) == coordinate()[dim].
  int local_rank(int dim) const;

  const comm::ProcessGroupPtr& group(int dim) const;
  const comm::ProcessGroupPtr& group(const std::string& name) const;
  const comm::ProcessGroupPtr& world() const { return world_; }

  // The sub-mesh of this rank along the named dimensions, in the given order
  // (mesh["dp"], mesh.slice({"dp_replicate", "dp_shard"})); groups are shared with this
  // mesh. (A braced list cannot go to operator[]: it would also match std::string.)
  std::shared_ptr<DeviceMesh> operator[](const std::string& name) const;
  std::shared_ptr<DeviceMesh> slice(const std::vector<std::string>& names) const;

  // A 1-D mesh whose single dimension `new_name` spans the named, adjacent dimensions
  // (row-major); works on any mesh of a root, sliced, flattened or concatenated (HSDP:
  // mesh.slice({"dp_replicate", "dp_shard"})->flatten(..., "dp")). The root dimensions the
  // names span must be in the root's order. Collective over the world group: creates the
  // group of every line of the root along those dimensions, once per root; flattening the
  // same root dimensions again (from any mesh of the root, under any name) reuses the
  // groups and communicates nothing.
  std::shared_ptr<DeviceMesh> flatten(const std::vector<std::string>& names, const std::string& new_name) const;

  // "DeviceMesh((dp=2, tp=2), ranks=[0, 1, 2, 3])".
  std::string ToString() const;

 private:
  // The layout and group cache shared by all meshes of one root (defined in the .cc).
  struct Root;

  friend std::shared_ptr<DeviceMesh> Concatenate(const std::vector<std::shared_ptr<DeviceMesh>>& meshes);

  DeviceMesh() = default;
  // The mesh of `root` whose dimension d spans the root dimensions root_dims[d] (ascending,
  // disjoint across d, each set's group already in the root's cache).
  static std::shared_ptr<DeviceMesh> FromRoot(std::shared_ptr<Root> root, std::vector<std::vector<int>> root_dims,
                                              std::vector<std::string> dim_names);

  std::shared_ptr<Root> root_;
  std::vector<std::vector<int>> root_dims_;  // per dimension, the root dimensions it spans
  comm::ProcessGroupPtr world_;
  std::vector<int64_t> shape_;
  std::vector<std::string> dim_names_;
  std::vector<int> ranks_;
  std::vector<int64_t> coordinate_;
  std::vector<comm::ProcessGroupPtr> groups_;
};

using DeviceMeshPtr = std::shared_ptr<DeviceMesh>;

// The mesh whose dimensions are those of `meshes`, in order: names, shapes, coordinates and
// groups concatenated, ranks row-major over the concatenated shape. FSDP2 + TP:
// Concatenate({mesh["dp"], mesh["tp"]}) gives back the (dp, tp) layout of `mesh`; a
// flattened mesh stays one dimension (Concatenate({hsdp->flatten(..., "dp"), mesh["tp"]})
// is a (dp=4, tp=2) mesh). Like PyTorch's DeviceMesh._concatenate, the meshes must descend
// from one root mesh and span disjoint root dimensions, and the names must stay unique.
// Local: reuses the meshes' groups and creates none.
std::shared_ptr<DeviceMesh> Concatenate(const std::vector<std::shared_ptr<DeviceMesh>>& meshes);

}  // namespace fsdp::mesh

#endif  // FSDP_MESH_DEVICE_MESH_H_
