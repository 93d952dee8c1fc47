// Offline FSDP sharding planner: what each rank would hold and move, without running anything.
//
// Two layouts, both following PyTorch:
//   fsdp2 (FSDP2 fully_shard, fsdp2/_fsdp_param.py _init_sharded_param): every parameter
//     is chunked on dim 0 the torch.chunk way (fsdp::MakeDimShardLayout) and every rank stores
//     the rank-0 chunk size, zero-padded, so all-gather inputs are equal-sized.
//   flat (FSDP1 FlatParamHandle, fsdp1/_flat_param.py): parameters are flattened in order into
//     one FlatParameter; with use_orig_params each one starts on a 16-byte boundary
//     (_get_aligned_numel) and the total is padded to a multiple of the shard world size; the
//     flat tensor is then torch.chunk-ed (chunk = ceil(N/S), _shard_numel_padded for the rest).
// The library is plain integers so it can be tested exhaustively without tensors.
#ifndef TOOLS_FSDP_PLAN_LIB_H_
#define TOOLS_FSDP_PLAN_LIB_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/common/flat_layout.h"

namespace fsdp_plan {

enum class DType { kF32, kBF16, kF16, kF64 };
enum class Style { kFsdp2, kFsdp1 };

const char* DTypeName(DType dtype);  // "f32", "bf16", ...
int64_t ItemSize(DType dtype);       // bytes per element

using Shape = std::vector<int64_t>;

// The flags as typed; ParseOptions validates them all.
struct RawFlags {
  std::string shapes;       // "5x3,6,1024x1024"
  std::string world = "1";  // total ranks
  std::string mesh;         // "" (1-D FSDP) or "RxS" (HSDP)
  std::string dtype = "f32";
  std::string param_dtype;   // "" = no cast
  std::string reduce_dtype;  // "" = no cast
  std::string style = "fsdp2";
  bool align = true;  // flat: use_orig_params alignment padding
};

struct PlanOptions {
  std::vector<Shape> shapes;
  int64_t world = 1;
  int64_t replicate = 1;  // R: replicas (HSDP mesh dim 0); 1 for plain FSDP
  int64_t shard = 1;      // S: ranks each parameter is sharded over (mesh dim 1 / the world)
  DType dtype = DType::kF32;
  std::optional<DType> param_dtype;
  std::optional<DType> reduce_dtype;
  Style style = Style::kFsdp2;
  bool align = true;
};

// Each returns "" on success, else one line naming the flag and the offending value.
std::string ParseShapes(std::string_view text, std::vector<Shape>* out);
std::string ParseDType(std::string_view flag, std::string_view text, DType* out);
std::string ParseOptions(const RawFlags& flags, PlanOptions* out);

// FSDP2 per-parameter shard on one shard rank (sizes from fsdp::DimShardLayout).
struct ParamShard {
  int64_t index = 0;
  Shape sharded_size;         // this rank's rows (0 rows on trailing ranks is normal)
  Shape padded_sharded_size;  // rank-0 chunk size: what every rank stores
  int64_t offset = 0;         // first global row on dim 0
  int64_t numel = 0;
  int64_t padded_numel = 0;
};

// FSDP1 _ShardParamInfo and one stretch of the unsharded FlatParameter (an original
// parameter or padding): the layout math lives in fsdp/common/flat_layout.h, shared with
// the FlatParamHandle.
using FlatShardParamInfo = fsdp::FlatShardParamInfo;
using FlatSegment = fsdp::FlatSegment;

// Per-rank memory, in bytes.
struct RankBytes {
  int64_t params = 0;                 // sharded parameters as stored (padded), dtype
  int64_t grads = 0;                  // sharded gradients, dtype
  int64_t optim = 0;                  // AdamW exp_avg + exp_avg_sq, dtype
  int64_t reduce_scatter_output = 0;  // padded shard in the reduce dtype (transient)
};

struct RankPlan {
  int64_t shard_rank = 0;
  std::vector<int64_t> global_ranks;           // r * S + shard_rank for each replica r
  int64_t numel = 0;                           // parameter elements this rank owns (no padding)
  int64_t padded_numel = 0;                    // elements it stores
  std::vector<ParamShard> params;              // fsdp2
  int64_t flat_start = 0, flat_end = 0;        // flat: [start, end) of the unsharded flat param
  int64_t shard_numel_padded = 0;              // flat: _shard_numel_padded
  std::vector<FlatShardParamInfo> flat_infos;  // flat: one per original parameter
  RankBytes bytes;
};

struct Plan {
  PlanOptions options;
  DType unsharded_dtype = DType::kF32;  // all-gather / compute: param_dtype or dtype
  DType reduce_dtype = DType::kF32;     // reduce-scatter: reduce_dtype, else unsharded dtype
  int64_t total_numel = 0;              // sum of the original parameters' numels
  int64_t padded_total = 0;             // unsharded padded numel = S * per-rank padded numel
  int64_t aligned_numel = 0;            // flat: 16 / itemsize(unsharded) or 0
  std::vector<FlatSegment> flat_segments;
  std::vector<RankPlan> ranks;             // one per shard rank; replicas hold the same
  int64_t all_gather_buffer_bytes = 0;     // padded_total in the unsharded dtype
  int64_t reduce_scatter_input_bytes = 0;  // padded_total in the reduce dtype
  // FULL_SHARD, per rank per step (ring algorithms): each all-gather and the reduce-scatter
  // move padded_total * (S-1)/S elements; HSDP adds an all-reduce of the padded shard
  // across R replicas: 2 * P * (R-1)/R elements.
  int64_t all_gather_elements = 0;  // one all-gather (forward or backward)
  int64_t reduce_scatter_elements = 0;
  double all_reduce_elements = 0;
  double comm_bytes = 0;  // 2 all-gathers + reduce-scatter (+ all-reduce)
};

// Preconditions: options came from ParseOptions (validated).
Plan MakePlan(const PlanOptions& options);

std::string FormatText(const Plan& plan);
std::string FormatJson(const Plan& plan);

// JSON string literal (with quotes) for arbitrary bytes: escapes ", \ and control chars.
std::string JsonQuote(std::string_view s);

}  // namespace fsdp_plan

#endif  // TOOLS_FSDP_PLAN_LIB_H_
