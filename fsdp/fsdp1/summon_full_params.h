// FSDP1's summon_full_params (PyTorch's FullyShardedDataParallel.summon_full_params in
// torch/distributed/fsdp/fully_sharded_data_parallel.py, implemented by _unshard_params in
// torch/distributed/fsdp/_unshard_param_utils.py) as a scope guard:
//
//   {
//     fsdp::fsdp1::SummonFullParams full(root, {.writeback = true});
//     at::NoGradGuard no_grad;
//     model->head->weight.mul_(0.5);   // the full parameter; this rank's part persists
//   }                                  // written back into this rank's shard, resharded
//
// While the guard lives, the original parameters of every FSDP module it covers (the tree
// with recurse, else the module's own FSDP state only) hold their full, unsharded values in
// full precision (mixed precision is ignored), as views into the all-gathered flat parameter.
// Leaving the scope writes this rank's part of them back into its shard when writeback is
// true (NO_SHARD keeps every in-place change regardless: the parameters are the shard), then
// reshards (frees the unsharded storage if the guard allocated it). Tensors replaced with
// set_data or new tensors assigned to the parameters are not written back (as PyTorch).
//
// Collective (an all-gather per sharded flat parameter) on entry: every rank of the process
// groups constructs the guard at the same point with the same options; leaving is local.
// Not inside forward / backward, and no forward / backward inside the scope.
#ifndef FSDP_FSDP_FSDP1_SUMMON_FULL_PARAMS_H_
#define FSDP_FSDP_FSDP1_SUMMON_FULL_PARAMS_H_

#include <vector>

#include "fsdp/fsdp1/fully_sharded_data_parallel.h"

namespace torch::nn {
class Module;
}

namespace fsdp::fsdp1 {

// summon_full_params' arguments, with PyTorch's defaults and rules (checked on entry):
struct SummonFullParamsOptions {
  // Every FSDP module of the tree (PyTorch's pre-order), or only the given module's own.
  bool recurse = true;
  // Write this rank's part of the (possibly modified) full parameters back into its shard
  // on exit; false discards changes (except NO_SHARD's, which are the shard itself).
  bool writeback = true;
  // Only rank 0 (of each handle's process group) unshards; the others reshard at once and
  // keep their sharded parameters in the scope. Not with writeback.
  bool rank0_only = false;
  // The full parameters live on the CPU in the scope (sharded strategies only; no-op when
  // the compute device is the CPU). PyTorch recommends it with rank0_only (it only warns
  // otherwise: each rank gets a CPU copy).
  bool offload_to_cpu = false;
  // Also unshard the gradients: PyTorch supports this with use_orig_params and without
  // offload_to_cpu; not implemented here yet (an error, see the .cc).
  bool with_grads = false;
};

class FSDPState;

// The scope: constructing it unshards, destroying it (or Exit()) writes back and reshards.
class [[nodiscard]] SummonFullParams {
 public:
  // On `fsdp`'s module (its tree with recurse).
  SummonFullParams(const FullyShardedDataParallel& fsdp, SummonFullParamsOptions options = {});
  // On any module: every FSDP module of its tree (recurse), else its own FSDP state if it has
  // one (none: a no-op scope), as PyTorch accepts non-FSDP modules.
  explicit SummonFullParams(torch::nn::Module& module, SummonFullParamsOptions options = {});
  SummonFullParams(const SummonFullParams&) = delete;
  SummonFullParams& operator=(const SummonFullParams&) = delete;
  SummonFullParams(SummonFullParams&&) = delete;
  SummonFullParams& operator=(SummonFullParams&&) = delete;

  // Leaves the scope now: writeback and reshard, innermost FSDP module first (PyTorch's
  // ExitStack order). Throws the first error; the tree is then poisoned (every later FSDP
  // call fails with it) since some flat parameters may be left unsharded. Idempotent.
  void Exit();
  // Exit() unless done already; never throws: a failure poisons the tree as in Exit() (the
  // next FSDP call of the tree fails naming it) and is reported with TORCH_WARN. Call Exit()
  // first to get the error as an exception.
  ~SummonFullParams();

 private:
  struct Entered {
    FSDPState* state = nullptr;
    bool unsharded = false;                  // the handle is in SUMMON_FULL_PARAMS
    bool free_unsharded_flat_param = false;  // the guard allocated the unsharded storage
    std::vector<at::Tensor> cpu_copies;      // offload_to_cpu: the originals' CPU data
  };
  void Enter(const std::vector<FSDPState*>& states);
  void ExitOne(Entered& e);

  SummonFullParamsOptions options_;
  std::vector<Entered> entered_;  // in entry order
  bool exited_ = false;
};

}  // namespace fsdp::fsdp1

#endif  // FSDP_FSDP_FSDP1_SUMMON_FULL_PARAMS_H_
