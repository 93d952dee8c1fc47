// Selective activation checkpointing: the C++ counterpart of torch.utils.checkpoint's
// create_selective_checkpoint_contexts (torch/utils/checkpoint.py, PyTorch 2.15), for
// checkpoint() through CheckpointOptions::selective_policy.
//
//   CheckpointOptions o;
//   o.selective_policy = [] {                      // a fresh policy per checkpointed call
//     return [](const OpCall& call) {
//       return call.op.operator_name().name == "aten::mm" ? CheckpointPolicy::kMustSave
//                                                        : CheckpointPolicy::kPreferRecompute;
//     };
//   };
//
// During the checkpointed forward every ATen operator call below autograd (after the composite
// decompositions: aten::mm, not aten::linear) is shown to the policy with its arguments and
// outputs; the outputs of the calls it saves are kept (as detached aliases sharing the version
// counter). During the recomputation the calls of an operator with kept calls, matched by their
// index among that operator's calls as PyTorch's _CachedTorchDispatchMode matches them, return
// the kept outputs instead of running; every other call runs again, however many there are. Autograd above still
// records each call, so the gradients are those of full recomputation, bitwise.
//
// Same as PyTorch: the policy is asked in the forward only; aten::detach and prim::device are
// neither shown nor counted; a kept output modified in place before the recomputation is an
// error (PyTorch's allow_cache_entry_mutation=False); a second backward through the region is an
// error. Differs: a call whose operator mutates an argument or returns an alias (in-place and
// view operators) always runs again whatever the policy says, since a kept output cannot redo
// the mutation or the aliasing; a kept call whose arguments' shapes differ in the recomputation
// is an error naming the operator (PyTorch matches by index only); the forward runs under
// no-grad (the reentrant checkpoint of checkpoint.h), so a kept operator called a different
// number of times with grad mode off would mismatch (an error, not a wrong gradient), while
// calls made in one pass only (aliases and copies autograd needs, a custom Function returning
// its input) are fine when their operator keeps nothing. Collectives of the comm
// layer are not ATen operators and always run again (torchtitan keeps _c10d_functional
// reduce-scatters).
//
// Mechanism (docs/design/selective-checkpointing.md): a boxed fallback on c10::DispatchKey::Fake, a functionality key
// between autograd and the backends that LibTorch registers nothing on, included in the thread's dispatch key set only
// while a selective region forwards or recomputes on that thread. Should a future LibTorch register its own fallback on
// that key, the first selective checkpoint fails with the dispatcher's "multiple backend fallbacks" error rather than
// silently.
//
// Thread-safety: the state is per thread (the region runs on the thread that calls the
// checkpoint, its recomputation on the autograd engine's thread).
#ifndef FSDP_FSDP_ACTIVATION_CHECKPOINTING_SELECTIVE_CHECKPOINT_H_
#define FSDP_FSDP_ACTIVATION_CHECKPOINTING_SELECTIVE_CHECKPOINT_H_

#include <c10/util/ArrayRef.h>

#include <functional>
#include <memory>

namespace c10 {
class OperatorHandle;
struct IValue;
}  // namespace c10

namespace fsdp::activation_checkpointing {

// torch.utils.checkpoint.CheckpointPolicy without the CPU-offload values (which PyTorch's eager
// selective checkpoint recomputes anyway). MUST_ and PREFER_ differ only for a compiler.
enum class CheckpointPolicy { kMustSave, kPreferSave, kMustRecompute, kPreferRecompute };

// One operator call of the checkpointed forward, as the policy sees it. Valid during the call.
struct OpCall {
  const c10::OperatorHandle& op;
  c10::ArrayRef<c10::IValue> arguments;  // the schema's arguments, in order
  c10::ArrayRef<c10::IValue> outputs;    // the schema's returns, in order
};

using SelectivePolicy = std::function<CheckpointPolicy(const OpCall& call)>;
// Makes the policy of one checkpointed call (PyTorch's context_fn): called once per forward, so a
// policy may count the calls it sees (torchtitan's "every second matmul").
using SelectivePolicyFactory = std::function<SelectivePolicy()>;

namespace internal {

// The outputs kept for one checkpointed call, and the position of its recomputation.
class SelectiveCache;
std::shared_ptr<SelectiveCache> MakeSelectiveCache(SelectivePolicy policy);

// While alive, the operator calls of this thread are recorded into `cache` (kForward) or served
// from it (kRecompute: each call's index restarts at 0). Scopes nest (the innermost one sees the
// calls); destroy in reverse order of construction.
class SelectiveScope {
 public:
  enum class Phase { kForward, kRecompute };
  SelectiveScope(std::shared_ptr<SelectiveCache> cache, Phase phase);
  ~SelectiveScope();
  SelectiveScope(const SelectiveScope&) = delete;
  SelectiveScope& operator=(const SelectiveScope&) = delete;

 private:
  struct Saved;
  std::unique_ptr<Saved> saved_;  // the enclosing scope's thread state, put back on destruction
};

}  // namespace internal
}  // namespace fsdp::activation_checkpointing

#endif  // FSDP_FSDP_ACTIVATION_CHECKPOINTING_SELECTIVE_CHECKPOINT_H_
