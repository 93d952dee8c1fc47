#include "fsdp/fsdp1/exec_order.h"

namespace fsdp::fsdp1 {

void ExecOrderData::Init(const std::vector<FlatParamHandle*>& all_handles) {
  all_handles_.clear();
  for (FlatParamHandle* handle : all_handles) {
    handle->runtime().handle_index = static_cast<int64_t>(all_handles_.size());
    all_handles_.push_back(handle);
  }
}

FlatParamHandle* ExecOrderData::GetHandleToBackwardPrefetch(const FlatParamHandle& current) const {
  const std::optional<int64_t> current_index = current.runtime().post_forward_index;
  if (!current_index.has_value()) return nullptr;
  int64_t target_index = *current_index - 1;
  FlatParamHandle* target = nullptr;
  for (int i = 0; i < backward_prefetch_limit_; ++i) {
    if (target_index < 0) break;
    target = post_forward_order_[target_index];
    --target_index;
  }
  return target;
}

FlatParamHandle* ExecOrderData::GetHandleToForwardPrefetch(const FlatParamHandle& current) const {
  const std::optional<int64_t> current_index = current.runtime().pre_forward_order_index;
  if (!current_index.has_value()) return nullptr;
  int64_t target_index = *current_index + 1;
  FlatParamHandle* target = nullptr;
  for (int i = 0; i < forward_prefetch_limit_; ++i) {
    if (target_index >= static_cast<int64_t>(pre_forward_order_.size())) break;
    target = pre_forward_order_[target_index];
    ++target_index;
  }
  return target;
}

void ExecOrderData::RecordPostForward(FlatParamHandle* handle) {
  if (handle == nullptr) return;
  // A module running forward twice keeps its first index (PyTorch tests the index for
  // truthiness, so there index 0 is re-assigned; here any recorded index is kept).
  if (!handle->runtime().post_forward_index.has_value()) {
    handle->runtime().post_forward_index = static_cast<int64_t>(post_forward_order_.size());
  }
  post_forward_order_.push_back(handle);
}

void ExecOrderData::RecordPreForward(FlatParamHandle* handle, bool /*is_training*/) {
  if (handle == nullptr) return;
  // Only the first iteration records the pre-forward order (forward prefetching follows it).
  if (!is_first_iter() || handle->runtime().pre_forward_order_index.has_value()) return;
  handle->runtime().pre_forward_order_index = static_cast<int64_t>(pre_forward_order_.size());
  pre_forward_order_.push_back(handle);
}

void ExecOrderData::NextIter() {
  ++iter_;
  post_forward_order_.clear();
}

device::EventPtr FreeEventQueue::DequeueIfNeeded() {
  if (static_cast<int>(queue_.size()) < kMaxNumInflightAllGathers) return nullptr;
  device::EventPtr event = std::move(queue_.front());
  queue_.pop_front();
  return event;
}

}  // namespace fsdp::fsdp1
