// The FSDP1 runtime's shared bookkeeping: the recorded execution order that drives
// prefetching (PyTorch's fsdp/_exec_order_utils.py _ExecOrderData) and the rate limiter's
// queue of free events (fsdp/_limiter_utils.py _FreeEventQueue).
#ifndef FSDP_FSDP_FSDP1_EXEC_ORDER_H_
#define FSDP_FSDP_FSDP1_EXEC_ORDER_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

#include "device/stream.h"
#include "fsdp/fsdp1/flat_param.h"

namespace fsdp::fsdp1 {

// Per root: every handle in the tree (module pre-order), the pre-forward order of the first
// iteration (forward prefetch) and this iteration's post-forward order (backward prefetch:
// modules run backward in reverse post-forward order). Prefetch limits are 1 (as PyTorch).
// PyTorch's optional execution-order validation across ranks (debug level DETAIL) is not
// ported.
class ExecOrderData {
 public:
  // init(): sets every handle's handle_index.
  void Init(const std::vector<FlatParamHandle*>& all_handles);
  const std::vector<FlatParamHandle*>& all_handles() const { return all_handles_; }
  bool is_first_iter() const { return iter_ == 0; }
  int64_t iter() const { return iter_; }

  // The handle before `current` in post-forward order, or nullptr.
  FlatParamHandle* GetHandleToBackwardPrefetch(const FlatParamHandle& current) const;
  // The handle after `current` in the first iteration's pre-forward order, or nullptr.
  FlatParamHandle* GetHandleToForwardPrefetch(const FlatParamHandle& current) const;
  void RecordPostForward(FlatParamHandle* handle);
  void RecordPreForward(FlatParamHandle* handle, bool is_training);
  // End of an iteration (the post-backward final callback): clears the post-forward order.
  void NextIter();

  const std::vector<FlatParamHandle*>& handles_pre_forward_order() const { return pre_forward_order_; }
  const std::vector<FlatParamHandle*>& handles_post_forward_order() const { return post_forward_order_; }

 private:
  std::vector<FlatParamHandle*> all_handles_;
  std::vector<FlatParamHandle*> pre_forward_order_;
  std::vector<FlatParamHandle*> post_forward_order_;
  int64_t iter_ = 0;
  int backward_prefetch_limit_ = 1;
  int forward_prefetch_limit_ = 1;
};

// limit_all_gathers: each reshard that frees an unsharded flat parameter enqueues a free
// event (recorded on the compute stream: the freed memory's last readers are done once it
// completes); before an all-gather, with kMaxNumInflightAllGathers or more queued, the oldest
// is dequeued and the host synchronizes it, so that at most 2 all-gathers' memory is in flight
// (PyTorch's _FreeEventQueue). `num_synchronized` counts the rate limiter's waits.
class FreeEventQueue {
 public:
  static constexpr int kMaxNumInflightAllGathers = 2;

  void Enqueue(device::EventPtr free_event) { queue_.push_back(std::move(free_event)); }
  // The oldest event when kMaxNumInflightAllGathers or more are queued, else null.
  device::EventPtr DequeueIfNeeded();
  size_t size() const { return queue_.size(); }
  int64_t num_synchronized() const { return num_synchronized_; }
  void CountSynchronized() { ++num_synchronized_; }

 private:
  std::deque<device::EventPtr> queue_;
  int64_t num_synchronized_ = 0;
};

}  // namespace fsdp::fsdp1

#endif  // FSDP_FSDP_FSDP1_EXEC_ORDER_H_
