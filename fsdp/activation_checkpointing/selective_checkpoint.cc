#include "fsdp/activation_checkpointing/selective_checkpoint.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace fsdp::activation_checkpointing {
namespace internal {
namespace {

// See the file comment of selective_checkpoint.h: nothing in LibTorch registers on it.
constexpr c10::DispatchKey kSelectiveKey = c10::DispatchKey::Fake;

constexpr std::string_view kMismatch =
    "the checkpointed function must call the same operators on the same shapes in its recomputation as in its "
    "forward";

}  // namespace

class SelectiveCache {
 public:
  enum class Kind { kRecompute, kSaved, kConsumed };
  struct Entry {
    Kind kind = Kind::kRecompute;
    std::vector<c10::IValue> outputs;                  // detached aliases, kSaved only
    std::vector<int64_t> versions;                     // of the tensors among `outputs`, in order
    std::vector<std::vector<int64_t>> argument_sizes;  // of the tensor arguments, kSaved only
  };

  explicit SelectiveCache(SelectivePolicy p) : policy(std::move(p)) {}

  SelectivePolicy policy;
  std::unordered_map<c10::OperatorName, std::vector<Entry>> entries;
  // Operators with a kept call: only their calls must correspond between the two passes.
  std::unordered_set<c10::OperatorName> kept_operators;
  std::unordered_map<c10::OperatorName, size_t> replayed;  // per operator, calls of the recomputation so far
};

// The region this thread's operator calls belong to.
struct SelectiveThreadState {
  SelectiveCache* cache = nullptr;
  SelectiveScope::Phase phase = SelectiveScope::Phase::kForward;
};

namespace {

thread_local SelectiveThreadState tls_state;

// PyTorch's SAC_IGNORED_OPS: the checkpoint itself calls them a different number of times.
bool IsIgnored(const c10::OperatorName& name) {
  return (name.name == "aten::detach" || name.name == "prim::device") && name.overload_name.empty();
}

// A kept output can stand in for a call only if the call neither mutates nor aliases.
bool CanKeep(const c10::FunctionSchema& schema) {
  if (schema.is_mutable()) return false;
  for (const c10::Argument& r : schema.returns()) {
    if (r.alias_info() != nullptr) return false;
  }
  return true;
}

std::vector<std::vector<int64_t>> TensorSizes(c10::ArrayRef<c10::IValue> values) {
  std::vector<std::vector<int64_t>> sizes;
  for (const c10::IValue& v : values) {
    if (v.isTensor() && v.toTensor().defined()) sizes.push_back(v.toTensor().sizes().vec());
  }
  return sizes;
}

// torch/utils/checkpoint.py's _detach_helper: detached through ADInplaceOrView so the alias
// shares the output's version counter (an in-place change after the forward is then seen).
at::Tensor DetachSharingVersion(const at::Tensor& t) {
  const c10::impl::LocalDispatchKeySet local = c10::impl::tls_local_dispatch_key_set();
  c10::impl::ForceDispatchKeyGuard guard(
      local.included_, local.excluded_.remove(c10::DispatchKey::ADInplaceOrView) | c10::DispatchKeySet(kSelectiveKey));
  return t.detach();
}

void Keep(c10::ArrayRef<c10::IValue> outputs, SelectiveCache::Entry& entry) {
  for (const c10::IValue& v : outputs) {
    if (v.isTensor() && v.toTensor().defined()) {
      at::Tensor d = DetachSharingVersion(v.toTensor());
      entry.versions.push_back(d._version());
      entry.outputs.emplace_back(std::move(d));
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorList()) {
        at::Tensor d = DetachSharingVersion(t);
        entry.versions.push_back(d._version());
        list.push_back(std::move(d));
      }
      entry.outputs.emplace_back(std::move(list));
    } else {
      entry.outputs.push_back(v);
    }
  }
}

void RecordForward(SelectiveCache& cache, const c10::OperatorHandle& op, c10::DispatchKeySet after,
                   torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t num_arguments = schema.arguments().size();
  std::vector<c10::IValue> arguments(stack->end() - static_cast<std::ptrdiff_t>(num_arguments), stack->end());
  op.redispatchBoxed(after, stack);
  const size_t num_returns = schema.returns().size();
  const c10::ArrayRef<c10::IValue> outputs(stack->data() + stack->size() - num_returns, num_returns);
  SelectiveCache::Entry entry;
  if (CanKeep(schema)) {
    const CheckpointPolicy policy = cache.policy(OpCall{op, arguments, outputs});
    if (policy == CheckpointPolicy::kMustSave || policy == CheckpointPolicy::kPreferSave) {
      entry.kind = SelectiveCache::Kind::kSaved;
      entry.argument_sizes = TensorSizes(arguments);
      Keep(outputs, entry);
      cache.kept_operators.insert(op.operator_name());
    }
  }
  cache.entries[op.operator_name()].push_back(std::move(entry));
}

void Replay(SelectiveCache& cache, const c10::OperatorHandle& op, c10::DispatchKeySet after, torch::jit::Stack* stack) {
  const c10::OperatorName& name = op.operator_name();
  // An operator the forward never kept is recomputed whenever it is called, as PyTorch's
  // _CachedTorchDispatchMode runs it: its calls need no counterpart. (The forward runs without
  // grad and the recomputation with it, so aliases made only for autograd, as a custom
  // Function returning its input, appear in one pass only.)
  if (!cache.kept_operators.contains(name)) {
    op.redispatchBoxed(after, stack);
    return;
  }
  const size_t index = cache.replayed[name]++;
  auto it = cache.entries.find(name);
  TORCH_CHECK(it != cache.entries.end() && index < it->second.size(), "selective checkpoint: call ", index, " of ",
              name, " in the recomputation has no counterpart in the forward (", kMismatch, ")");
  SelectiveCache::Entry& entry = it->second[index];
  TORCH_CHECK(entry.kind != SelectiveCache::Kind::kConsumed,
              "selective checkpoint: trying to backward through a selectively checkpointed region an extra time (",
              name, " call ", index, " was used already; as in PyTorch, a region allows one backward)");
  if (entry.kind == SelectiveCache::Kind::kRecompute) {
    op.redispatchBoxed(after, stack);
    return;
  }
  const size_t num_arguments = op.schema().arguments().size();
  const c10::ArrayRef<c10::IValue> arguments(stack->data() + stack->size() - num_arguments, num_arguments);
  const std::vector<std::vector<int64_t>> sizes = TensorSizes(arguments);
  TORCH_CHECK(sizes == entry.argument_sizes, "selective checkpoint: call ", index, " of ", name,
              " has other argument shapes in the recomputation than in the forward (", kMismatch, ")");
  size_t v = 0;
  for (const c10::IValue& out : entry.outputs) {
    std::vector<at::Tensor> tensors;
    if (out.isTensor()) tensors.push_back(out.toTensor());
    if (out.isTensorList()) tensors = out.toTensorList().vec();
    for (const at::Tensor& t : tensors) {
      TORCH_CHECK(t._version() == entry.versions[v++], "selective checkpoint: the kept output of ", name, " call ",
                  index, " was modified in place after the forward (PyTorch's allow_cache_entry_mutation=False)");
    }
  }
  torch::jit::drop(*stack, num_arguments);
  for (c10::IValue& out : entry.outputs) stack->push_back(std::move(out));
  entry.outputs.clear();
  entry.kind = SelectiveCache::Kind::kConsumed;
}

void SelectiveFallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const c10::DispatchKeySet after = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kSelectiveKey);
  // The operator's own kernel, and the policy, call operators of their own: not the region's.
  c10::impl::ExcludeDispatchKeyGuard no_reentry(kSelectiveKey);
  SelectiveCache* cache = tls_state.cache;
  if (cache == nullptr || IsIgnored(op.operator_name())) {
    op.redispatchBoxed(after, stack);
  } else if (tls_state.phase == SelectiveScope::Phase::kForward) {
    RecordForward(*cache, op, after, stack);
  } else {
    Replay(*cache, op, after, stack);
  }
}

