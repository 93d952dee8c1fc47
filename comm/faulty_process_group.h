// FaultyProcessGroup: a ProcessGroup decorator that injects faults into chosen collectives
// of this rank, for tests of what users see when communication breaks.
#ifndef FSDP_COMM_FAULTY_PROCESS_GROUP_H_
#define FSDP_COMM_FAULTY_PROCESS_GROUP_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/forwarding_process_group.h"

namespace fsdp::comm {

struct Fault {
  enum class Kind {
    kFail,     // the collective fails at once with an "injected fault" error; the inner group
               // never sees it (as a rank whose transport broke), so peers time out on it
    kHang,     // never completes: every wait times out; the inner group never sees it
    kDelay,    // runs, but completes `delay` later (past the timeout: a timeout error)
    kCorrupt,  // runs, then this rank's output is corrupted (first element + 1, or NaN
               // with corrupt_with_nan): for detection tests
  };
  Kind kind = Kind::kFail;
  // The collective or point-to-point op to hit: the `index`-th (0-based) call of `op` on this
  // rank ("" = any; ops are named as CollectiveCall::op: "all_gather_into_tensor", ...,
  // "send", "recv"). kCorrupt needs an output: not a send.
  int64_t index = 0;
  std::string op;
  std::chrono::milliseconds delay{0};
  bool corrupt_with_nan = false;
};

// Forwards every collective to `inner` except the faulted ones. Counters are per op and
// over all ops; thread-compatible (one rank's thread, as every ProcessGroup). Subgroups are
// created by `inner` and carry no faults.
class FaultyProcessGroup final : public ForwardingProcessGroup {
 public:
  FaultyProcessGroup(ProcessGroupPtr inner, std::vector<Fault> faults);

  std::string backend_name() const override;
  // Replaces the faults and restarts counting: indices count from the next collective.
  void Arm(std::vector<Fault> faults);
  // How many faults were injected so far.
  int64_t injected() const { return injected_; }

 protected:
  // Counts the call; runs `issue` unless the fault for it says otherwise, applying the
  // fault to the call's output / the returned work.
  WorkPtr Intercept(const CollectiveCall& call, c10::function_ref<WorkPtr()> issue) override;

 private:
  std::vector<Fault> faults_;
  std::vector<std::pair<std::string, int64_t>> calls_;  // per op
  int64_t total_calls_ = 0;
  int64_t injected_ = 0;
};

}  // namespace fsdp::comm

#endif  // FSDP_COMM_FAULTY_PROCESS_GROUP_H_
