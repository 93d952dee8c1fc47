// Which mesh dimensions FSDP shards over and which it replicates over.
#ifndef FSDP_FSDP_FSDP2_MESH_INFO_H_
#define FSDP_FSDP_FSDP2_MESH_INFO_H_

#include <optional>
#include <string>
#include <vector>

#include "comm/process_group.h"
#include "mesh/device_mesh.h"

namespace fsdp {

// PyTorch's FSDPMeshInfo / HSDPMeshInfo / DDPMeshInfo in one value:
//   kFsdp: 1-D mesh, parameters sharded over it;
//   kHsdp: 2-D mesh (replicate dim 0, shard dim 1): sharded within a row, gradients
//          reduce-scattered in the row then all-reduced across rows;
//   kDdp:  1-D mesh, parameters replicated, gradients all-reduced.
struct FSDPMeshInfo {
  enum class Kind { kFsdp, kHsdp, kDdp };
  Kind kind = Kind::kFsdp;
  mesh::DeviceMeshPtr mesh;
  // SPMD (fully_shard's dp_mesh_dims): parameters are DTensors on `spmd_mesh`, Replicate on
  // its data-parallel dims; `mesh` is those dims (several shard or several replicate dims
  // flattened into one). Null otherwise.
  mesh::DeviceMeshPtr spmd_mesh;
  std::vector<int> spmd_dp_shard_dims;      // indices in spmd_mesh, ascending; none for DDP
  std::vector<int> spmd_dp_replicate_dims;  // indices in spmd_mesh, ascending; none for FSDP

  static FSDPMeshInfo Fsdp(mesh::DeviceMeshPtr mesh);
  static FSDPMeshInfo Hsdp(mesh::DeviceMeshPtr mesh);
  static FSDPMeshInfo Ddp(mesh::DeviceMeshPtr mesh);

  // FSDP (shard only), HSDP (both) or DDP (replicate only) over named dims of an SPMD mesh,
  // as PyTorch 2.15's _get_mesh_info_from_named_dims: several names are flattened into one
  // dim named by joining them with '_' (collective over the world, as mesh::flatten).
  static FSDPMeshInfo Spmd(mesh::DeviceMeshPtr spmd_mesh, const std::vector<std::string>& shard,
                           const std::vector<std::string>& replicate);

  bool is_spmd_mesh() const { return spmd_mesh != nullptr; }
  bool shards() const { return kind != Kind::kDdp; }
  bool replicates() const { return kind != Kind::kFsdp; }
  int shard_mesh_dim() const { return kind == Kind::kHsdp ? 1 : 0; }
  // The shard group (size 1 for DDP: a group of this rank alone is never needed).
  const comm::ProcessGroupPtr& shard_group() const;
  int64_t shard_size() const { return shards() ? mesh->size(shard_mesh_dim()) : 1; }
  int64_t shard_rank() const { return shards() ? mesh->local_rank(shard_mesh_dim()) : 0; }
  const comm::ProcessGroupPtr& replicate_group() const;  // kHsdp (dim 0) or kDdp (dim 0)
  int64_t replicate_size() const { return replicates() ? mesh->size(0) : 1; }
  std::string ToString() const;
};

}  // namespace fsdp

#endif  // FSDP_FSDP_FSDP2_MESH_INFO_H_
