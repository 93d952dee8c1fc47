// The FSDP1 (wrap_fsdp) parameters of a model as this rank holds them, and their optimizer
// state between the optimizer's flat form and DCP's per-parameter form: private to
// //dcp:fsdp1 (fsdp1_adapter.cc, flat_optim.cc).
//
// Contract: local, no communication; the pieces' tensors alias the model's flat shards.
// Errors are c10::Errors naming the caller, the parameter and the state.
#ifndef FSDP_DCP_FLAT_PIECES_H_
#define FSDP_DCP_FLAT_PIECES_H_

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

#include "optim_state/optim_state_dict.h"

namespace fsdp::dcp::internal {

// An FSDP1 parameter as this rank holds it: its elements [flat_start, + local.numel()) in
// row-major order (fsdp1::LocalFlatPieces); `local` undefined: none.
struct FlatPiece {
  std::vector<int64_t> shape;
  int64_t flat_start = 0;
  at::Tensor local;
  int64_t offset_in_shard = 0;  // of the piece in its flat parameter's local shard
  std::string flat_param_key;   // the flat parameter's key in the optimizer's local state
  int64_t shard_numel = 0;      // of that local shard
};

// The FSDP1 parameters of a wrap_fsdp tree: pieces by parameter name (tied parameters
// under each name), and each flat parameter's original parameters (primary names) in order.
struct FlatModel {
  std::map<std::string, FlatPiece> by_fqn;
  std::map<std::string, std::vector<std::string>> fqns_of_flat_param;
};

// FSDP1 optimizer state between the optimizer's local form (flat-parameter keys, this rank's
// flat shard: optim_state::GetShardedOptimStateDict) and DCP's (original parameter names;
// positive-dim tensors as this rank's 1-D piece of each, empty where it holds none; scalars
// repeated for each original parameter; param groups listing original names).
optim_state::OptimStateDict FlatOptimToPieces(const optim_state::OptimStateDict& local, const FlatModel& flat);
optim_state::OptimStateDict PiecesToFlatOptim(const optim_state::OptimStateDict& pieces, const FlatModel& flat,
                                              const char* caller);

}  // namespace fsdp::dcp::internal

#endif  // FSDP_DCP_FLAT_PIECES_H_
