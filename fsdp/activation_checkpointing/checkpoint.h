// Activation checkpointing for LibTorch: the C++ counterpart of torch.utils.checkpoint.checkpoint
// (torch/utils/checkpoint.py). LibTorch has none.
//
//   at::Tensor y = fsdp::activation_checkpointing::checkpoint(
//       [&](const std::vector<at::Tensor>& in) { return block(in[0]); }, {x});
//
// Forward runs `fn` under no-grad, so none of its intermediate activations stay alive; only the
// inputs (and the RNG state) are kept. When the gradient reaches the outputs, `fn` runs again
// with grad enabled on detached copies of the inputs, from the same RNG state (dropout draws the
// same mask), and the incoming gradients are backpropagated through that recomputation: the
// parameters `fn` reads accumulate their .grad exactly as without checkpointing, and the inputs'
// gradients flow on.
//
// Mechanism: a custom autograd Function whose backward runs a nested backward (PyTorch's
// "reentrant" CheckpointFunction, checkpoint.py: class CheckpointFunction). LibTorch cannot
// install saved-tensor default hooks from C++ (at::SavedTensorDefaultHooks only takes Python
// objects), which the non-reentrant implementation (_checkpoint_without_reentrant_generator)
// needs. Behaviour against PyTorch's recommended use_reentrant=False:
//   same:   gradients (bitwise on the CPU); the RNG state of the first forward is replayed for
//           the CPU generator and the default generator of every other device among the inputs
//           (fork_rng: the caller's RNG stream is left as it was); inputs that do not require
//           grad (the parameters reached inside `fn` still get gradients, see
//           CheckpointOptions::params); outputs whose gradient never arrives (skipped);
//           nested checkpoints (each level recomputes when its backward runs); a metadata
//           determinism check (here on the outputs' shapes / dtypes / devices, PyTorch checks
//           the saved tensors'); under no-grad `fn` just runs (nothing to checkpoint).
//   differs: torch::autograd::grad() and backward(..., inputs=...) through a checkpoint throw
//           (as the reentrant one: the nested backward cannot be restricted to the requested
//           inputs; checkpoint.py line "Checkpointing is not compatible with .grad()");
//           the whole `fn` is recomputed before any gradient flows (no early stop); autocast
//           state is not captured (run `fn` under the same autocast in both passes yourself);
//           without CheckpointOptions::params and with no input requiring grad, the outputs
//           require grad even if `fn` reads nothing that does (a hidden dummy input);
//           in-place changes to the inputs after the call are caught by the version counter
//           (an error) rather than silently recomputing on changed values.
// The default generators are process-wide: ranks run as threads that draw random numbers
// interfere with each other's replay, as they already do without checkpointing.
#ifndef FSDP_FSDP_ACTIVATION_CHECKPOINTING_CHECKPOINT_H_
#define FSDP_FSDP_ACTIVATION_CHECKPOINTING_CHECKPOINT_H_

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <vector>

#include "fsdp/activation_checkpointing/selective_checkpoint.h"

namespace fsdp::activation_checkpointing {

struct CheckpointOptions {
  // Replay the forward's RNG state in the recomputation (torch.utils.checkpoint's
  // preserve_rng_state). Off: slightly cheaper, but dropout draws a different mask.
  bool preserve_rng_state = true;
  // The recomputation must return as many outputs, of the same shapes, dtypes and devices, as
  // the first forward; a c10::Error otherwise (PyTorch's determinism_check="default").
  bool determinism_check = true;
  // The tensors `fn` reads besides `inputs` that may require grad (a module's parameters);
  // only their requires_grad flags are read. The outputs require grad iff an input or one of
  // these does. Unset: when no input requires grad the outputs are made to require grad anyway
  // (a dummy input), since `fn` may read parameters the checkpoint cannot see.
  std::optional<std::vector<at::Tensor>> params;
  // Selective checkpointing (selective_checkpoint.h): the outputs of the operator calls the
  // policy saves are kept from the forward and not recomputed. Empty: everything is recomputed.
  SelectivePolicyFactory selective_policy;
};

using CheckpointFn = std::function<at::Tensor(const std::vector<at::Tensor>& inputs)>;
using CheckpointMultiFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

// Runs `fn(inputs)` without keeping its activations; see the file comment. `inputs` must be
// defined tensors (c10::Error naming the index otherwise); `fn` must not be empty. `fn` is
// called again during backward, so it must outlive the backward and be a pure function of
// its inputs, the parameters it reads and the RNG.
at::Tensor checkpoint(CheckpointFn fn, const std::vector<at::Tensor>& inputs, CheckpointOptions options = {});

// The same for a function of several outputs (each output defined; non-floating outputs never
// require grad).
std::vector<at::Tensor> checkpoint_multi(CheckpointMultiFn fn, const std::vector<at::Tensor>& inputs,
                                         CheckpointOptions options = {});

}  // namespace fsdp::activation_checkpointing

#endif  // FSDP_FSDP_ACTIVATION_CHECKPOINTING_CHECKPOINT_H_
