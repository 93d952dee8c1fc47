#include "fsdp/fsdp2/mesh_info.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp {

FSDPMeshInfo FSDPMeshInfo::Fsdp(mesh::DeviceMeshPtr mesh) {
  TORCH_CHECK(mesh != nullptr, "FSDP: mesh is null");
  TORCH_CHECK(mesh->ndim() == 1, "FSDP: sharding needs a 1-D mesh, got ", mesh->ToString());
  return FSDPMeshInfo{Kind::kFsdp, std::move(mesh)};
}

FSDPMeshInfo FSDPMeshInfo::Hsdp(mesh::DeviceMeshPtr mesh) {
  TORCH_CHECK(mesh != nullptr, "FSDP: mesh is null");
  TORCH_CHECK(mesh->ndim() == 2, "FSDP: HSDP needs a 2-D (replicate, shard) mesh, got ", mesh->ToString());
  return FSDPMeshInfo{Kind::kHsdp, std::move(mesh)};
}

FSDPMeshInfo FSDPMeshInfo::Ddp(mesh::DeviceMeshPtr mesh) {
  TORCH_CHECK(mesh != nullptr, "FSDP: mesh is null");
  TORCH_CHECK(mesh->ndim() == 1, "FSDP: replication needs a 1-D mesh, got ", mesh->ToString());
  return FSDPMeshInfo{Kind::kDdp, std::move(mesh)};
}

namespace {

// The indices of `names` in `spmd`, which must name distinct dims in the mesh's order
// (PyTorch's mesh[names] refuses any other order).
std::vector<int> DimIndices(const mesh::DeviceMesh& spmd, const std::vector<std::string>& names, const char* what) {
  std::vector<int> indices;
  const std::vector<std::string>& dims = spmd.dim_names();
  for (const std::string& name : names) {
    TORCH_CHECK(std::find(dims.begin(), dims.end(), name) != dims.end(), "FSDP: Mesh dim name '", name,
                "' (dp_mesh_dims.", what, ") not found in mesh.mesh_dim_names (", absl::StrJoin(dims, ", "), ")");
    indices.push_back(spmd.dim_index(name));
    TORCH_CHECK(indices.size() == 1 || indices.back() > indices[indices.size() - 2], "FSDP: dp_mesh_dims.", what, " (",
                absl::StrJoin(names, ", "), ") must name distinct mesh dims in the mesh's order (",
                absl::StrJoin(dims, ", "), ")");
  }
  return indices;
}

// One named dim, or several flattened into one (PyTorch's mesh[names]._flatten("_".join(names))).
mesh::DeviceMeshPtr DataParallelSubmesh(const mesh::DeviceMesh& spmd, const std::vector<std::string>& names) {
  if (names.size() == 1) return spmd[names[0]];
  return spmd.slice(names)->flatten(names, absl::StrJoin(names, "_"));
}

}  // namespace

FSDPMeshInfo FSDPMeshInfo::Spmd(mesh::DeviceMeshPtr spmd_mesh, const std::vector<std::string>& shard,
                                const std::vector<std::string>& replicate) {
  TORCH_CHECK(spmd_mesh != nullptr, "FSDP: mesh is null");
  TORCH_CHECK(!shard.empty() || !replicate.empty(),
              "FSDP: At least one of shard or replicate must be set in dp_mesh_dims");
  TORCH_CHECK(!spmd_mesh->dim_names().empty(), "FSDP: dp_mesh_dims needs a mesh with dim names, got ",
              spmd_mesh->ToString());
  std::vector<int> shard_dims = DimIndices(*spmd_mesh, shard, "shard");
  std::vector<int> replicate_dims = DimIndices(*spmd_mesh, replicate, "replicate");
  FSDPMeshInfo info;
  if (replicate.empty()) {
    info = Fsdp(DataParallelSubmesh(*spmd_mesh, shard));
  } else if (shard.empty()) {
    info = Ddp(DataParallelSubmesh(*spmd_mesh, replicate));
  } else {
    TORCH_CHECK(replicate_dims.back() < shard_dims.front(), "FSDP: the dp replicate dims (",
                absl::StrJoin(replicate, ", "), ") must come before the dp shard dims (", absl::StrJoin(shard, ", "),
                ") in ", spmd_mesh->ToString());
    info =
        Hsdp(mesh::Concatenate({DataParallelSubmesh(*spmd_mesh, replicate), DataParallelSubmesh(*spmd_mesh, shard)}));
  }
  info.spmd_dp_shard_dims = std::move(shard_dims);
  info.spmd_dp_replicate_dims = std::move(replicate_dims);
  info.spmd_mesh = std::move(spmd_mesh);
  return info;
}

const comm::ProcessGroupPtr& FSDPMeshInfo::shard_group() const {
  TORCH_CHECK(shards(), "FSDP: a DDP mesh has no shard group");
  return mesh->group(shard_mesh_dim());
}

const comm::ProcessGroupPtr& FSDPMeshInfo::replicate_group() const {
  TORCH_CHECK(replicates(), "FSDP: an FSDP mesh has no replicate group");
  return mesh->group(0);
}

std::string FSDPMeshInfo::ToString() const {
  const char* kind_name = kind == Kind::kFsdp ? "FSDP" : kind == Kind::kHsdp ? "HSDP" : "DDP";
  std::string out = absl::StrCat(kind_name, " on ", mesh->ToString());
  if (spmd_mesh) absl::StrAppend(&out, " of SPMD ", spmd_mesh->ToString());
  return out;
}

}  // namespace fsdp
