// The checkpoint adapter of wrap_fsdp'ed (FSDP1) models (dcp/adapter.h), registered for the
// kind "wrap_fsdp": each original parameter is saved as the flat range of it this rank's
// flat shard holds (at most 2 x dims - 1 boxes: plan.h FlatRangeBoxes), under its own name,
// as torch/distributed/fsdp/_state_dict_utils.py's SHARDED_STATE_DICT hands DCP each original
// parameter; the optimizer's flat state is cut into the same ranges (flat_optim.cc). Loads
// always stage (the flat optimizer state is reassembled from the pieces first); full saves
// are refused.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "dcp/adapter.h"
#include "dcp/flat_pieces.h"
#include "dcp/plan.h"
#include "fsdp/fsdp1/fsdp_state.h"
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"
#include "fsdp/fsdp1/state_dict.h"
#include "optim_state/fsdp1_optim_state.h"

namespace fsdp::dcp::internal {
namespace {

int64_t PieceNumel(const FlatPiece& f) { return f.local.defined() ? f.local.numel() : 0; }

class Fsdp1Param : public ShardedParam {
 public:
  explicit Fsdp1Param(const FlatPiece& f)
      : ShardedParam(f.shape, {PieceNumel(f)}, FlatRangeBoxes(f.shape, f.flat_start, PieceNumel(f)), f.local, f.local) {
  }

  at::Tensor Gather(const at::Tensor&) const override {
    TORCH_CHECK(false, "dcp: FSDP1 parameters are not gathered (Fsdp1Adapter::CheckFullSave refuses full saves)");
  }

  void Commit(const at::Tensor& value) const override {
    if (!value.is_same(live())) live().copy_(value);  // into the flat shard
  }
};

// The pieces of a wrap_fsdp tree rooted at `state`'s module.
FlatModel CollectFlatPieces(torch::nn::Module& model, fsdp1::FSDPState* state) {
  FlatModel out;
  const fsdp1::FullyShardedDataParallel root(state);
  for (fsdp1::LocalFlatPiece& p : fsdp1::LocalFlatPieces(root)) {
    out.fqns_of_flat_param[p.flat_param_key].push_back(p.fqn);
    out.by_fqn[p.fqn] =
        FlatPiece{std::move(p.shape), p.flat_start,     p.local.defined() ? p.local.detach() : at::Tensor(),
                  p.offset_in_shard,  p.flat_param_key, p.shard_numel};
  }
  // Tied parameters: the flat parameter lists the first name; the others share its piece.
  absl::flat_hash_map<const c10::TensorImpl*, std::string> first_name;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    auto [it, inserted] = first_name.emplace(item.value().unsafeGetTensorImpl(), item.key());
    if (!inserted && out.by_fqn.count(it->second) && !out.by_fqn.count(item.key())) {
      out.by_fqn[item.key()] = out.by_fqn[it->second];
    }
  }
  return out;
}

class Fsdp1Adapter : public ModelAdapter {
 public:
  Fsdp1Adapter(torch::nn::Module& model, const char* caller) {
    fsdp1::FSDPState* state = fsdp1::GetState(model);
    TORCH_CHECK(state != nullptr, caller,
                ": the model holds wrap_fsdp modules but its root is not one; checkpoint the wrap_fsdp root");
    TORCH_CHECK(state->inter_node_group() == nullptr, caller,
                ": FSDP1 hybrid sharding strategies are not supported (no one process group spans the replicas); "
                "use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD, or FSDP2's HSDP");
    state_ = state;
    world_ = state->process_group();
    flat_ = CollectFlatPieces(model, state);
    for (const auto& [fqn, piece] : flat_.by_fqn) params_.emplace(fqn, std::make_unique<Fsdp1Param>(piece));
  }

  comm::ProcessGroupPtr world() const override { return world_; }
  const ShardedParam* Sharded(const std::string& fqn) const override {
    auto it = params_.find(fqn);
    return it == params_.end() ? nullptr : it->second.get();
  }
  bool CanLoadInPlace() const override { return false; }
  void CheckFullSave(const char* caller) const override {
    TORCH_CHECK(false, caller,
                ": full state dicts (kFull, kFullRank0) of FSDP1 (wrap_fsdp) models are not supported; save "
                "kSharded (any world size and FSDP2 load it) or use fsdp1::GetFullStateDict");
  }

  optim_state::OptimStateDict GetOptimState(torch::nn::Module&,
                                            const torch::optim::Optimizer& optimizer) const override {
    return FlatOptimToPieces(optim_state::GetShardedOptimStateDict(Root(), optimizer), flat_);
  }
  void CheckOptimState(torch::nn::Module&, torch::optim::Optimizer&,
                       const optim_state::OptimStateDict&) const override {
    TORCH_CHECK(false, "dcp: FSDP1 models do not load in place; their optimizer state is checked as it installs");
  }
  void LoadOptimState(torch::nn::Module&, torch::optim::Optimizer& optimizer, const optim_state::OptimStateDict& state,
                      const char* caller) const override {
    optim_state::LoadShardedOptimStateDict(Root(), optimizer, PiecesToFlatOptim(state, flat_, caller));
  }

 private:
  fsdp1::FullyShardedDataParallel Root() const { return fsdp1::FullyShardedDataParallel(state_); }

  fsdp1::FSDPState* state_ = nullptr;
  comm::ProcessGroupPtr world_;
  FlatModel flat_;
  std::map<std::string, std::unique_ptr<Fsdp1Param>> params_;
};

std::unique_ptr<ModelAdapter> MakeFsdp1Adapter(torch::nn::Module& model, const char* caller) {
  return std::make_unique<Fsdp1Adapter>(model, caller);
}

const bool kFsdp1AdapterRegistered = RegisterModelAdapter("wrap_fsdp", &MakeFsdp1Adapter);

}  // namespace
}  // namespace fsdp::dcp::internal
