#include "fsdp/hooked_module/hooked_module.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp {

void HookedModule::AddForwardHook(std::shared_ptr<ForwardHook> hook, HookPosition position) {
  TORCH_CHECK(hook != nullptr, "AddForwardHook: hook is null");
  TORCH_CHECK(std::find(hooks_.begin(), hooks_.end(), hook) == hooks_.end(),
              "AddForwardHook: this hook is already attached to the module");
  if (position == HookPosition::kOutermost) {
    hooks_.insert(hooks_.begin(), std::move(hook));
  } else {
    hooks_.push_back(std::move(hook));
  }
}

bool HookedModule::RemoveForwardHook(const ForwardHook* hook) {
  auto it = std::find_if(hooks_.begin(), hooks_.end(), [&](const auto& h) { return h.get() == hook; });
  if (it == hooks_.end()) return false;
  hooks_.erase(it);
  return true;
}

void HookedModule::SetForwardReplacement(std::shared_ptr<ForwardReplacementBase> replacement) {
  TORCH_CHECK(!replacement || AcceptsReplacement(*replacement),
              "SetForwardReplacement: the replacement's Forward signature is not this module's forward's");
  replacement_ = std::move(replacement);
}

std::vector<at::Tensor> HookedModule::RunPreForward(std::vector<at::Tensor> args) const {
  // Indexing, not iterators: the hook list must not change during forward (see the contract),
  // and an index stays valid enough to fail the count check below rather than crash.
  for (size_t i = 0; i < hooks_.size(); ++i) {
    const size_t n = args.size();
    args = hooks_[i]->PreForward(std::move(args));
    TORCH_CHECK(args.size() == n, "forward pre-hook ", i, " returned ", args.size(), " tensors for ", n,
                " tensor arguments");
  }
  return args;
}

void HookedModule::RunPostForward(const std::vector<at::Tensor*>& outputs) const {
  for (size_t i = hooks_.size(); i-- > 0;) hooks_[i]->PostForward(outputs);
}

}  // namespace fsdp
