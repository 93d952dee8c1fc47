#include "comm/comm_trace.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace fsdp::comm {

CommTrace::CommTrace(ProcessGroupPtr inner)
    : ProcessGroup(inner ? inner->rank() : 0, inner ? inner->size() : 1, inner ? inner->timeout() : Timeout(1)),
      inner_(std::move(inner)) {
  TORCH_CHECK(inner_ != nullptr, "CommTrace: inner process group is null");
}

std::string CommTrace::backend_name() const { return absl::StrCat("trace(", inner_->backend_name(), ")"); }

void CommTrace::Record(std::string op, std::string reduce_op, const at::Tensor& output, const at::Tensor& input,
                       int root) {
  CollectiveRecord record;
  record.op = std::move(op);
  record.reduce_op = std::move(reduce_op);
  if (input.defined()) {
    record.dtype = input.scalar_type();
    record.input_numel = input.numel();
    record.input_bytes = input.numel() * static_cast<int64_t>(input.element_size());
  }
  if (output.defined()) {
    record.output_numel = output.numel();
    record.output_bytes = output.numel() * static_cast<int64_t>(output.element_size());
  }
  record.group_size = size();
  record.root = root;
  std::lock_guard<std::mutex> lock(mu_);
  records_.push_back(std::move(record));
}

WorkPtr CommTrace::DoAllGather(const at::Tensor& output, const at::Tensor& input) {
  Record("all_gather_into_tensor", "", output, input);
  return inner_->all_gather_into_tensor(output, input);
}

WorkPtr CommTrace::DoReduceScatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  Record("reduce_scatter_tensor", op.ToString(), output, input);
  return inner_->reduce_scatter_tensor(output, input, op);
}

WorkPtr CommTrace::DoAllReduce(const at::Tensor& tensor, ReduceOp op) {
  Record("all_reduce", op.ToString(), tensor, tensor);
  return inner_->all_reduce(tensor, op);
}

WorkPtr CommTrace::DoBroadcast(const at::Tensor& tensor, int root) {
  Record("broadcast", "", tensor, tensor, root);
  return inner_->broadcast(tensor, root);
}

WorkPtr CommTrace::DoAllToAll(const at::Tensor& output, const at::Tensor& input,
                              const std::vector<int64_t>& output_split_sizes,
                              const std::vector<int64_t>& input_split_sizes) {
  Record("all_to_all_single", "", output, input);
  return inner_->all_to_all_single(output, input, output_split_sizes, input_split_sizes);
}

WorkPtr CommTrace::DoBarrier() {
  Record("barrier", "", at::Tensor(), at::Tensor());
  return inner_->barrier();
}

std::shared_ptr<ProcessGroup> CommTrace::DoNewSubgroup(const std::vector<int>& ranks) {
  auto sub = inner_->new_subgroup(ranks);
  return sub ? std::make_shared<CommTrace>(std::move(sub)) : nullptr;
}

std::vector<CollectiveRecord> CommTrace::records() const {
  std::lock_guard<std::mutex> lock(mu_);
  return records_;
}

void CommTrace::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  records_.clear();
}

int64_t CommTrace::SumBytes(const std::string& op, int64_t CollectiveRecord::*field) const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  for (const auto& r : records_) {
    if (op.empty() || r.op == op) total += r.*field;
  }
  return total;
}

int64_t CommTrace::total_input_bytes(const std::string& op) const {
  return SumBytes(op, &CollectiveRecord::input_bytes);
}

int64_t CommTrace::total_output_bytes(const std::string& op) const {
  return SumBytes(op, &CollectiveRecord::output_bytes);
}

std::string CommTrace::ToTable() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out = absl::StrFormat("%-24s %-16s %-10s %12s %12s %12s %5s\n", "op", "reduce", "dtype", "in elems",
                                    "in bytes", "out bytes", "group");
  int64_t in_total = 0, out_total = 0;
  for (const auto& r : records_) {
    absl::StrAppendFormat(&out, "%-24s %-16s %-10s %12d %12d %12d %5d\n", r.op, r.reduce_op.empty() ? "-" : r.reduce_op,
                          r.dtype == c10::ScalarType::Undefined ? "-" : c10::toString(r.dtype), r.input_numel,
                          r.input_bytes, r.output_bytes, r.group_size);
    in_total += r.input_bytes;
    out_total += r.output_bytes;
  }
  absl::StrAppendFormat(&out, "%-24s %-16s %-10s %12s %12d %12d\n", "total", "", "", "", in_total, out_total);
  return out;
}

}  // namespace fsdp::comm
