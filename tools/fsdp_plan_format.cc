// Text and JSON renderings of a Plan. JSON is written by hand (no JSON dependency in the
// repo); every string goes through JsonQuote, numbers are plain integers or %.15g doubles.
#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "fsdp/common/sharding.h"
#include "tools/fsdp_plan_lib.h"

namespace fsdp_plan {
namespace {

std::string ShapeStr(const Shape& s) { return absl::StrCat("[", absl::StrJoin(s, ","), "]"); }

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.15g", v);
  return buf;
}

// "240 B", or "4194304 B (4.00 MiB)" once a larger unit helps.
std::string Bytes(double b) {
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  std::string out = Num(b) + " B";
  if (b < 1024) return out;
  int u = 0;
  for (b /= 1024; b >= 1024 && u < 3; b /= 1024) ++u;
  char buf[32];
  std::snprintf(buf, sizeof(buf), " (%.2f %s)", b, units[u]);
  return out + buf;
}

// Left-aligned columns, two spaces apart, indented by two.
std::string Table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    width.resize(std::max(width.size(), row.size()), 0);
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line = " ";
    for (size_t c = 0; c < row.size(); ++c) {
      line += " " + row[c];
      if (c + 1 < row.size()) line += std::string(width[c] - row[c].size() + 1, ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

std::string Ranks(const std::vector<int64_t>& r) {
  return absl::StrCat(r.size() == 1 ? "global rank " : "global ranks ", absl::StrJoin(r, ","));
}

// ---- JSON helpers: values are already-serialized JSON text.
using Fields = std::vector<std::pair<std::string, std::string>>;

std::string Obj(const Fields& fields) {
  std::string out = "{";
  for (size_t i = 0; i < fields.size(); ++i) {
    absl::StrAppend(&out, i ? "," : "", JsonQuote(fields[i].first), ":", fields[i].second);
  }
  return out + "}";
}

std::string Arr(const std::vector<std::string>& items) { return absl::StrCat("[", absl::StrJoin(items, ","), "]"); }

std::string IntArr(const std::vector<int64_t>& v) { return absl::StrCat("[", absl::StrJoin(v, ","), "]"); }

std::string I(int64_t v) { return absl::StrCat(v); }

std::string OptDType(const std::optional<DType>& d) { return d ? JsonQuote(DTypeName(*d)) : "null"; }

}  // namespace

std::string JsonQuote(std::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);  // printable ASCII or UTF-8 bytes pass through
        }
    }
  }
  return out + "\"";
}

