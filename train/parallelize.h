// The job's model and how it is spread over the ranks: torchtitan's ParallelDims and
// parallelize_llama (torchtitan/distributed/parallel_dims.py, models/llama3/parallelize.py,
// distributed/fsdp.py apply_fsdp_to_decoder) for the Llama model of //models/llama.
//
// Contract:
// - ResolveModelConfig turns [model] into the model's dimensions (a torchtitan flavor, or with
//   flavor "" the model of hf_assets_path's config.json, with the keys set in [model]
//   replacing its values) and checks them against the tensor-parallel degree: one c10::Error
//   naming the key, its value and the degree. Reads no file but that config.json.
// - BuildMeshes is collective over `world` (it creates the sub-groups): the world mesh
//   (dp_replicate, dp_shard, tp), with pp first and cp before tp when they are used; FSDP's mesh
//   (1-D dp_shard, dp_replicate x dp_shard for HSDP, dp_shard x cp flattened in place of
//   dp_shard with context parallelism, as torchtitan's dp_shard_cp), the tp
//   and cp meshes, the flattened data-parallel mesh that reads the batch and the one the loss and
//   token counts reduce over (with cp's ranks, which hold the same rows' other tokens).
// - ParallelizeLlama, on an unsharded model (on the meta device: TP broadcasts no values),
//   every rank alike: tensor parallelism on the tp
//   mesh (enable_sequence_parallel), activation checkpointing on every decoder layer (full, or
//   selective with torchtitan's per-operator policy, selective_ac.h; an error naming
//   force_recompute_mm_shapes_by_fqns if it names a module that is no Linear), then fully_shard
//   per torchtitan: the embedding, each decoder
//   layer, the root (final norm and head), with the reshard policy and the mixed-precision
//   policy (cast_forward_inputs off) of the config, gradient division off (the loss is
//   already divided by the global token count) and the non-finite gradient sentinel on (off
//   with pipeline parallelism: its check after each backward is collective over the world,
//   and a pipeline's ranks run their backwards at different times). A pipeline stage's part
//   shards what it has (no embedding, or no head); with pipeline parallelism "default" keeps
//   the blocks unsharded after forward, as torchtitan's policy.
#ifndef FSDP_TRAIN_PARALLELIZE_H_
#define FSDP_TRAIN_PARALLELIZE_H_

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

#include "comm/process_group.h"
#include "fsdp/fsdp2/fully_shard.h"
#include "mesh/device_mesh.h"
#include "models/llama/model.h"
#include "train/config.h"

namespace fsdp::train {

models::llama::LlamaConfig ResolveModelConfig(const JobConfig& config, int64_t tp_degree);

// at::kFloat or at::kBFloat16.
c10::ScalarType ScalarTypeOf(DType dtype);

struct ParallelMeshes {
  // ([pp,] dp_replicate, dp_shard, [cp,] tp): pp and cp only when their degree is > 1
  mesh::DeviceMeshPtr world;
  // dp_shard or (dp_replicate, dp_shard); with cp, dp_shard x cp flattened in place of dp_shard
  mesh::DeviceMeshPtr fsdp;
  mesh::DeviceMeshPtr tp;     // null when the tp degree is 1
  mesh::DeviceMeshPtr cp;     // null when the cp degree is 1
  mesh::DeviceMeshPtr batch;  // the data-parallel ranks as one dim: who reads which rows
  mesh::DeviceMeshPtr loss;   // batch x cp: the ranks whose tokens make the global batch
  mesh::DeviceMeshPtr pp;     // null when the pp degree is 1
  int64_t dp_rank = 0, dp_size = 1;
};

ParallelMeshes BuildMeshes(const comm::ProcessGroupPtr& world, const ResolvedDegrees& degrees);

// With model.converters = ["float8"]: converts the model's Linears to float8 linears per
// [float8] (float8/float8_linear.h); returns how many. ParallelizeLlama calls it first.
int ConvertFloat8(models::llama::LlamaForCausalLM& model, const JobConfig& config);

// Returns the fully_shard handles, the root's last. `device`: fully_shard's, where the meta
// parameters' shards are materialized (the CPU, or this rank's CUDA device).
std::vector<fsdp2::FSDPModule> ParallelizeLlama(models::llama::LlamaForCausalLM& model, const JobConfig& config,
                                                const ParallelMeshes& meshes, c10::Device device);

// torchtitan's init_weights after sharding: fsdp2::InitMetaParameters with
// models::llama::InitTorchtitanParameter on each full parameter (seeded by `seed` and its name),
// each rank keeping its shard; the same values at every world size and mesh. Local.
void InitTorchtitanWeights(models::llama::LlamaForCausalLM& model, uint64_t seed);

}  // namespace fsdp::train

#endif  // FSDP_TRAIN_PARALLELIZE_H_
