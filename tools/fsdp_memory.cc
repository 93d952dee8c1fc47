#include "tools/fsdp_memory.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace fsdp_plan {

std::string ParseMemoryOptions(const RawMemoryFlags& flags, MemoryOptions* out) {
  if (!absl::SimpleAtoi(flags.units, &out->units) || out->units < 1 || out->units > (int64_t{1} << 20)) {
    return absl::StrCat("--units must be an integer in [1, 1048576], got '", flags.units, "'");
  }
  if (!absl::SimpleAtoi(flags.activation_bytes, &out->activation_bytes) || out->activation_bytes < 0 ||
      out->activation_bytes > (int64_t{1} << 50)) {
    return absl::StrCat("--activation_bytes must be an integer in [0, 2^50], got '", flags.activation_bytes, "'");
  }
  const std::string_view opt = flags.optimizer;
  if (opt == "adamw" || opt == "adam") {
    out->optimizer_states = 2;
  } else if (opt == "sgd") {
    out->optimizer_states = 0;
  } else if (opt == "sgd_momentum" || opt == "adagrad" || opt == "rmsprop") {
    out->optimizer_states = 1;
  } else {
    return absl::StrCat("--optimizer must be adamw, adam, sgd, sgd_momentum, adagrad or rmsprop, got '",
                        flags.optimizer, "'");
  }
  out->reshard_after_forward = flags.reshard_after_forward;
  return "";
}

namespace {

// The largest single tensor of a rank's shard: torch::optim updates parameter by parameter,
// so its temporaries are at most this size (FSDP1: the whole flat shard is one parameter).
int64_t LargestShardBytes(const Plan& plan) {
  const RankPlan& rank = plan.ranks.front();
  if (plan.options.style == Style::kFsdp1) return rank.bytes.params;
  int64_t largest = 0;
  for (const ParamShard& p : rank.params) largest = std::max(largest, p.padded_numel);
  return largest * ItemSize(plan.options.dtype);
}

}  // namespace

MemoryEstimate EstimateMemory(const Plan& plan, const MemoryOptions& options) {
  MemoryEstimate m;
  const int64_t n = options.units;
  // Rank 0 holds the largest shard (torch.chunk); FSDP2 pads every rank to it anyway.
  const RankBytes& unit = plan.ranks.front().bytes;
  m.sharded_params = n * unit.params;
  m.sharded_grads = n * unit.grads;
  m.optimizer_state = n * options.optimizer_states * unit.params;
  m.unsharded_unit = plan.all_gather_buffer_bytes;
  m.unsharded_grads = plan.all_gather_buffer_bytes;  // computed in the unsharded dtype
  m.reduce_scatter_input = plan.reduce_scatter_input_bytes;
  m.activations = n * options.activation_bytes;
  const int64_t persistent = m.sharded_params + m.optimizer_state;
  const int64_t u = m.unsharded_unit, a = options.activation_bytes;

  auto consider = [&m](int64_t total, std::string phase) {
    if (total > m.peak) {
      m.peak = total;
      m.peak_phase = std::move(phase);
    }
  };
  for (int64_t k = 0; k < n; ++k) {
    // Unit k's parameters and the next unit's, prefetched (or every unit so far, kept).
    const int64_t next = k + 1 < n ? 1 : 0;
    const int64_t params = options.reshard_after_forward ? (1 + next) * u : (k + 1 + next) * u;
    consider(persistent + k * a + params, absl::StrCat("forward of unit ", k));
  }
  // FSDP1 flattens unit k's gradients and fills its reduce-scatter input while the unit is
  // still unsharded; FSDP2 reshards the unit first (FSDPParamGroup::PostBackward), so its
  // copy-in buffer takes the place of the unit's parameters.
  const bool flat = plan.options.style == Style::kFsdp1;
  for (int64_t k = n - 1; k >= 0; --k) {
    const int64_t prefetched = k > 0 ? 1 : 0;
    const int64_t params = options.reshard_after_forward ? (1 + prefetched) * u : (k + 1) * u;
    const int64_t gradients = params + m.unsharded_grads;  // while autograd computes unit k's
    const int64_t reduce = (flat ? params : params - u) + m.unsharded_grads + m.reduce_scatter_input;
    const int64_t total = persistent + (n - 1 - k) * unit.grads + (k + 1) * a + std::max(gradients, reduce);
    consider(total, absl::StrCat("backward of unit ", k));
  }
  consider(persistent + m.sharded_grads + 2 * LargestShardBytes(plan), "optimizer step");
  return m;
}

std::string FormatMemoryText(const MemoryEstimate& m) {
  return absl::StrCat("memory per rank (bytes, steady state, FULL_SHARD):\n", "  sharded parameters       ",
                      m.sharded_params, "\n", "  optimizer state          ", m.optimizer_state, "\n",
                      "  sharded gradients        ", m.sharded_grads, "\n", "  unsharded unit           ",
                      m.unsharded_unit, "\n", "  unsharded gradients      ", m.unsharded_grads, "\n",
                      "  reduce-scatter input     ", m.reduce_scatter_input, "\n", "  activations              ",
                      m.activations, "\n", "  predicted peak           ", m.peak, " (", m.peak_phase, ")\n");
}

std::string FormatMemoryJson(const MemoryEstimate& m) {
  return absl::StrCat("\"memory\": {\"sharded_params\": ", m.sharded_params,
                      ", \"optimizer_state\": ", m.optimizer_state, ", \"sharded_grads\": ", m.sharded_grads,
                      ", \"unsharded_unit\": ", m.unsharded_unit, ", \"unsharded_grads\": ", m.unsharded_grads,
                      ", \"reduce_scatter_input\": ", m.reduce_scatter_input, ", \"activations\": ", m.activations,
                      ", \"peak\": ", m.peak, ", \"peak_phase\": ", JsonQuote(m.peak_phase), "}");
}

}  // namespace fsdp_plan