std::string FormatText(const Plan& plan) {
  const PlanOptions& o = plan.options;
  const bool flat = o.style == Style::kFsdp1;
  const char* dt = DTypeName(o.dtype);
  const char* rdt = DTypeName(plan.reduce_dtype);
  std::string out;
  if (flat) {
    absl::StrAppend(&out, "FSDP plan: flat (FSDP1 FlatParameter, ",
                    plan.aligned_numel > 0 ? absl::StrCat("use_orig_params: align to ", plan.aligned_numel,
                                                          " elements = 16 B of ", DTypeName(plan.unsharded_dtype))
                                           : std::string("no alignment padding"),
                    ")");
  } else {
    absl::StrAppend(&out, "FSDP plan: fsdp2 (FSDP2 fully_shard, Shard(0))");
  }
  absl::StrAppend(&out, ", ", o.shapes.size(), " parameters, ", plan.total_numel, " elements\n");
  absl::StrAppend(&out, "mesh: world ", o.world, " = ", o.replicate, " replica", o.replicate == 1 ? "" : "s", " x ",
                  o.shard, " shards", o.replicate == 1 ? " (1-D FSDP)\n" : " (HSDP: replicas hold identical shards)\n");
  absl::StrAppend(&out, "dtypes: stored ", dt, ", unsharded/all-gather ", DTypeName(plan.unsharded_dtype),
                  ", reduce-scatter ", rdt, "\n");

  std::vector<std::vector<std::string>> rows = {{"param", "shape", "numel"}};
  for (size_t i = 0; i < o.shapes.size(); ++i) {
    rows.push_back({I(i), ShapeStr(o.shapes[i]), I(fsdp::Numel(o.shapes[i]))});
  }
  absl::StrAppend(&out, "\nparameters:\n", Table(rows));

  if (flat) {
    absl::StrAppend(&out, "\nflat parameter: ", plan.padded_total, " elements (", plan.total_numel, " parameter + ",
                    plan.padded_total - plan.total_numel, " padding), chunk ", plan.ranks[0].padded_numel,
                    " per rank\n");
    rows = {{"segment", "[start, end)", "holds"}};
    for (size_t i = 0; i < plan.flat_segments.size(); ++i) {
      const FlatSegment& s = plan.flat_segments[i];
      rows.push_back({I(i), absl::StrCat("[", s.start, ", ", s.start + s.numel, ")"),
                      s.param_index < 0 ? "padding" : absl::StrCat("param ", s.param_index)});
    }
    absl::StrAppend(&out, Table(rows));
  }

  for (const RankPlan& r : plan.ranks) {
    absl::StrAppend(&out, "\nshard rank ", r.shard_rank, " (", Ranks(r.global_ranks), ")");
    if (flat) {
      absl::StrAppend(&out, ": flat [", r.flat_start, ", ", r.flat_end, "), _shard_numel_padded ", r.shard_numel_padded,
                      "\n");
      rows = {{"param", "intra_param_start_idx", "intra_param_end_idx", "offset_in_shard", "numel_in_shard"}};
      for (const FlatShardParamInfo& f : r.flat_infos) {
        if (!f.in_shard) continue;
        rows.push_back({I(f.index), I(f.intra_param_start_idx), I(f.intra_param_end_idx), I(f.offset_in_shard),
                        I(f.numel_in_shard)});
      }
      if (rows.size() == 1) rows.push_back({"(none: padding only)"});
    } else {
      absl::StrAppend(&out, ":\n");
      rows = {{"param", "local", "padded", "row_offset", "numel", "padded_numel"}};
      for (const ParamShard& p : r.params) {
        rows.push_back({I(p.index), ShapeStr(p.sharded_size), ShapeStr(p.padded_sharded_size), I(p.offset), I(p.numel),
                        I(p.padded_numel)});
      }
    }
    absl::StrAppend(&out, Table(rows));
  }

  absl::StrAppend(&out, "\nper-rank memory in bytes (", flat ? "grads: padded flat shard; " : "grads: unpadded shard; ",
                  "AdamW: exp_avg + exp_avg_sq in ", dt, "):\n");
  rows = {{"shard_rank", "numel", "padded_numel", absl::StrCat("params(", dt, ",padded)"),
           absl::StrCat("grads(", dt, ")"), "adamw", absl::StrCat("rs_output(", rdt, ")")}};
  for (const RankPlan& r : plan.ranks) {
    rows.push_back({I(r.shard_rank), I(r.numel), I(r.padded_numel), I(r.bytes.params), I(r.bytes.grads),
                    I(r.bytes.optim), I(r.bytes.reduce_scatter_output)});
  }
  absl::StrAppend(&out, Table(rows));
  if (plan.reduce_dtype != o.dtype) {
    absl::StrAppend(&out, "  note: gradients are reduced in ", rdt,
                    " (rs_output, "
                    "reduce-scatter input) and cast back to ",
                    dt, " for the sharded grads\n");
  }

  const int64_t S = o.shard, P = plan.ranks[0].padded_numel;
  absl::StrAppend(&out, "\nunsharded buffers (on every rank while the group is unsharded): ", plan.padded_total,
                  " padded elements = ", S, " shards x ", P, "\n");
  absl::StrAppend(&out, "  all-gather output: ", Bytes(plan.all_gather_buffer_bytes), " in ",
                  DTypeName(plan.unsharded_dtype), "\n");
  absl::StrAppend(&out, "  reduce-scatter input: ", Bytes(plan.reduce_scatter_input_bytes), " in ", rdt, "\n");
  absl::StrAppend(&out, "\ncommunication per rank per step (FULL_SHARD, ring):\n  3 x ", plan.padded_total, " x (", S,
                  "-1)/", S, " = ", 2 * plan.all_gather_elements + plan.reduce_scatter_elements,
                  " elements: all-gather fwd ", plan.all_gather_elements, " + all-gather bwd ",
                  plan.all_gather_elements, " + reduce-scatter ", plan.reduce_scatter_elements, "\n");
  if (o.replicate > 1) {
    absl::StrAppend(&out, "  + HSDP all-reduce across ", o.replicate, " replicas: 2 x ", P, " x (", o.replicate, "-1)/",
                    o.replicate, " = ", Num(plan.all_reduce_elements), " elements (", rdt, ")\n");
  }
  absl::StrAppend(&out, "  = ", Bytes(plan.comm_bytes), " per rank per step\n");
  return out;
}

