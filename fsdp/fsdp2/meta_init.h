// Deferred (meta-device) init for fully_shard'ed models: build the model on the meta device
// (fsdp/meta/meta.h), fully_shard it (each rank allocates only its shards, uninitialized),
// then fill the shards one of these ways:
//  * InitMetaParameters(root, init_fn): every module with tensors still to fill is
//    materialized whole, one module at a time, `init_fn` runs on it (e.g. its
//    reset_parameters() under a seeded generator), and each rank keeps its shard of the
//    result. Every rank runs the same init on the same full tensors in the same order, so the
//    values equal a single-rank init with the same seed, bitwise, at any world size and mesh.
//  * from rank 0 (PyTorch's broadcast_from_rank0): rank 0 holds a full state dict (e.g.
//    LoadFullStateDictFile) and LoadFullStateDict(root, sd, {.rank0_only = true}) broadcasts
//    one tensor at a time; every rank keeps only its shard.
//  * LoadShardedStateDict, or fsdp::dcp::Load of a checkpoint (dcp/dcp.h).
// The root's lazy init (first forward or unshard) refuses a parameter whose shard was never
// filled and a buffer still on the meta device, naming it.
//
// Contract of InitMetaParameters:
//  * Visits root.modules() (pre-order, root first). A module is initialized when it directly
//    holds (recurse=false) an FSDP parameter whose shard needs init, or a parameter or buffer
//    on the meta device. Then, under NoGradGuard: each such FSDP parameter's data becomes a
//    fresh full tensor (its global shape, for FSDP + TP the whole DTensor's, in its dtype, on
//    FSDP's device), each meta tensor FSDP does not manage (buffers, ignored parameters) is
//    allocated whole on that device (uninitialized), and init_fn(module) runs; it must set
//    every value it is responsible for. Then each FSDP parameter keeps this rank's shard
//    and the full tensor is freed. A parameter tied across modules stays whole until the
//    last module holding it was initialized.
//  * Peak memory beyond the shards: the largest module's own full parameters (or a tied
//    group's) plus the buffers and unmanaged parameters (kept whole, as FSDP2 keeps them).
//  * Local: no communication. Call it on every rank after fully_shard, before the first
//    forward and before creating optimizer state. FSDP groups are resharded first.
//  * Errors: init_fn's exception propagates (parameters it left unfilled still refuse to
//    run); a module already initialized is not visited again.
#ifndef FSDP_FSDP_FSDP2_META_INIT_H_
#define FSDP_FSDP_FSDP2_META_INIT_H_

#include <functional>

#include "fsdp/meta/meta.h"

namespace torch::nn {
class Module;
}

namespace fsdp::fsdp2 {

using ModuleInitFn = std::function<void(torch::nn::Module&)>;

void InitMetaParameters(torch::nn::Module& root, const ModuleInitFn& init_fn);

}  // namespace fsdp::fsdp2

#endif  // FSDP_FSDP_FSDP2_META_INIT_H_
