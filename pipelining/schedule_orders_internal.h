// The per-family builders of schedule_orders.cc (not part of the API): each returns one
// rank's compute-only actions as torch/distributed/pipelining/schedules.py's
// _calculate_single_rank_operations / _get_pipeline_order do, arguments already checked.
#ifndef FSDP_PIPELINING_SCHEDULE_ORDERS_INTERNAL_H_
#define FSDP_PIPELINING_SCHEDULE_ORDERS_INTERNAL_H_

#include <optional>
#include <vector>

#include "pipelining/action.h"

namespace fsdp::pipelining::internal {

using RankOps = std::vector<std::optional<Action>>;

// ScheduleZBVZeroBubble._calculate_single_rank_operations (two stages per rank).
RankOps ZBVRankOps(int rank, int num_ranks, int n_microbatches);
// ScheduleDualPipeV._calculate_single_rank_operations (two stages per rank).
RankOps DualPipeVRankOps(int rank, int num_ranks, int n_microbatches);

}  // namespace fsdp::pipelining::internal

#endif  // FSDP_PIPELINING_SCHEDULE_ORDERS_INTERNAL_H_
