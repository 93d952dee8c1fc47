// Flag validation and the sharding plan; formatting lives in fsdp_plan_format.cc.
#include "tools/fsdp_plan_lib.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "fsdp/common/flat_layout.h"
#include "fsdp/common/sharding.h"

namespace fsdp_plan {
namespace {

// Caps keep every byte count (numel x 8 bytes x world) far inside int64.
constexpr int64_t kMaxTotalNumel = int64_t{1} << 44;
constexpr int64_t kMaxWorld = int64_t{1} << 16;

// Strict decimal: optional '-', then 1..18 digits, nothing else (no spaces, no '+').
bool ParseInt(std::string_view s, int64_t* out) {
  bool neg = !s.empty() && s[0] == '-';
  if (neg) s.remove_prefix(1);
  if (s.empty() || s.size() > 18) return false;
  int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  *out = neg ? -v : v;
  return true;
}

// The reduce-scatter runs in reduce_dtype if given. Unset, FSDP2 (PyTorch 2.15's
// FSDPParam.unsharded_grad_dtype) reduces in the original parameter dtype, FSDP1
// (_init_param_reduce_dtypes) in param_dtype.
DType ReduceDType(const PlanOptions& o) {
  if (o.reduce_dtype) return *o.reduce_dtype;
  return o.style == Style::kFsdp2 ? o.dtype : o.param_dtype.value_or(o.dtype);
}

// Debian's abseil has its own absl::string_view (ABSL_OPTION_USE_STD_STRING_VIEW 0), so
// std::string_view goes to StrCat as std::string and splitting is done here.
std::string Str(std::string_view v) { return std::string(v); }

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  for (size_t pos = 0;;) {
    const size_t next = s.find(sep, pos);
    parts.push_back(s.substr(pos, next == std::string_view::npos ? std::string_view::npos : next - pos));
    if (next == std::string_view::npos) return parts;
    pos = next + 1;
  }
}

void PlanPerParam(Plan* plan) {
  const PlanOptions& o = plan->options;
  for (int64_t s = 0; s < o.shard; ++s) {
    RankPlan& rank = plan->ranks[s];
    for (size_t i = 0; i < o.shapes.size(); ++i) {
      // FSDP2 default placement is Shard(0); trailing ranks may own 0 rows yet still store
      // the rank-0 chunk (padded_sharded_size) so every all-gather input has equal size.
      fsdp::DimShardLayout l = fsdp::MakeDimShardLayout(o.shapes[i], 0, o.shard, s);
      ParamShard p;
      p.index = static_cast<int64_t>(i);
      p.sharded_size = l.sharded_size;
      p.padded_sharded_size = l.padded_sharded_size;
      p.offset = l.offset;
      p.numel = l.sharded_numel();
      p.padded_numel = l.padded_sharded_numel();
      rank.numel += p.numel;
      rank.padded_numel += p.padded_numel;
      rank.params.push_back(std::move(p));
    }
    const int64_t item = ItemSize(o.dtype);
    rank.bytes.params = rank.padded_numel * item;
    // Sharded gradients have the sharded (unpadded) size in the parameter's dtype; without a
    // cast they are views into the padded reduce-scatter output, counted separately below.
    rank.bytes.grads = rank.numel * item;
    // torch.optim.AdamW: exp_avg, exp_avg_sq = zeros_like(param) on the local shard.
    rank.bytes.optim = 2 * rank.numel * item;
    rank.bytes.reduce_scatter_output = rank.padded_numel * ItemSize(plan->reduce_dtype);
  }
  // Every rank pads to the same chunk, so the unsharded buffer is S x any rank's padded numel.
  plan->padded_total = plan->ranks[0].padded_numel * o.shard;
}

void PlanFlat(Plan* plan) {
  const PlanOptions& o = plan->options;
  // _get_aligned_numel(unsharded_dtype=_fwd_bwd_param_dtype): 16-byte alignment (Inductor).
  plan->aligned_numel = o.align ? fsdp::FlatAlignedNumel(ItemSize(plan->unsharded_dtype)) : 0;
  // FlatParamHandle._init_flat_param_and_metadata: each parameter starts at a multiple of
  // aligned_numel, then (only when aligning) the total is padded to a multiple of S.
  std::vector<int64_t> numels;
  for (const Shape& s : o.shapes) numels.push_back(fsdp::Numel(s));
  plan->flat_segments = fsdp::MakeFlatSegments(numels, plan->aligned_numel, o.shard);
  const int64_t n = fsdp::FlatTotalNumel(plan->flat_segments);
  int64_t chunk = 0;
  for (int64_t s = 0; s < o.shard; ++s) {
    RankPlan& rank = plan->ranks[s];
    // _get_unpadded_shard: torch.chunk of the flat tensor; ranks past the last chunk get an
    // empty one, and every rank pads up to chunks[0] (_shard_numel_padded).
    const fsdp::FlatChunk c = fsdp::MakeFlatChunk(n, o.shard, s);
    chunk = c.chunk;
    rank.flat_start = c.start;
    rank.flat_end = c.end;
    rank.shard_numel_padded = c.numel_padded;
    rank.padded_numel = chunk;
    // _get_shard_metadata over [s * chunk, (s + 1) * chunk - 1], padding segments skipped.
    rank.flat_infos = fsdp::FlatShardParamInfos(plan->flat_segments, s * chunk, (s + 1) * chunk - 1);
    for (const FlatShardParamInfo& info : rank.flat_infos) {
      if (info.in_shard) rank.numel += info.numel_in_shard;
    }
    const int64_t item = ItemSize(o.dtype);
    rank.bytes.params = chunk * item;
    // FlatParameter.grad is the padded flat shard (reduce-scatter output, cast back to dtype).
    rank.bytes.grads = chunk * item;
    // use_orig_params: the optimizer sees the original parameters' sharded views, so AdamW
    // state covers only real elements; otherwise it sees the padded flat shard.
    rank.bytes.optim = 2 * (o.align ? rank.numel : chunk) * item;
    rank.bytes.reduce_scatter_output = chunk * ItemSize(plan->reduce_dtype);
  }
  plan->padded_total = chunk * o.shard;
}

}  // namespace

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kF64: return "f64";
  }
  return "?";
}

