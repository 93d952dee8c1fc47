#include "comm/comm_trace.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace fsdp::comm {

CommTrace::CommTrace(ProcessGroupPtr inner) : ForwardingProcessGroup(std::move(inner), "CommTrace") {}

std::string CommTrace::backend_name() const { return absl::StrCat("trace(", inner()->backend_name(), ")"); }

WorkPtr CommTrace::Intercept(const CollectiveCall& call, c10::function_ref<WorkPtr()> issue) {
  CollectiveRecord record;
  record.op = call.op;
  record.reduce_op = call.reduce_op ? call.reduce_op->ToString() : "";
  if (call.input.defined()) {
    record.dtype = call.input.scalar_type();
    record.input_numel = call.input.numel();
    record.input_bytes = call.input.numel() * static_cast<int64_t>(call.input.element_size());
  }
  if (call.output.defined()) {
    record.output_numel = call.output.numel();
    record.output_bytes = call.output.numel() * static_cast<int64_t>(call.output.element_size());
  }
  record.group_size = size();
  record.root = call.root;
  record.peer = call.peer;
  record.tag = call.tag;
  {
    std::lock_guard<std::mutex> lock(mu_);
    records_.push_back(std::move(record));
  }
  return issue();
}

std::shared_ptr<ProcessGroup> CommTrace::DoNewSubgroup(const std::vector<int>& ranks) {
  auto sub = inner()->new_subgroup(ranks);
  if (!sub) return nullptr;
  auto traced = std::make_shared<CommTrace>(std::move(sub));
  std::lock_guard<std::mutex> lock(mu_);
  subgroups_.push_back(traced);
  return traced;
}

std::vector<CollectiveRecord> CommTrace::all_records() const {
  std::vector<CollectiveRecord> out;
  std::vector<std::shared_ptr<CommTrace>> subgroups;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out = records_;
    for (const auto& weak : subgroups_) {
      if (auto sub = weak.lock()) subgroups.push_back(std::move(sub));
    }
  }
  for (const auto& sub : subgroups) {
    const std::vector<CollectiveRecord> theirs = sub->all_records();
    out.insert(out.end(), theirs.begin(), theirs.end());
  }
  return out;
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
