// Lowering a compute-only pipeline schedule to the actions a runtime executes, as PyTorch's
// _PipelineScheduleRuntime._prepare_schedule_with_comms(format="compute_only")
// (torch/distributed/pipelining/schedules.py) with its default unshard_lookahead "full" and
// no max_outstanding_sends: FSDP UNSHARD / RESHARD around each stage's computations
// (AddUnshardReshard), the gradient reductions after a stage's last backward (AddReduceGrad),
// the point-to-point SEND / RECV between ranks (AddSendRecv), a WAIT for each send
// (AddWaitSend), optionally receives moved next to their use (DeferRecvOps), checked
// (ValidateSendWaits).
//
// Contract: LowerWithComms takes each rank's compute-only order (ComputeOrder of
// schedule_orders.h, or a user's, e.g. from ReadScheduleCsv) and returns each rank's lowered
// actions, action for action PyTorch's pipeline_order_with_comms. It first checks the order as
// PyTorch does (ValidateSchedule: ranks 0..R-1, every stage's microbatches run once, forward
// before backward, a stage on one rank) and that `stage_to_rank` agrees with the ranks the
// order puts the stages on. The passes are public for tests and custom lowerings; each takes
// and returns plain values.
//
// Errors: c10::Error with PyTorch's message (its AssertionError / ValueError text, e.g. "Rank
// 1, step 2: Running Full Backward for stage 1, microbatch 0 without first running Forward"
// followed by the formatted schedule, "Expected compute-only schedule but found communication
// action ...", "Malformed compute schedule, can't schedule sends/recvs"). Thread-safety: pure
// functions (stage_to_rank is called on the caller's thread).
#ifndef FSDP_PIPELINING_LOWERING_H_
#define FSDP_PIPELINING_LOWERING_H_

#include <functional>
#include <map>
#include <optional>
#include <vector>

#include "pipelining/action.h"

namespace fsdp::pipelining {

// _PipelineScheduleRuntime's lowering arguments.
struct LoweringOptions {
  // FSDP stages whose unsharded parameters stay resident (and, with the "full" lookahead, how
  // many upcoming stages are unsharded ahead). Positive.
  int max_active_stages = 3;
  // Each WAIT_REDUCE_GRAD waits until before the next REDUCE_GRAD or the schedule's end.
  bool defer_reduce_grad_wait = false;
  // Each RECV moves down to just before its consumer (deadlock-free by rank parity).
  bool defer_pp_recv = false;
};

// rank -> its lowered actions (no idle steps).
using LoweredOrder = std::map<int, std::vector<Action>>;

// _validate_schedule: `actions` has ranks 0..num_ranks-1; each stage of 0..num_stages-1 runs
// n_microbatches forwards, as many I as W, B + (I + W) / 2 == n_microbatches backwards, F before
// B / I and I before W per microbatch, all on one rank. Returns stage -> rank.
std::map<int, int> ValidateSchedule(const PipelineOrder& actions, int num_ranks, int num_stages, int n_microbatches);

// _add_unshard_reshard: before each compute action, RESHARD the resident stages not among the
// next `max_active_stages` distinct stages computed, UNSHARD the next `unshard_lookahead` (unset:
// max_active_stages) ones not resident; RESHARD the rest at the end. Idle steps are dropped.
std::vector<Action> AddUnshardReshard(const std::vector<std::optional<Action>>& compute_actions,
                                      int max_active_stages = 3, std::optional<int> unshard_lookahead = std::nullopt);

// _add_reduce_grad: REDUCE_GRAD (and WAIT_REDUCE_GRAD right after it, or deferred to before the
// next REDUCE_GRAD / the end) after the n_microbatches-th B or W of a stage. Idle steps are
// dropped.
std::vector<Action> AddReduceGrad(const std::vector<std::optional<Action>>& actions, int n_microbatches,
                                  bool defer_reduce_grad_wait = false);
std::vector<Action> AddReduceGrad(const std::vector<Action>& actions, int n_microbatches,
                                  bool defer_reduce_grad_wait = false);

// _add_send_recv: steps the ranks in order, scheduling a rank's next action once its input is
// there (the RECV a peer's SEND put on this rank, or the producing action on this rank); a
// forward to a stage on another rank adds SEND_F here and RECV_F there, a backward likewise
// SEND_B / RECV_B.
LoweredOrder AddSendRecv(LoweredOrder compute_actions, const std::function<int(int)>& stage_to_rank, int num_stages);

// _add_wait_send: WAIT_SEND_F after the local backward of the sent microbatch, the other
// sends' waits at the end (in send order).
LoweredOrder AddWaitSend(const LoweredOrder& comm_actions);

// _validate_send_waits: every send has exactly one later wait, no wait lacks its send.
void ValidateSendWaits(const LoweredOrder& comm_actions);

// _defer_recv_ops: each RECV moves to just before its consumer, or before a SEND to the peer
// it receives from when this rank's index is lower.
LoweredOrder DeferRecvOps(const LoweredOrder& actions, const std::function<int(int)>& stage_to_rank);

// _PipelineScheduleRuntime._prepare_schedule_with_comms(format="compute_only") with default
// unshard_lookahead "full": ValidateSchedule (num_ranks = compute.size()), the compute-only
// check, AddUnshardReshard, AddReduceGrad per rank, AddSendRecv, AddWaitSend, DeferRecvOps
// when asked, ValidateSendWaits. stage_to_rank maps a global stage to its rank; num_stages is
// the global stage count.
LoweredOrder LowerWithComms(const PipelineOrder& compute, int n_microbatches,
                            const std::function<int(int)>& stage_to_rank, int num_stages,
                            const LoweringOptions& options = {});

}  // namespace fsdp::pipelining

#endif  // FSDP_PIPELINING_LOWERING_H_