int64_t ItemSize(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kF64: return 8;
  }
  return 1;
}

std::string ParseShapes(std::string_view text, std::vector<Shape>* out) {
  out->clear();
  if (text.empty()) return "--shapes: empty (expected e.g. --shapes=5x3,6,1024x1024)";
  int64_t total = 0;
  for (std::string_view item : Split(text, ',')) {
    if (item.empty()) {
      return absl::StrCat("--shapes: empty shape in '", Str(text), "' (stray comma?)");
    }
    Shape shape;
    int64_t numel = 1;
    for (std::string_view dim : Split(item, 'x')) {
      int64_t d = 0;
      if (!ParseInt(dim, &d)) {
        return absl::StrCat("--shapes: dimension '", Str(dim), "' of shape '", Str(item), "' is not an integer");
      }
      if (d <= 0) {
        return absl::StrCat("--shapes: dimension ", d, " of shape '", Str(item), "' must be positive");
      }
      if (d > kMaxTotalNumel || numel > kMaxTotalNumel / d) {
        return absl::StrCat("--shapes: shape '", Str(item), "' has more than 2^44 elements");
      }
      numel *= d;
      shape.push_back(d);
    }
    total += numel;
    if (total > kMaxTotalNumel) {
      return absl::StrCat("--shapes: '", Str(text), "' has more than 2^44 elements in total");
    }
    out->push_back(std::move(shape));
  }
  return "";
}

std::string ParseDType(std::string_view flag, std::string_view text, DType* out) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16, DType::kF64}) {
    if (text == DTypeName(d)) {
      *out = d;
      return "";
    }
  }
  return absl::StrCat(Str(flag), ": unknown dtype '", Str(text), "' (expected f32, bf16, f16 or f64)");
}

