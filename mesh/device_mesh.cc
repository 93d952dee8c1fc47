#include "mesh/device_mesh.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp::mesh {
namespace {

std::vector<int64_t> RowMajorStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * shape[d + 1];
  }
  return strides;
}

// World ranks of the line through `coordinate` along the dimensions `dims` (row-major in
// the order of `dims`), over a full world laid out row-major in `shape`.
std::vector<int> LineRanks(const std::vector<int64_t>& shape, const std::vector<int64_t>& coordinate,
                           const std::vector<int>& dims) {
  const std::vector<int64_t> strides = RowMajorStrides(shape);
  int64_t base = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (std::find(dims.begin(), dims.end(), static_cast<int>(d)) == dims.end()) {
      base += coordinate[d] * strides[d];
    }
  }
  std::vector<int> ranks = {static_cast<int>(base)};
  for (int d : dims) {
    std::vector<int> next;
    for (int r : ranks) {
      for (int64_t i = 0; i < shape[d]; ++i) next.push_back(static_cast<int>(r + i * strides[d]));
    }
    ranks = std::move(next);
  }
  return ranks;
}

std::vector<int64_t> CoordinateOf(int64_t rank, const std::vector<int64_t>& shape) {
  std::vector<int64_t> coordinate(shape.size());
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    coordinate[d] = rank % shape[d];
    rank /= shape[d];
  }
  return coordinate;
}

// Creates, collectively over `world`, one group per line along `dims`; returns this rank's.
// `desc` names them in flight recorder dumps, as PyTorch's DeviceMesh does ("mesh_dp").
comm::ProcessGroupPtr CreateLineGroups(const comm::ProcessGroupPtr& world, const std::vector<int64_t>& shape,
                                       const std::vector<int>& dims, const std::string& desc) {
  // Every world rank walks all lines in the same order (rank order of the line's first rank).
  std::set<std::vector<int>> lines;
  for (int r = 0; r < world->size(); ++r) {
    std::vector<int> line = LineRanks(shape, CoordinateOf(r, shape), dims);
    std::sort(line.begin(), line.end());
    lines.insert(line);
  }
  comm::ProcessGroupPtr mine;
  for (const auto& line : lines) {
    if (line.size() == static_cast<size_t>(world->size())) {
      if (std::binary_search(line.begin(), line.end(), world->rank())) mine = world;
      continue;  // the whole world: reuse it
    }
    auto group = world->new_subgroup(line, desc);
    if (group) mine = group;
  }
  return mine;
}

// Names root dimensions in messages ("dp_replicate, tp", or indices for an unnamed root).
std::string RootDimNames(const std::vector<std::string>& root_names, const std::vector<int>& dims) {
  std::vector<std::string> names;
  for (int d : dims) names.push_back(root_names.empty() ? absl::StrCat(d) : root_names[d]);
  return absl::StrJoin(names, ", ");
}

}  // namespace

// Why a root: each rank only holds its own line of a slice, yet group creation is collective
// over the world, so flatten must enumerate every sibling line of the root; Concatenate must
// recognize slices of one root and recombine their coordinates. PyTorch keeps the same facts
// in _mesh_resources (root of each slice, flattened meshes of each root).
struct DeviceMesh::Root {
  comm::ProcessGroupPtr world;
  std::vector<int64_t> shape;          // world ranks lie row-major in it
  std::vector<std::string> dim_names;  // empty when unnamed
  std::vector<int64_t> coordinate;     // this rank's
  // The groups of the lines along each set of root dimensions (ascending) that a mesh
  // dimension spans: every dimension at Create, then each flatten. All ranks fill it with the
  // same keys in the same order (flatten is collective), so a cache hit is a hit on every
  // rank and skipping new_subgroup keeps the ranks' collectives in step.
  std::map<std::vector<int>, comm::ProcessGroupPtr> groups;
};

std::shared_ptr<DeviceMesh> DeviceMesh::FromRoot(std::shared_ptr<Root> root, std::vector<std::vector<int>> root_dims,
                                                 std::vector<std::string> dim_names) {
  std::shared_ptr<DeviceMesh> mesh(new DeviceMesh());
  std::vector<int> all_dims;
  for (const auto& dims : root_dims) {
    int64_t size = 1;
    int64_t coordinate = 0;
    for (int d : dims) {
      size *= root->shape[d];
      coordinate = coordinate * root->shape[d] + root->coordinate[d];
      all_dims.push_back(d);
    }
    mesh->shape_.push_back(size);
    mesh->coordinate_.push_back(coordinate);
    mesh->groups_.push_back(root->groups.at(dims));
  }
  // The root's ranks are 0..N-1 row-major, so line positions are world ranks.
  mesh->ranks_ = LineRanks(root->shape, root->coordinate, all_dims);
  mesh->world_ = root->world;
  mesh->dim_names_ = std::move(dim_names);
  mesh->root_dims_ = std::move(root_dims);
  mesh->root_ = std::move(root);
  return mesh;
}