void RegisterFallbackOnce() {
  static const bool registered = [] {
    // Never destroyed: the registration lives as long as the process's dispatcher.
    auto* library = new torch::Library(torch::Library::IMPL, "_", kSelectiveKey, __FILE__, __LINE__);
    library->fallback(torch::CppFunction::makeFromBoxedFunction<&SelectiveFallback>());
    return true;
  }();
  (void)registered;
}

}  // namespace

std::shared_ptr<SelectiveCache> MakeSelectiveCache(SelectivePolicy policy) {
  TORCH_CHECK(policy != nullptr, "selective checkpoint: the policy factory returned an empty policy");
  return std::make_shared<SelectiveCache>(std::move(policy));
}

struct SelectiveScope::Saved {
  SelectiveThreadState previous;
  std::shared_ptr<SelectiveCache> cache;
  std::optional<c10::impl::IncludeDispatchKeyGuard> include;
};

SelectiveScope::SelectiveScope(std::shared_ptr<SelectiveCache> cache, Phase phase) : saved_(std::make_unique<Saved>()) {
  TORCH_CHECK(cache != nullptr, "selective checkpoint: no cache");
  RegisterFallbackOnce();
  if (phase == Phase::kRecompute) cache->replayed.clear();
  saved_->previous = tls_state;
  saved_->cache = std::move(cache);
  tls_state = {saved_->cache.get(), phase};
  saved_->include.emplace(kSelectiveKey);
}

SelectiveScope::~SelectiveScope() {
  saved_->include.reset();
  tls_state = saved_->previous;
}

}  // namespace internal
}  // namespace fsdp::activation_checkpointing
