#include "comm/forwarding_process_group.h"

#include <c10/util/Exception.h>

#include <utility>

namespace fsdp::comm {

// The ProcessGroup base needs rank, size and timeout before the null check can run; the
// placeholders are never seen, the check throws first.
ForwardingProcessGroup::ForwardingProcessGroup(ProcessGroupPtr inner, const char* type_name)
    : ProcessGroup(inner ? inner->rank() : 0, inner ? inner->size() : 1, inner ? inner->timeout() : Timeout(1)),
      inner_(std::move(inner)) {
  TORCH_CHECK(inner_ != nullptr, type_name, ": inner group is null");
  SetFlightGroup(inner_->flight_group());
}

WorkPtr ForwardingProcessGroup::DoAllGather(const at::Tensor& output, const at::Tensor& input) {
  return Intercept({"all_gather_into_tensor", output, input},
                   [&] { return inner_->all_gather_into_tensor(output, input); });
}

WorkPtr ForwardingProcessGroup::DoReduceScatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  return Intercept({"reduce_scatter_tensor", output, input, op},
                   [&] { return inner_->reduce_scatter_tensor(output, input, op); });
}

WorkPtr ForwardingProcessGroup::DoAllReduce(const at::Tensor& tensor, ReduceOp op) {
  return Intercept({"all_reduce", tensor, tensor, op}, [&] { return inner_->all_reduce(tensor, op); });
}

WorkPtr ForwardingProcessGroup::DoBroadcast(const at::Tensor& tensor, int root) {
  return Intercept({"broadcast", tensor, tensor, std::nullopt, root}, [&] { return inner_->broadcast(tensor, root); });
}

WorkPtr ForwardingProcessGroup::DoAllToAll(const at::Tensor& output, const at::Tensor& input,
                                           const std::vector<int64_t>& output_split_sizes,
                                           const std::vector<int64_t>& input_split_sizes) {
  return Intercept({"all_to_all_single", output, input},
                   [&] { return inner_->all_to_all_single(output, input, output_split_sizes, input_split_sizes); });
}

WorkPtr ForwardingProcessGroup::DoBarrier() {
  const at::Tensor none;
  return Intercept({"barrier", none, none}, [&] { return inner_->barrier(); });
}

WorkPtr ForwardingProcessGroup::DoSend(const at::Tensor& tensor, int dst, int tag) {
  const at::Tensor none;
  return Intercept({"send", none, tensor, std::nullopt, -1, dst, tag}, [&] { return inner_->send(tensor, dst, tag); });
}

WorkPtr ForwardingProcessGroup::DoRecv(const at::Tensor& tensor, int src, int tag) {
  const at::Tensor none;
  return Intercept({"recv", tensor, none, std::nullopt, -1, src, tag}, [&] { return inner_->recv(tensor, src, tag); });
}

std::shared_ptr<ProcessGroup> ForwardingProcessGroup::DoNewSubgroup(const std::vector<int>& ranks) {
  return inner_->new_subgroup(ranks);
}

}  // namespace fsdp::comm
