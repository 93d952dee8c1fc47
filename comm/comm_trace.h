// CommTrace: a ProcessGroup decorator that records every collective and point-to-point op.
#ifndef FSDP_COMM_COMM_TRACE_H_
#define FSDP_COMM_COMM_TRACE_H_

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "comm/forwarding_process_group.h"

namespace fsdp::comm {

struct CollectiveRecord {
  std::string op;         // "all_gather_into_tensor", "reduce_scatter_tensor", ...
  std::string reduce_op;  // "SUM", ... for reducing collectives, else ""
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int64_t input_numel = 0;
  int64_t output_numel = 0;
  int64_t input_bytes = 0;
  int64_t output_bytes = 0;
  int group_size = 0;
  int root = -1;  // broadcast only
  int peer = -1;  // send's dst, recv's src
  int tag = -1;   // send and recv
};

// Forwards every call to `inner` and records it (one record per call, in call order).
// Records are taken after argument validation, so a rejected call is not recorded.
// Subgroups are traced too (each with its own records; all_records() gathers them). The record
// methods are thread-safe.
class CommTrace final : public ForwardingProcessGroup {
 public:
  explicit CommTrace(ProcessGroupPtr inner);

  std::string backend_name() const override;

  std::vector<CollectiveRecord> records() const;
  // This group's records, then those of every subgroup made from it (recursively, each in its
  // creation order): everything one rank's program issued through this world.
  std::vector<CollectiveRecord> all_records() const;
  void clear();
  // Byte totals over the records of `op` ("" = every op).
  int64_t total_input_bytes(const std::string& op = "") const;
  int64_t total_output_bytes(const std::string& op = "") const;
  // One line per record plus a total, for logs and the demo.
  std::string ToTable() const;

 protected:
  WorkPtr Intercept(const CollectiveCall& call, c10::function_ref<WorkPtr()> issue) override;
  std::shared_ptr<ProcessGroup> DoNewSubgroup(const std::vector<int>& ranks) override;

 private:
  int64_t SumBytes(const std::string& op, int64_t CollectiveRecord::*field) const;

  mutable std::mutex mu_;  // pthread-based, so ThreadSanitizer sees it (Debian's absl is not instrumented)
  std::vector<CollectiveRecord> records_;            // guarded by mu_
  std::vector<std::weak_ptr<CommTrace>> subgroups_;  // guarded by mu_
};

}  // namespace fsdp::comm

#endif  // FSDP_COMM_COMM_TRACE_H_
