#include "fsdp/common/mesh_info.h"

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
  TORCH_CHECK(mesh->ndim() == 2, "FSDP: HSDP needs a 2-D (replicate, shard) mesh, got ",
              mesh->ToString());
  return FSDPMeshInfo{Kind::kHsdp, std::move(mesh)};
}

FSDPMeshInfo FSDPMeshInfo::Ddp(mesh::DeviceMeshPtr mesh) {
  TORCH_CHECK(mesh != nullptr, "FSDP: mesh is null");
  TORCH_CHECK(mesh->ndim() == 1, "FSDP: replication needs a 1-D mesh, got ", mesh->ToString());
  return FSDPMeshInfo{Kind::kDdp, std::move(mesh)};
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
  return absl::StrCat(kind_name, " on ", mesh->ToString());
}

}  // namespace fsdp
