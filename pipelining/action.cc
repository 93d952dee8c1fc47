// The schedule IR's actions, their text forms and the CSV files of schedules, as
// torch/distributed/pipelining/schedules.py (_Action, _format_pipeline_order, _dump_csv,
// _load_csv).
#include "pipelining/action.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp::pipelining {
namespace {

// Python's str.strip() without arguments, over ASCII: whitespace and the separators
// \x1c..\x1f.
bool IsPySpace(char c) { return c == ' ' || (c >= '\t' && c <= '\r') || (c >= '\x1c' && c <= '\x1f'); }

std::string_view PyStrip(std::string_view s) {
  while (!s.empty() && IsPySpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsPySpace(s.back())) s.remove_suffix(1);
  return s;
}

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// The alternatives of schedules.py's _action_regex, in its order (the first that matches wins,
// so "WAIT_SEND_F" is tried before "W" and "RECV_F" before "F").
constexpr std::pair<std::string_view, ActionType> kRegexTypes[] = {
    {"WAIT_REDUCE_GRAD", ActionType::kWaitReduceGrad},
    {"WAIT_SEND_F", ActionType::kWaitSendF},
    {"WAIT_SEND_B", ActionType::kWaitSendB},
    {"REDUCE_GRAD", ActionType::kReduceGrad},
    {"UNSHARD", ActionType::kUnshard},
    {"RESHARD", ActionType::kReshard},
    {"SEND_F", ActionType::kSendF},
    {"RECV_F", ActionType::kRecvF},
    {"SEND_B", ActionType::kSendB},
    {"RECV_B", ActionType::kRecvB},
    {"F", ActionType::kForward},
    {"I", ActionType::kBackwardInput},
    {"B", ActionType::kFullBackward},
    {"W", ActionType::kBackwardWeight},
};

[[noreturn]] void InvalidAction(std::string_view text) {
  TORCH_CHECK(false, "Invalid action string: ", text,
              ", should be formatted as [stage][action type][(microbatch)] e.g. 2F0");
}

// Decimal digits as an int; more than an int holds is an invalid action (Python's int has no
// bound, ours does).
int DigitsToInt(std::string_view digits, std::string_view text) {
  int64_t v = 0;
  for (char c : digits) {
    v = v * 10 + (c - '0');
    if (v > std::numeric_limits<int>::max()) InvalidAction(text);
  }
  return static_cast<int>(v);
}

// The cell's CSV form: csv.writer's QUOTE_MINIMAL (quoted when it holds the delimiter, the
// quote or a line break; quotes doubled).
std::string CsvField(const std::string& field) {
  if (field.find_first_of(",\"\r\n") == std::string::npos) return field;
  std::string out = "\"";
  for (char c : field) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

struct CsvRow {
  int line = 0;  // 1-based line where the row starts
  std::vector<std::string> cells;
};

// Python's csv.reader over a file opened with newline="" (dialect "excel", not strict): ","
// separates, '"' quotes ("" inside quotes is one quote, text after a closing quote joins the
// field), a quote inside an unquoted field is kept; "\r\n", "\n" and "\r" end a row; a blank
// line is a row without cells. End of file inside quotes is an error.
std::vector<CsvRow> ParseCsv(const std::string& text, const std::string& path) {
  std::vector<CsvRow> rows;
  size_t i = 0;
  int line = 1;
  const size_t n = text.size();
  while (i < n) {
    CsvRow row;
    row.line = line;
    bool blank = true;  // nothing but the line end
    std::string field;
    bool in_quotes = false;
    bool at_field_start = true;
    bool row_done = false;
    while (!row_done) {
      if (i == n) {
        TORCH_CHECK(!in_quotes, path, ":", row.line, ": unexpected end of data inside a quoted field");
        break;
      }
      const char c = text[i++];
      if (in_quotes) {
        if (c == '"') {
          if (i < n && text[i] == '"') {
            field += '"';
            ++i;
          } else {
            in_quotes = false;
          }
        } else {
          if (c == '\n') ++line;
          field += c;
        }
        continue;
      }
      if (c == ',') {
        blank = false;
        row.cells.push_back(std::move(field));
        field.clear();
        at_field_start = true;
        continue;
      }
      if (c == '\r' || c == '\n') {
        if (c == '\r' && i < n && text[i] == '\n') ++i;
        ++line;
        row_done = true;
      } else if (c == '"' && at_field_start) {
        blank = false;
        in_quotes = true;
        at_field_start = false;
      } else {
        blank = false;
        at_field_start = false;
        field += c;
      }
    }
    if (!blank) row.cells.push_back(std::move(field));
    rows.push_back(std::move(row));
  }
  return rows;
}

}  // namespace

std::string_view ActionTypeName(ActionType type) {
  switch (type) {
    case ActionType::kForward: return "F";
    case ActionType::kBackwardInput: return "I";
    case ActionType::kBackwardWeight: return "W";
    case ActionType::kUnshard: return "UNSHARD";
    case ActionType::kReshard: return "RESHARD";
    case ActionType::kSendF: return "SEND_F";
    case ActionType::kRecvF: return "RECV_F";
    case ActionType::kSendB: return "SEND_B";
    case ActionType::kRecvB: return "RECV_B";
    case ActionType::kWaitSendF: return "WAIT_SEND_F";
    case ActionType::kWaitSendB: return "WAIT_SEND_B";
    case ActionType::kFullBackward: return "B";
    case ActionType::kOverlapFB: return "OVERLAP_F_B";
    case ActionType::kReduceGrad: return "REDUCE_GRAD";
    case ActionType::kWaitReduceGrad: return "WAIT_REDUCE_GRAD";
  }
  TORCH_CHECK(false, "unknown ActionType ", static_cast<int>(type));
}

ActionType ActionTypeFromName(std::string_view name) {
  for (ActionType t : kAllActionTypes) {
    if (ActionTypeName(t) == name) return t;
  }
  TORCH_CHECK(false, "Invalid computation type ", name);
}

bool Action::IsCompute() const {
  switch (type) {
    case ActionType::kForward:
    case ActionType::kFullBackward:
    case ActionType::kBackwardInput:
    case ActionType::kBackwardWeight:
    case ActionType::kOverlapFB: return true;
    default: return false;
  }
}

std::string Action::ToString() const {
  if (!sub_actions.empty()) {
    std::vector<std::string> parts;
    parts.reserve(sub_actions.size());
    for (const Action& a : sub_actions) parts.push_back(a.ToString());
    return absl::StrCat("(", absl::StrJoin(parts, ";"), ")", std::string(ActionTypeName(type)));
  }
  std::string out = absl::StrCat(stage, std::string(ActionTypeName(type)));
  if (microbatch.has_value()) absl::StrAppend(&out, *microbatch);
  return out;
}

std::optional<Action> Action::Parse(std::string_view raw) {
  const std::string_view text = PyStrip(raw);
  if (text.empty()) return std::nullopt;

  // The sub-actions form "(A;B)TYPE": the container's type is the text after the first ')'.
  const size_t close = text.find(')');
  if (text.front() == '(' && close != std::string_view::npos) {
    const std::string_view sub_part = text.substr(1, close - 1);
    const std::string_view type_part = text.substr(close + 1);
    Action container;
    container.stage = -1;
    if (!PyStrip(sub_part).empty()) {
      size_t start = 0;
      while (true) {
        const size_t semi = sub_part.find(';', start);
        const std::string_view piece =
            sub_part.substr(start, semi == std::string_view::npos ? std::string_view::npos : semi - start);
        if (std::optional<Action> sub = Parse(piece)) container.sub_actions.push_back(std::move(*sub));
        if (semi == std::string_view::npos) break;
        start = semi + 1;
      }
    }
    container.type = ActionTypeFromName(type_part);
    return container;
  }

  // _action_regex.match: (\d+)(TYPE alternatives)(\d*) at the start of the text.
  size_t digits = 0;
  while (digits < text.size() && IsDigit(text[digits])) ++digits;
  if (digits == 0) InvalidAction(text);
  const std::string_view rest = text.substr(digits);
  for (const auto& [name, type] : kRegexTypes) {
    if (rest.substr(0, name.size()) != name) continue;
    Action action;
    action.stage = DigitsToInt(text.substr(0, digits), text);
    action.type = type;
    size_t mb = name.size();
    while (mb < rest.size() && IsDigit(rest[mb])) ++mb;
    if (mb > name.size()) action.microbatch = DigitsToInt(rest.substr(name.size(), mb - name.size()), text);
    return action;
  }
  InvalidAction(text);
}

std::string ActionsToString(const std::vector<std::optional<Action>>& actions) {
  std::vector<std::string> parts;
  parts.reserve(actions.size());
  for (const auto& a : actions) parts.push_back(a.has_value() ? a->ToString() : "-");
  return absl::StrJoin(parts, ",");
}

std::string ActionsToString(const std::vector<Action>& actions) {
  std::vector<std::string> parts;
  parts.reserve(actions.size());
  for (const auto& a : actions) parts.push_back(a.ToString());
  return absl::StrJoin(parts, ",");
}

std::set<std::pair<int, int>> InputBackwardsFollowedByTheirWeight(const std::vector<Action>& actions) {
  std::set<std::pair<int, int>> pairs;
  for (size_t i = 0; i < actions.size(); ++i) {
    if (actions[i].type != ActionType::kBackwardInput) continue;
    size_t j = i + 1;  // past waits for earlier sends, which nothing in W needs and W cannot delay
    while (j < actions.size() &&
           (actions[j].type == ActionType::kWaitSendF || actions[j].type == ActionType::kWaitSendB)) {
      ++j;
    }
    if (j < actions.size() && actions[j].type == ActionType::kBackwardWeight && actions[j].stage == actions[i].stage &&
        actions[j].microbatch == actions[i].microbatch) {
      pairs.insert({actions[i].stage, actions[i].microbatch.value_or(-1)});
    }
  }
  return pairs;
}

std::string FormatPipelineOrder(const PipelineOrder& order, std::optional<int> error_step) {
  TORCH_CHECK(!order.empty(), "FormatPipelineOrder: the pipeline order has no ranks");
  size_t num_steps = 0;
  for (const auto& [rank, actions] : order) num_steps = std::max(num_steps, actions.size());
  TORCH_CHECK(num_steps > 0, "FormatPipelineOrder: no rank of the pipeline order has a step");
  const size_t num_ranks = order.size();
  // PyTorch zips the step labels with the ranks' columns, so there is one width per rank only
  // while there are at least as many steps as ranks (an IndexError otherwise).
  TORCH_CHECK(num_ranks <= num_steps, "FormatPipelineOrder: ", num_ranks, " ranks but only ", num_steps,
              " steps (PyTorch's _format_pipeline_order raises IndexError there)");

  const size_t label_digits = std::to_string(num_steps - 1).size();
  std::vector<std::string> step_labels;
  step_labels.reserve(num_steps);
  for (size_t i = 0; i < num_steps; ++i) {
    std::string n = std::to_string(i);
    step_labels.push_back("Step " + std::string(label_digits - std::min(label_digits, n.size()), '0') + n);
  }
  // cells[r][s]: rank r's step s, "" for an idle step or past the rank's end.
  std::vector<std::vector<std::string>> cells;
  for (const auto& [rank, actions] : order) {
    std::vector<std::string> column(num_steps);
    for (size_t s = 0; s < actions.size(); ++s) {
      if (actions[s].has_value()) column[s] = actions[s]->ToString();
    }
    cells.push_back(std::move(column));
  }
  std::vector<size_t> widths(num_ranks);
  for (size_t r = 0; r < num_ranks; ++r) {
    widths[r] = step_labels[r].size();
    for (const std::string& c : cells[r]) widths[r] = std::max(widths[r], c.size());
  }
  auto pad = [](const std::string& s, size_t width) {
    return s.size() >= width ? s : s + std::string(width - s.size(), ' ');
  };
  std::string out(step_labels[0].size() + 2, ' ');
  for (size_t r = 0; r < num_ranks; ++r) {
    if (r > 0) out += ' ';
    out += pad(absl::StrCat("Rank ", r), widths[r]);
  }
  out += '\n';
  for (size_t s = 0; s < num_steps; ++s) {
    out += step_labels[s] + ": ";
    for (size_t r = 0; r < num_ranks; ++r) {
      if (r > 0) out += ' ';
      out += pad(cells[r][s], widths[r]);
    }
    if (error_step.has_value() && static_cast<int64_t>(s) == *error_step) out += " <-- ERROR HERE";
    out += '\n';
  }
  return out;
}

PipelineOrder ReadScheduleCsv(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "cannot open the schedule CSV file ", path, ": ", std::strerror(errno));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TORCH_CHECK(!in.bad(), "cannot read the schedule CSV file ", path);
  PipelineOrder order;
  int rank = 0;
  for (const CsvRow& row : ParseCsv(text, path)) {
    std::vector<std::optional<Action>>& actions = order[rank++];
    for (size_t c = 0; c < row.cells.size(); ++c) {
      try {
        actions.push_back(Action::Parse(row.cells[c]));
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, path, ":", row.line, ": cell ", c + 1, " (rank ", rank - 1, ", step ", c,
                    "): ", e.what_without_backtrace());
      }
    }
  }
  return order;
}

std::string ScheduleCsvText(const PipelineOrder& order) {
  std::string out;
  for (const auto& [rank, actions] : order) {
    std::vector<std::string> fields;
    fields.reserve(actions.size());
    for (const auto& a : actions) fields.push_back(CsvField(a.has_value() ? a->ToString() : ""));
    // csv.writer quotes a row's only field when it is empty, so that the row is not blank.
    if (fields.size() == 1 && fields[0].empty()) fields[0] = "\"\"";
    absl::StrAppend(&out, absl::StrJoin(fields, ","), "\r\n");
  }
  return out;
}

void WriteScheduleCsv(const PipelineOrder& order, const std::string& path) {
  const std::string text = ScheduleCsvText(order);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  TORCH_CHECK(out, "cannot write the schedule CSV file ", path, ": ", std::strerror(errno));
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.close();
  TORCH_CHECK(out, "cannot write the schedule CSV file ", path, ": ", std::strerror(errno));
}

}  // namespace fsdp::pipelining
