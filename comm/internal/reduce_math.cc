#include "comm/internal/reduce_math.h"

#include <ATen/ATen.h>

namespace fsdp::comm::internal {

at::Tensor ReduceInRankOrder(const std::vector<at::Tensor>& xs, ReduceOp op) {
  const auto dtype = xs.at(0).scalar_type();
  const bool low_precision = dtype == at::kHalf || dtype == at::kBFloat16;
  const auto acc_dtype = low_precision ? at::kFloat : dtype;
  at::Tensor acc = xs[0].to(acc_dtype, /*non_blocking=*/false, /*copy=*/true);
  const bool premul = op.kind() == ReduceOpKind::kPremulSum;
  if (premul) acc.mul_(op.factor());
  for (size_t j = 1; j < xs.size(); ++j) {
    at::Tensor x = xs[j].to(acc_dtype);
    switch (op.kind()) {
      case ReduceOpKind::kSum:
      case ReduceOpKind::kAvg: acc.add_(x); break;
      case ReduceOpKind::kPremulSum: acc.add_(x, op.factor()); break;
      case ReduceOpKind::kMax: at::maximum_out(acc, acc, x); break;
      case ReduceOpKind::kMin: at::minimum_out(acc, acc, x); break;
    }
  }
  if (op.kind() == ReduceOpKind::kAvg) acc.div_(static_cast<double>(xs.size()));
  return acc.to(dtype);
}

}  // namespace fsdp::comm::internal
