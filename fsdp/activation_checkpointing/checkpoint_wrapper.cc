#include "fsdp/activation_checkpointing/checkpoint_wrapper.h"

namespace fsdp::activation_checkpointing {

int apply_activation_checkpointing(
    torch::nn::Module& root, const std::function<bool(const std::string& name, torch::nn::Module& module)>& predicate,
    bool enabled) {
  int count = 0;
  auto visit = [&](const std::string& name, torch::nn::Module& m) {
    CheckpointableModule* ckpt = AsCheckpointable(m);
    if (ckpt == nullptr || (predicate && !predicate(name, m))) return;
    ckpt->set_checkpointing_enabled(enabled);
    ++count;
  };
  // The root on its own: named_modules(include_self) needs it in a shared_ptr, and a model's
  // constructor may well call this on `*this`.
  visit("", root);
  for (const auto& item : root.named_modules("", /*include_self=*/false)) visit(item.key(), *item.value());
  return count;
}

}  // namespace fsdp::activation_checkpointing