std::string FormatJson(const Plan& plan) {
  const PlanOptions& o = plan.options;
  const bool flat = o.style == Style::kFsdp1;
  std::vector<std::string> params, segments, ranks;
  for (size_t i = 0; i < o.shapes.size(); ++i) {
    params.push_back(Obj({{"index", I(i)}, {"shape", IntArr(o.shapes[i])}, {"numel", I(fsdp::Numel(o.shapes[i]))}}));
  }
  for (const FlatSegment& s : plan.flat_segments) {
    segments.push_back(Obj({{"param", s.param_index < 0 ? "null" : I(s.param_index)},
                            {"start", I(s.start)},
                            {"end", I(s.start + s.numel)}}));
  }
  for (const RankPlan& r : plan.ranks) {
    Fields f = {{"shard_rank", I(r.shard_rank)},
                {"global_ranks", IntArr(r.global_ranks)},
                {"numel", I(r.numel)},
                {"padded_numel", I(r.padded_numel)}};
    if (flat) {
      std::vector<std::string> infos;
      for (const FlatShardParamInfo& x : r.flat_infos) {
        Fields g = {{"param", I(x.index)}, {"in_shard", x.in_shard ? "true" : "false"}};
        if (x.in_shard) {
          g.insert(g.end(), {{"offset_in_shard", I(x.offset_in_shard)},
                             {"numel_in_shard", I(x.numel_in_shard)},
                             {"intra_param_start_idx", I(x.intra_param_start_idx)},
                             {"intra_param_end_idx", I(x.intra_param_end_idx)}});
        }
        infos.push_back(Obj(g));
      }
      f.insert(f.end(), {{"flat_start", I(r.flat_start)},
                         {"flat_end", I(r.flat_end)},
                         {"shard_numel_padded", I(r.shard_numel_padded)},
                         {"shard_param_infos", Arr(infos)}});
    } else {
      std::vector<std::string> ps;
      for (const ParamShard& p : r.params) {
        ps.push_back(Obj({{"param", I(p.index)},
                          {"sharded_size", IntArr(p.sharded_size)},
                          {"padded_sharded_size", IntArr(p.padded_sharded_size)},
                          {"offset", I(p.offset)},
                          {"numel", I(p.numel)},
                          {"padded_numel", I(p.padded_numel)}}));
      }
      f.push_back({"params", Arr(ps)});
    }
    f.push_back({"bytes", Obj({{"params", I(r.bytes.params)},
                               {"grads", I(r.bytes.grads)},
                               {"optim", I(r.bytes.optim)},
                               {"reduce_scatter_output", I(r.bytes.reduce_scatter_output)}})});
    ranks.push_back(Obj(f));
  }
  Fields top = {{"style", JsonQuote(flat ? "fsdp1" : "fsdp2")},
                {"world", I(o.world)},
                {"replicate", I(o.replicate)},
                {"shard", I(o.shard)},
                {"dtype", JsonQuote(DTypeName(o.dtype))},
                {"param_dtype", OptDType(o.param_dtype)},
                {"reduce_dtype", OptDType(o.reduce_dtype)},
                {"unsharded_dtype", JsonQuote(DTypeName(plan.unsharded_dtype))},
                {"reduce_scatter_dtype", JsonQuote(DTypeName(plan.reduce_dtype))},
                {"total_numel", I(plan.total_numel)},
                {"padded_total_numel", I(plan.padded_total)},
                {"params", Arr(params)}};
  if (flat) {
    top.push_back({"aligned_numel", I(plan.aligned_numel)});
    top.push_back({"flat_segments", Arr(segments)});
  }
  top.push_back({"ranks", Arr(ranks)});
  top.push_back({"group_bytes", Obj({{"all_gather_buffer", I(plan.all_gather_buffer_bytes)},
                                     {"reduce_scatter_input", I(plan.reduce_scatter_input_bytes)}})});
  top.push_back({"comm", Obj({{"formula", JsonQuote("3 x padded_total x (S-1)/S elements per rank "
                                                    "(+ 2 x P x (R-1)/R all-reduce for HSDP)")},
                              {"all_gather_forward_elements", I(plan.all_gather_elements)},
                              {"all_gather_backward_elements", I(plan.all_gather_elements)},
                              {"reduce_scatter_elements", I(plan.reduce_scatter_elements)},
                              {"all_reduce_elements", Num(plan.all_reduce_elements)},
                              {"bytes", Num(plan.comm_bytes)}})});
  return Obj(top) + "\n";
}

}  // namespace fsdp_plan
