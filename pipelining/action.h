// The actions of a pipeline schedule and the per-rank orders they form: PyTorch's schedule IR
// (torch/distributed/pipelining/schedules.py: _ComputationType, _Action,
// _format_pipeline_order, PipelineScheduleMulti._dump_csv / _load_csv).
//
// Contract: an Action is one step of one rank: a computation (F, I, W, B, OVERLAP_F_B) or a
// communication / FSDP step (SEND_F, RECV_B, UNSHARD, REDUCE_GRAD, ...) of one stage and, where
// it has one, one microbatch. Action::ToString is PyTorch's repr ("0F1", "1UNSHARD",
// "(0F3;1B2)OVERLAP_F_B") and Action::Parse its from_str, leniencies included (it matches a
// prefix: "0F1x" is 0F1; only ASCII digits). A PipelineOrder maps a rank to its steps, nullopt
// being an idle step (None in PyTorch). FormatPipelineOrder is _format_pipeline_order byte for
// byte; WriteScheduleCsv / ReadScheduleCsv are the CSV files of _dump_csv / _load_csv (Python's
// csv module dialect "excel": one row per rank, "" an idle step); ReadScheduleCsv only parses,
// the schedule checks are ValidateSchedule's (lowering.h).
//
// Errors: c10::Error naming the bad text (Parse), the file, line and cell (ReadScheduleCsv),
// the file (WriteScheduleCsv). Thread-safety: plain values and pure functions.
#ifndef FSDP_PIPELINING_ACTION_H_
#define FSDP_PIPELINING_ACTION_H_

#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fsdp::pipelining {

// torch/distributed/pipelining/schedules.py _ComputationType, same string forms.
enum class ActionType {
  kForward,         // "F"
  kBackwardInput,   // "I"
  kBackwardWeight,  // "W"
  kUnshard,         // "UNSHARD"
  kReshard,         // "RESHARD"
  kSendF,           // "SEND_F"
  kRecvF,           // "RECV_F"
  kSendB,           // "SEND_B"
  kRecvB,           // "RECV_B"
  kWaitSendF,       // "WAIT_SEND_F"
  kWaitSendB,       // "WAIT_SEND_B"
  kFullBackward,    // "B"
  kOverlapFB,       // "OVERLAP_F_B"
  kReduceGrad,      // "REDUCE_GRAD"
  kWaitReduceGrad,  // "WAIT_REDUCE_GRAD"
};

// Every ActionType, in declaration order.
inline constexpr ActionType kAllActionTypes[] = {
    ActionType::kForward,   ActionType::kBackwardInput, ActionType::kBackwardWeight, ActionType::kUnshard,
    ActionType::kReshard,   ActionType::kSendF,         ActionType::kRecvF,          ActionType::kSendB,
    ActionType::kRecvB,     ActionType::kWaitSendF,     ActionType::kWaitSendB,      ActionType::kFullBackward,
    ActionType::kOverlapFB, ActionType::kReduceGrad,    ActionType::kWaitReduceGrad,
};

// The _ComputationType value: "F", "I", "W", "UNSHARD", ..., "B", "OVERLAP_F_B",
// "REDUCE_GRAD", "WAIT_REDUCE_GRAD".
std::string_view ActionTypeName(ActionType type);
// _ComputationType.from_str: the type whose value is exactly `name`; otherwise a c10::Error
// "Invalid computation type <name>".
ActionType ActionTypeFromName(std::string_view name);

// _Action.
struct Action {
  int stage = 0;  // stage_index (-1 for an OVERLAP_F_B container, as PyTorch)
  ActionType type = ActionType::kForward;
  std::optional<int> microbatch;    // microbatch_index
  std::vector<Action> sub_actions;  // OVERLAP_F_B's (F;B) pair; empty otherwise (None)

  // is_compute_op: F, I, W, B, OVERLAP_F_B.
  bool IsCompute() const;
  // __repr__: "0F1", "1UNSHARD", "(0F3;1B2)OVERLAP_F_B".
  std::string ToString() const;
  // _Action.from_str: surrounding whitespace ignored, "" -> nullopt; "(A;B;...)TYPE" a
  // container of stage -1 with the parsed sub-actions (empty ones dropped); otherwise
  // <digits><type><digits?> matched at the start of the text (the rest is ignored, as
  // PyTorch's re.match). Anything else is a c10::Error naming the text.
  static std::optional<Action> Parse(std::string_view text);

  friend bool operator==(const Action&, const Action&) = default;
};

// rank -> its actions in order; nullopt = an idle time step (None in PyTorch).
using PipelineOrder = std::map<int, std::vector<std::optional<Action>>>;

// The actions of one rank as PyTorch prints the list's items: each ToString(), "-" for an
// idle step, comma-separated (for messages and tests).
std::string ActionsToString(const std::vector<std::optional<Action>>& actions);
std::string ActionsToString(const std::vector<Action>& actions);

// (stage, microbatch) of each I in `actions` whose next action, past waits for earlier sends,
// is its own W: nothing can run between the two, so the runtime runs them as one autograd pass.
std::set<std::pair<int, int>> InputBackwardsFollowedByTheirWeight(const std::vector<Action>& actions);

// _format_pipeline_order, byte-identical: a time step x rank grid, with " <-- ERROR HERE" after
// the row of `error_step`. PyTorch's quirks kept: the columns are labelled "Rank 0".."Rank
// R-1" whatever the keys, column i is at least as wide as the label "Step i". An empty order,
// one whose ranks have no steps, or one with more ranks than steps (an IndexError in PyTorch)
// is a c10::Error.
std::string FormatPipelineOrder(const PipelineOrder& order, std::optional<int> error_step = std::nullopt);

// PipelineScheduleMulti._load_csv's reading: row r of the CSV file (Python's csv.reader) is
// rank r's actions, each cell Action::Parse'd ("" an idle step). Errors name the path, and
// for a bad cell its line and column.
PipelineOrder ReadScheduleCsv(const std::string& path);
// _dump_csv: one row per rank in key order, csv.writer's dialect ("\r\n" line ends, an idle step
// an empty cell, a row of one empty cell written `""`).
void WriteScheduleCsv(const PipelineOrder& order, const std::string& path);
// The text WriteScheduleCsv writes.
std::string ScheduleCsvText(const PipelineOrder& order);

}  // namespace fsdp::pipelining

#endif  // FSDP_PIPELINING_ACTION_H_
