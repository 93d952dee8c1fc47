// ForwardingProcessGroup: the base of ProcessGroup decorators (CommTrace, FaultyProcessGroup),
// as c10d's ProcessGroupWrapper (torch/csrc/distributed/c10d/ProcessGroupWrapper.hpp) wraps a
// backend.
//
// Contract:
//  * Ownership: holds a shared reference to the inner group (the decorator and its caller may
//    both keep it); rank, size and timeout are the inner group's, read at construction.
//  * Forwarding: every backend hook goes to the inner group's public method, so the inner
//    group validates and runs it as if called directly. Each collective passes through
//    Intercept() first, which a decorator overrides to act around every collective in one
//    place; a decorator overrides a Do* hook itself only to change that one hook.
//    new_subgroup returns the inner group's subgroup, undecorated, unless the decorator
//    overrides DoNewSubgroup; object_collective_device() is the inner group's.
//  * Errors: the constructor throws c10::Error "<type>: inner group is null"; everything
//    else throws what the inner group throws (after ProcessGroup's own validation, so a
//    rejected call never reaches Intercept()).
//  * Thread-safety: as ProcessGroup (one thread at a time); the base has no mutable state.
#ifndef FSDP_COMM_FORWARDING_PROCESS_GROUP_H_
#define FSDP_COMM_FORWARDING_PROCESS_GROUP_H_

#include <ATen/core/Tensor.h>
#include <c10/util/FunctionRef.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "comm/process_group.h"

namespace fsdp::comm {

// One collective on its way to the inner group, as Intercept() sees it.
struct CollectiveCall {
  // "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast",
  // "all_to_all_single", "barrier", "send" or "recv": the public method's name.
  const char* op;
  // all_reduce and broadcast: the tensor, as both; barrier: undefined tensors; send: the
  // tensor as input (output undefined); recv: as output.
  const at::Tensor& output;
  const at::Tensor& input;
  std::optional<ReduceOp> reduce_op;  // the reducing collectives only
  int root = -1;                      // broadcast only
  int peer = -1;                      // send's dst, recv's src
  int tag = -1;                       // send and recv
};

class ForwardingProcessGroup : public ProcessGroup {
 public:
  const ProcessGroupPtr& inner() const { return inner_; }

 protected:
  // `type_name` names the decorator in the null-inner error.
  ForwardingProcessGroup(ProcessGroupPtr inner, const char* type_name);

  // Runs `issue` (the collective on the inner group) and returns its Work; decorators
  // override it to record, delay or replace collectives.
  virtual WorkPtr Intercept(const CollectiveCall& call, c10::function_ref<WorkPtr()> issue) { return issue(); }

  WorkPtr DoAllGather(const at::Tensor& output, const at::Tensor& input) override;
  WorkPtr DoReduceScatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op) override;
  WorkPtr DoAllReduce(const at::Tensor& tensor, ReduceOp op) override;
  WorkPtr DoBroadcast(const at::Tensor& tensor, int root) override;
  WorkPtr DoAllToAll(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& output_split_sizes,
                     const std::vector<int64_t>& input_split_sizes) override;
  WorkPtr DoBarrier() override;
  WorkPtr DoSend(const at::Tensor& tensor, int dst, int tag) override;
  WorkPtr DoRecv(const at::Tensor& tensor, int src, int tag) override;
  std::shared_ptr<ProcessGroup> DoNewSubgroup(const std::vector<int>& ranks) override;
  c10::Device DoObjectCollectiveDevice() const override { return inner_->object_collective_device(); }
  ProcessGroup* DoInnerGroup() const override { return inner_.get(); }

 private:
  ProcessGroupPtr inner_;
};

}  // namespace fsdp::comm

#endif  // FSDP_COMM_FORWARDING_PROCESS_GROUP_H_
