// SummonFullParams: PyTorch's _unshard_params / _unshard_params_for_summon /
// _unshard_fsdp_state_params / _writeback_to_local_shard
// (torch/distributed/fsdp/_unshard_param_utils.py, v2.15.0) over this repo's FSDP1 runtime.
//
// C++ differences:
//  - Without use_orig_params PyTorch swaps the registered FlatParameter for the originals as
//    nn.Parameters (_unflatten_as_params); here the originals are always the registered
//    parameters and FlatParamHandle::Unshard already makes them views of the unsharded flat
//    parameter, so there is nothing to swap.
//  - All states are validated (arguments, training state, poisoning) before the first
//    all-gather, so a bad call fails the same way on every rank without a half-issued
//    collective; PyTorch validates each state as its ExitStack enters it.
//  - offload_to_cpu on a non-CPU device keeps the device copy of the unsharded flat parameter
//    and points the originals at CPU copies (PyTorch frees the device copy meanwhile and
//    re-gathers from the CPU copy on exit); on exit the CPU values are copied back first
//    when writing back. With a CPU compute device it is a no-op, as PyTorch's to_cpu().
#include "fsdp/fsdp1/summon_full_params.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <exception>
#include <string>

#include "fsdp/common/flat_layout.h"
#include "fsdp/fsdp1/fsdp_state.h"