std::string ParseOptions(const RawFlags& f, PlanOptions* o) {
  *o = PlanOptions();
  if (std::string err = ParseShapes(f.shapes, &o->shapes); !err.empty()) return err;
  if (!ParseInt(f.world, &o->world)) {
    return absl::StrCat("--world: '", f.world, "' is not an integer");
  }
  if (o->world < 1 || o->world > kMaxWorld) {
    return absl::StrCat("--world: ", o->world, " must be in [1, ", kMaxWorld, "]");
  }
  o->replicate = 1;
  o->shard = o->world;
  if (!f.mesh.empty()) {
    std::vector<std::string_view> parts = Split(f.mesh, 'x');
    if (parts.size() != 2 || !ParseInt(parts[0], &o->replicate) || !ParseInt(parts[1], &o->shard) || o->replicate < 1 ||
        o->shard < 1) {
      return absl::StrCat("--mesh: '", f.mesh, "' is not RxS with positive R (replicas) and S (shards), e.g. 2x4");
    }
    if (o->replicate > o->world || o->shard > o->world || o->replicate * o->shard != o->world) {
      // (Both factors are <= world before multiplying, so the product cannot overflow.)
      return absl::StrCat("--mesh: '", f.mesh, "' (", o->replicate, " replicas x ", o->shard,
                          " shards) does not match --world ", o->world, ": R * S must equal the world size");
    }
  }
  if (std::string err = ParseDType("--dtype", f.dtype, &o->dtype); !err.empty()) return err;
  if (!f.param_dtype.empty()) {
    DType d;
    if (std::string err = ParseDType("--param_dtype", f.param_dtype, &d); !err.empty()) {
      return err;
    }
    o->param_dtype = d;
  }
  if (!f.reduce_dtype.empty()) {
    DType d;
    if (std::string err = ParseDType("--reduce_dtype", f.reduce_dtype, &d); !err.empty()) {
      return err;
    }
    o->reduce_dtype = d;
  }
  if (f.style == "fsdp2") {
    o->style = Style::kFsdp2;
  } else if (f.style == "fsdp1") {
    o->style = Style::kFsdp1;
  } else {
    return absl::StrCat("--style: unknown style '", f.style, "' (expected fsdp2 or fsdp1)");
  }
  o->align = f.align;
  return "";
}

Plan MakePlan(const PlanOptions& options) {
  Plan plan;
  plan.options = options;
  plan.unsharded_dtype = options.param_dtype.value_or(options.dtype);
  plan.reduce_dtype = ReduceDType(options);
  for (const Shape& s : options.shapes) plan.total_numel += fsdp::Numel(s);
  plan.ranks.resize(options.shard);
  for (int64_t s = 0; s < options.shard; ++s) {
    plan.ranks[s].shard_rank = s;
    // HSDP mesh (replicate, shard), row-major: global rank = r * S + s.
    for (int64_t r = 0; r < options.replicate; ++r) {
      plan.ranks[s].global_ranks.push_back(r * options.shard + s);
    }
  }
  if (options.style == Style::kFsdp2) {
    PlanPerParam(&plan);
  } else {
    PlanFlat(&plan);
  }
  const int64_t S = options.shard, R = options.replicate;
  const int64_t P = plan.ranks[0].padded_numel;  // padded_total = S * P
  plan.all_gather_buffer_bytes = plan.padded_total * ItemSize(plan.unsharded_dtype);
  plan.reduce_scatter_input_bytes = plan.padded_total * ItemSize(plan.reduce_dtype);
  // Ring all-gather / reduce-scatter: each rank sends (S-1) of the S equal chunks.
  plan.all_gather_elements = P * (S - 1);
  plan.reduce_scatter_elements = P * (S - 1);
  plan.all_reduce_elements = 2.0 * static_cast<double>(P) * static_cast<double>(R - 1) / static_cast<double>(R);
  plan.comm_bytes = static_cast<double>(2 * plan.all_gather_elements * ItemSize(plan.unsharded_dtype) +
                                        plan.reduce_scatter_elements * ItemSize(plan.reduce_dtype)) +
                    plan.all_reduce_elements * static_cast<double>(ItemSize(plan.reduce_dtype));
  return plan;
}

}  // namespace fsdp_plan