std::shared_ptr<DeviceMesh> DeviceMesh::Create(comm::ProcessGroupPtr world, std::vector<int64_t> shape,
                                               std::vector<std::string> dim_names) {
  TORCH_CHECK(world != nullptr, "DeviceMesh::Create: world group is null");
  TORCH_CHECK(!shape.empty(), "DeviceMesh::Create: shape must have at least one dimension");
  int64_t numel = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    TORCH_CHECK(shape[d] >= 1, "DeviceMesh::Create: shape[", d, "] must be >= 1, got ", shape[d]);
    numel *= shape[d];
  }
  TORCH_CHECK(numel == world->size(), "DeviceMesh::Create: mesh shape [", absl::StrJoin(shape, ", "), "] holds ", numel,
              " ranks but the world group has ", world->size());
  TORCH_CHECK(dim_names.empty() || dim_names.size() == shape.size(), "DeviceMesh::Create: dim_names has ",
              dim_names.size(), " names for ", shape.size(), " dimensions");
  std::set<std::string> seen;
  for (const auto& name : dim_names) {
    TORCH_CHECK(!name.empty(), "DeviceMesh::Create: dim_names must not be empty strings");
    TORCH_CHECK(seen.insert(name).second, "DeviceMesh::Create: dim name '", name, "' is repeated");
  }
  auto root = std::make_shared<Root>();
  root->coordinate = CoordinateOf(world->rank(), shape);
  std::vector<std::vector<int>> root_dims;
  for (int d = 0; d < static_cast<int>(shape.size()); ++d) {
    root->groups[{d}] =
        CreateLineGroups(world, shape, {d}, dim_names.empty() ? absl::StrCat("mesh_dim_", d) : "mesh_" + dim_names[d]);
    root_dims.push_back({d});
  }
  root->world = std::move(world);
  root->shape = std::move(shape);
  root->dim_names = dim_names;
  return FromRoot(std::move(root), std::move(root_dims), std::move(dim_names));
}

int64_t DeviceMesh::size() const {
  return std::accumulate(shape_.begin(), shape_.end(), int64_t{1}, std::multiplies<>());
}

int64_t DeviceMesh::size(int dim) const {
  TORCH_CHECK(dim >= 0 && dim < ndim(), "DeviceMesh: dim must be in [0, ", ndim(), "), got ", dim);
  return shape_[dim];
}

int DeviceMesh::dim_index(const std::string& name) const {
  auto it = std::find(dim_names_.begin(), dim_names_.end(), name);
  TORCH_CHECK(it != dim_names_.end(), "DeviceMesh: no dimension named '", name, "'; the mesh has [",
              absl::StrJoin(dim_names_, ", "), "]");
  return static_cast<int>(it - dim_names_.begin());
}

int DeviceMesh::local_rank(int dim) const {
  size(dim);  // validates
  return static_cast<int>(coordinate_[dim]);
}

const comm::ProcessGroupPtr& DeviceMesh::group(int dim) const {
  size(dim);  // validates
  return groups_[dim];
}

const comm::ProcessGroupPtr& DeviceMesh::group(const std::string& name) const { return groups_[dim_index(name)]; }

std::shared_ptr<DeviceMesh> DeviceMesh::operator[](const std::string& name) const { return slice({name}); }

std::shared_ptr<DeviceMesh> DeviceMesh::slice(const std::vector<std::string>& names) const {
  TORCH_CHECK(!names.empty(), "DeviceMesh: slicing needs at least one dimension name");
  std::vector<int> dims;
  for (const auto& name : names) {
    const int d = dim_index(name);
    TORCH_CHECK(std::find(dims.begin(), dims.end(), d) == dims.end(), "DeviceMesh: dimension '", name,
                "' named twice in a slice");
    dims.push_back(d);
  }
  // PyTorch 2.15 (torch/distributed/device_mesh.py) slices only in mesh order: a reordered
  // submesh would make group ranks disagree with the coordinates.
  TORCH_CHECK(std::is_sorted(dims.begin(), dims.end()), "DeviceMesh: invalid mesh_dim_names [",
              absl::StrJoin(names, ", "), "] specified; mesh dim indices should be in ascending order");
  std::vector<std::vector<int>> root_dims;
  for (int d : dims) root_dims.push_back(root_dims_[d]);
  return FromRoot(root_, std::move(root_dims), names);
}

