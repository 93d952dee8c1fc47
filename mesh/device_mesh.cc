#include "mesh/device_mesh.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <functional>
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
comm::ProcessGroupPtr CreateLineGroups(const comm::ProcessGroupPtr& world,
                                       const std::vector<int64_t>& shape, const std::vector<int>& dims) {
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
    auto group = world->new_subgroup(line);
    if (group) mine = group;
  }
  return mine;
}

}  // namespace

DeviceMesh::DeviceMesh(comm::ProcessGroupPtr world, std::vector<int64_t> shape,
                       std::vector<std::string> dim_names, std::vector<int> ranks,
                       std::vector<int64_t> coordinate, std::vector<comm::ProcessGroupPtr> groups)
    : world_(std::move(world)),
      shape_(std::move(shape)),
      dim_names_(std::move(dim_names)),
      ranks_(std::move(ranks)),
      coordinate_(std::move(coordinate)),
      groups_(std::move(groups)) {}

std::shared_ptr<DeviceMesh> DeviceMesh::Create(comm::ProcessGroupPtr world,
                                               std::vector<int64_t> shape,
                                               std::vector<std::string> dim_names) {
  TORCH_CHECK(world != nullptr, "DeviceMesh::Create: world group is null");
  TORCH_CHECK(!shape.empty(), "DeviceMesh::Create: shape must have at least one dimension");
  int64_t numel = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    TORCH_CHECK(shape[d] >= 1, "DeviceMesh::Create: shape[", d, "] must be >= 1, got ", shape[d]);
    numel *= shape[d];
  }
  TORCH_CHECK(numel == world->size(), "DeviceMesh::Create: mesh shape [", absl::StrJoin(shape, ", "),
              "] holds ", numel, " ranks but the world group has ", world->size());
  TORCH_CHECK(dim_names.empty() || dim_names.size() == shape.size(),
              "DeviceMesh::Create: dim_names has ", dim_names.size(), " names for ", shape.size(),
              " dimensions");
  std::set<std::string> seen;
  for (const auto& name : dim_names) {
    TORCH_CHECK(!name.empty(), "DeviceMesh::Create: dim_names must not be empty strings");
    TORCH_CHECK(seen.insert(name).second, "DeviceMesh::Create: dim name '", name, "' is repeated");
  }
  std::vector<int> ranks(numel);
  std::iota(ranks.begin(), ranks.end(), 0);
  std::vector<int64_t> coordinate = CoordinateOf(world->rank(), shape);
  std::vector<comm::ProcessGroupPtr> groups;
  for (int d = 0; d < static_cast<int>(shape.size()); ++d) {
    groups.push_back(CreateLineGroups(world, shape, {d}));
  }
  return std::shared_ptr<DeviceMesh>(new DeviceMesh(std::move(world), std::move(shape),
                                                    std::move(dim_names), std::move(ranks),
                                                    std::move(coordinate), std::move(groups)));
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

const comm::ProcessGroupPtr& DeviceMesh::group(const std::string& name) const {
  return groups_[dim_index(name)];
}

std::shared_ptr<DeviceMesh> DeviceMesh::operator[](const std::string& name) const {
  return slice({name});
}

std::shared_ptr<DeviceMesh> DeviceMesh::slice(const std::vector<std::string>& names) const {
  TORCH_CHECK(!names.empty(), "DeviceMesh: slicing needs at least one dimension name");
  std::vector<int> dims;
  for (const auto& name : names) {
    const int d = dim_index(name);
    TORCH_CHECK(std::find(dims.begin(), dims.end(), d) == dims.end(), "DeviceMesh: dimension '",
                name, "' named twice in a slice");
    dims.push_back(d);
  }
  std::vector<int64_t> shape, coordinate;
  std::vector<comm::ProcessGroupPtr> groups;
  for (int d : dims) {
    shape.push_back(shape_[d]);
    coordinate.push_back(coordinate_[d]);
    groups.push_back(groups_[d]);
  }
  std::vector<int> ranks;
  for (int position : LineRanks(shape_, coordinate_, dims)) ranks.push_back(ranks_[position]);
  return std::shared_ptr<DeviceMesh>(new DeviceMesh(world_, std::move(shape), names, std::move(ranks),
                                                    std::move(coordinate), std::move(groups)));
}

std::shared_ptr<DeviceMesh> DeviceMesh::flatten(const std::vector<std::string>& names,
                                                const std::string& new_name) const {
  TORCH_CHECK(!names.empty(), "DeviceMesh::flatten: needs at least one dimension name");
  TORCH_CHECK(!new_name.empty(), "DeviceMesh::flatten: new_name must not be empty");
  std::vector<int> dims;
  for (const auto& name : names) dims.push_back(dim_index(name));
  for (size_t i = 1; i < dims.size(); ++i) {
    TORCH_CHECK(dims[i] == dims[i - 1] + 1, "DeviceMesh::flatten: dimensions [",
                absl::StrJoin(names, ", "), "] must be adjacent and in mesh order");
  }
  TORCH_CHECK(ranks_.size() == static_cast<size_t>(world_->size()),
              "DeviceMesh::flatten: only meshes over the whole world can be flattened; slice after "
              "flattening instead");
  int64_t size = 1;
  int64_t coordinate = 0;
  for (int d : dims) {
    size *= shape_[d];
    coordinate = coordinate * shape_[d] + coordinate_[d];
  }
  std::vector<int> ranks;
  for (int position : LineRanks(shape_, coordinate_, dims)) ranks.push_back(ranks_[position]);
  auto group = dims.size() == 1 ? groups_[dims[0]] : CreateLineGroups(world_, shape_, dims);
  return std::shared_ptr<DeviceMesh>(new DeviceMesh(world_, {size}, {new_name}, std::move(ranks),
                                                    {coordinate}, {group}));
}

std::string DeviceMesh::ToString() const {
  std::vector<std::string> dims;
  for (int d = 0; d < ndim(); ++d) {
    dims.push_back(dim_names_.empty() ? absl::StrCat(shape_[d])
                                      : absl::StrCat(dim_names_[d], "=", shape_[d]));
  }
  return absl::StrCat("DeviceMesh((", absl::StrJoin(dims, ", "), "), ranks=[",
                      absl::StrJoin(ranks_, ", "), "])");
}

}  // namespace fsdp::mesh
