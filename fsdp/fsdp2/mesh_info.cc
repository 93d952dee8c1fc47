#include "fsdp/fsdp2/mesh_info.h"

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

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

FSDPMeshInfo FSDPMeshInfo::Spmd(mesh::DeviceMeshPtr spmd_mesh, const std::string& shard,
                                const std::optional<std::string>& replicate) {
  TORCH_CHECK(spmd_mesh != nullptr, "FSDP: mesh is null");
  TORCH_CHECK(!spmd_mesh->dim_names().empty(), "FSDP: dp_mesh_dims needs a mesh with dim names, got ",
              spmd_mesh->ToString());
  FSDPMeshInfo info = replicate ? Hsdp(spmd_mesh->slice({*replicate, shard})) : Fsdp((*spmd_mesh)[shard]);
  info.spmd_dp_shard_dim = spmd_mesh->dim_index(shard);
  if (replicate) {
    info.spmd_dp_replicate_dim = spmd_mesh->dim_index(*replicate);
    TORCH_CHECK(info.spmd_dp_replicate_dim < info.spmd_dp_shard_dim, "FSDP: the dp replicate dim '", *replicate,
                "' must come before the dp shard dim '", shard, "' in ", spmd_mesh->ToString());
  }
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