std::shared_ptr<DeviceMesh> DeviceMesh::flatten(const std::vector<std::string>& names,
                                                const std::string& new_name) const {
  TORCH_CHECK(!names.empty(), "DeviceMesh::flatten: needs at least one dimension name");
  TORCH_CHECK(!new_name.empty(), "DeviceMesh::flatten: new_name must not be empty");
  std::vector<int> dims;
  for (const auto& name : names) dims.push_back(dim_index(name));
  for (size_t i = 1; i < dims.size(); ++i) {
    TORCH_CHECK(dims[i] == dims[i - 1] + 1, "DeviceMesh::flatten: dimensions [", absl::StrJoin(names, ", "),
                "] must be adjacent and in mesh order");
  }
  std::vector<int> flat;
  for (int d : dims) flat.insert(flat.end(), root_dims_[d].begin(), root_dims_[d].end());
  // Groups list their members in rank order; only ascending root dimensions make that order
  // the row-major one, so that group rank == flattened coordinate.
  TORCH_CHECK(std::is_sorted(flat.begin(), flat.end()), "DeviceMesh::flatten: dimensions [", absl::StrJoin(names, ", "),
              "] span root dimensions [", RootDimNames(root_->dim_names, flat),
              "], out of the root mesh's order; flatten dimensions in root order");
  if (root_->groups.count(flat) == 0) {
    // Insert only after creation succeeded: a failed attempt must not look cached.
    auto group = CreateLineGroups(root_->world, root_->shape, flat, "mesh_" + new_name);
    root_->groups.emplace(flat, std::move(group));
  }
  return FromRoot(root_, {flat}, {new_name});
}

std::string DeviceMesh::ToString() const {
  std::vector<std::string> dims;
  for (int d = 0; d < ndim(); ++d) {
    dims.push_back(dim_names_.empty() ? absl::StrCat(shape_[d]) : absl::StrCat(dim_names_[d], "=", shape_[d]));
  }
  return absl::StrCat("DeviceMesh((", absl::StrJoin(dims, ", "), "), ranks=[", absl::StrJoin(ranks_, ", "), "])");
}

std::shared_ptr<DeviceMesh> Concatenate(const std::vector<std::shared_ptr<DeviceMesh>>& meshes) {
  TORCH_CHECK(!meshes.empty(), "DeviceMesh Concatenate: needs at least one mesh");
  std::vector<std::vector<int>> root_dims;
  std::vector<std::string> names;
  std::map<int, size_t> owner;  // root dimension -> index of the mesh spanning it
  for (size_t i = 0; i < meshes.size(); ++i) {
    const auto& mesh = meshes[i];
    TORCH_CHECK(mesh != nullptr, "DeviceMesh Concatenate: mesh ", i, " is null");
    // Rank arithmetic and group reuse need one row-major world layout.
    TORCH_CHECK(mesh->root_ == meshes[0]->root_, "DeviceMesh Concatenate: meshes 0 (", meshes[0]->ToString(), ") and ",
                i, " (", mesh->ToString(),
                ") come from different root meshes; only meshes derived from one "
                "DeviceMesh::Create can be concatenated");
    for (int d = 0; d < mesh->ndim(); ++d) {
      for (int r : mesh->root_dims_[d]) {
        auto [it, fresh] = owner.emplace(r, i);
        TORCH_CHECK(fresh, "DeviceMesh Concatenate: meshes ", it->second, " and ", i,
                    " overlap: both span root dimension ", RootDimNames(mesh->root_->dim_names, {r}));
      }
      root_dims.push_back(mesh->root_dims_[d]);
      if (!mesh->dim_names_.empty()) names.push_back(mesh->dim_names_[d]);
    }
  }
  std::set<std::string> seen;
  for (const auto& name : names) {
    TORCH_CHECK(seen.insert(name).second, "DeviceMesh Concatenate: dimension name '", name, "' appears twice in [",
                absl::StrJoin(names, ", "), "]");
  }
  // Only an unnamed root has no names, and it overlaps any other mesh: names are all or none.
  return DeviceMesh::FromRoot(meshes[0]->root_, std::move(root_dims), std::move(names));
}

}  // namespace fsdp::mesh