namespace fsdp::fsdp1 {
namespace {

const char* Bool(bool b) { return b ? "true" : "false"; }

// _validate_unshard_params_args, in PyTorch's order. PyTorch raises NotImplementedError
// (TORCH_CHECK_NOT_IMPLEMENTED: a c10::NotImplementedError, which is a c10::Error).
void ValidateArgs(const FSDPState& state, const SummonFullParamsOptions& o) {
  const bool use_orig_params = state.options().use_orig_params;
  TORCH_CHECK_NOT_IMPLEMENTED(!(o.with_grads && (o.offload_to_cpu || !use_orig_params)),
                              "SummonFullParams: with_grads=", Bool(o.with_grads),
                              ", use_orig_params=", Bool(use_orig_params), ", offload_to_cpu=", Bool(o.offload_to_cpu),
                              " is not supported yet");
  // PyTorch 2.15 supports with_grads (use_orig_params, no offload_to_cpu): unshard_grad's
  // all-reduce of "no gradient" flags plus an all-gather of the sharded gradient.
  TORCH_CHECK_NOT_IMPLEMENTED(!o.with_grads,
                              "SummonFullParams: with_grads=true is not implemented in this C++ "
                              "port yet (PyTorch supports it with use_orig_params=true and "
                              "offload_to_cpu=false); gather gradients with a state dict instead");
  const FlatParamHandle* h = state.handle();
  TORCH_CHECK_NOT_IMPLEMENTED(!(o.offload_to_cpu && h != nullptr && !h->uses_sharded_strategy()),
                              "SummonFullParams: offload_to_cpu=true and NO_SHARD is not supported yet (FSDP module '",
                              state.name(), "')");
  // The parameter shapes would differ across ranks in the scope, so a writeback could leave
  // the ranks inconsistent (PyTorch: rank 0 would have to broadcast the flat parameter).
  TORCH_CHECK_NOT_IMPLEMENTED(!(o.writeback && o.rank0_only),
                              "SummonFullParams: writeback=true and rank0_only=true is not supported yet; pass "
                              "writeback=false with rank0_only=true");
}

}  // namespace

SummonFullParams::SummonFullParams(const FullyShardedDataParallel& fsdp, SummonFullParamsOptions options)
    : SummonFullParams(fsdp.module(), options) {}

SummonFullParams::SummonFullParams(torch::nn::Module& module, SummonFullParamsOptions options) : options_(options) {
  std::vector<FSDPState*> states;
  if (options_.recurse) {
    states = CollectStates(module);  // traversal_utils._get_fsdp_states_with_modules: pre-order
  } else if (FSDPState* s = GetState(module)) {
    states.push_back(s);  // _get_module_fsdp_state: the module's own state only
  }
  if (states.empty()) return;  // PyTorch's nullcontext
  for (FSDPState* s : states) ValidateArgs(*s, options_);
  if (options_.offload_to_cpu && !options_.rank0_only) {
    TORCH_WARN(
        "SummonFullParams: offload_to_cpu=true and rank0_only=false may result in the unsharded parameters "
        "being redundantly copied to CPU memory for GPUs sharing the same CPU memory, which risks CPU OOM. "
        "We recommend using offload_to_cpu=true with rank0_only=true.");
  }
  // _lazy_init (collective-free): the outermost state of each tree becomes its root.
  for (FSDPState* s : states) {
    s->CheckNotPoisoned("SummonFullParams");
    s->LazyInit();
  }
  for (FSDPState* s : states) {
    TORCH_CHECK(s->training_state() != FSDPTrainingState::FORWARD_BACKWARD,
                "SummonFullParams: Cannot manually unshard parameters during forward/backward (FSDP module '",
                s->name(), "' is in training state FORWARD_BACKWARD)");
    TORCH_CHECK(s->training_state() != FSDPTrainingState::SUMMON_FULL_PARAMS,
                "SummonFullParams: Cannot manually unshard parameters when already unsharding parameters (FSDP "
                "module '",
                s->name(), "' is in training state SUMMON_FULL_PARAMS)");
  }
  try {
    Enter(states);
  } catch (...) {
    // Leave what was entered (errors there are recorded in the poison record already).
    try {
      Exit();
    } catch (...) {
    }
    throw;
  }
}

void SummonFullParams::Enter(const std::vector<FSDPState*>& states) {
  at::NoGradGuard no_grad;
  for (FSDPState* s : states) {
    entered_.push_back(Entered{s});
    Entered& e = entered_.back();
    s->training_state_ = FSDPTrainingState::SUMMON_FULL_PARAMS;
    FlatParamHandle* h = s->handle();
    // _unshard_fsdp_state_params: a handle shared with another module may be unsharded already.
    if (h == nullptr || h->training_state() == HandleTrainingState::SUMMON_FULL_PARAMS) continue;
    s->Guard("SummonFullParams", [&] {
      TORCH_CHECK(h->training_state() == HandleTrainingState::IDLE, "Expects the handle training to be IDLE but got ",
                  ToString(h->training_state()));
      // In SUMMON_FULL_PARAMS the handle forces full precision (unshards local_shard).
      h->set_training_state(HandleTrainingState::SUMMON_FULL_PARAMS);
      e.unsharded = true;
      if (h->use_orig_params()) h->ResetFlatParamGradInfoIfNeeded();
      e.free_unsharded_flat_param = h->NeedsUnshard();
      // PyTorch synchronizes the device first: the all-gather reads shards the compute stream
      // (an optimizer step) may have written.
      h->streams().unshard->WaitStream(*h->streams().current);
      s->Unshard(*h);
      h->WaitForUnshard();
      if (options_.rank0_only && s->process_group()->rank() != 0) {
        // Free the unsharded flat parameter early: this rank keeps its shard in the scope.
        s->Reshard(*h, e.free_unsharded_flat_param);
        e.unsharded = false;  // the handle stays in SUMMON_FULL_PARAMS until the exit
        return;
      }
      if (options_.offload_to_cpu && h->uses_sharded_strategy() && !h->device().is_cpu()) {
        for (const at::Tensor& t : h->orig_params()) {
          e.cpu_copies.push_back(t.data().to(at::kCPU));
          at::Tensor(t).set_data(e.cpu_copies.back());
        }
      }
    });
  }
}

void SummonFullParams::ExitOne(Entered& e) {
  FSDPState* s = e.state;
  FlatParamHandle* h = s->handle();
  if (e.unsharded) {
    at::NoGradGuard no_grad;
    if (!e.cpu_copies.empty()) {
      // Back to the device views of the unsharded flat parameter (offload_to_cpu).
      if (options_.writeback) {
        const std::vector<at::Tensor> views = h->GetUnflatViews();
        for (size_t i = 0; i < views.size(); ++i) views[i].copy_(e.cpu_copies[i]);
      }
      e.cpu_copies.clear();
      h->UseUnshardedViews();
    }
    if (options_.writeback) {
      // _writeback_to_local_shard: the *unpadded* shard of the unsharded flat parameter
      // (persisting changes to alignment padding too); NO_SHARD: all of it.
      FlatParameter& fp = h->flat_param();
      const at::Tensor flat = fp.param.data();
      if (h->uses_sharded_strategy()) {
        const FlatChunk c = MakeFlatChunk(flat.numel(), h->world_size(), h->rank());
        if (c.end > c.start) {
          fp.local_shard.narrow(0, 0, c.end - c.start).copy_(flat.narrow(0, c.start, c.end - c.start));
        }
      } else if (flat.data_ptr() != fp.local_shard.data_ptr()) {  // NO_SHARD + offload_params
        fp.local_shard.view(-1).copy_(flat.view(-1));
      }
    }
    e.unsharded = false;
    s->Reshard(*h, e.free_unsharded_flat_param);
  }
}

void SummonFullParams::Exit() {
  if (exited_) return;
  exited_ = true;
  std::exception_ptr first;
  // Innermost first (PyTorch's ExitStack); every state gets back to IDLE even after an error.
  for (auto it = entered_.rbegin(); it != entered_.rend(); ++it) {
    FSDPState* s = it->state;
    try {
      if (it->unsharded) s->Guard("SummonFullParams exit", [&] { ExitOne(*it); });
    } catch (...) {
      if (!first) first = std::current_exception();
    }
    if (FlatParamHandle* h = s->handle();
        h != nullptr && h->training_state() == HandleTrainingState::SUMMON_FULL_PARAMS) {
      h->set_training_state(HandleTrainingState::IDLE);
    }
    s->training_state_ = FSDPTrainingState::IDLE;
  }
  entered_.clear();
  if (first) std::rethrow_exception(first);
}

SummonFullParams::~SummonFullParams() {
  std::string error;
  try {
    Exit();
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = e.what();
  } catch (...) {
    error = "unknown error";
  }
  if (!error.empty()) {
    try {
      TORCH_WARN("SummonFullParams: leaving the scope failed (the FSDP tree is poisoned): ", error);
    } catch (...) {  // a warning handler that throws must not escape the destructor
    }
  }
}

}  // namespace fsdp::fsdp1
