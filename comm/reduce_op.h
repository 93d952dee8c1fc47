// ReduceOp: how a reducing collective combines the ranks' tensors.
#ifndef FSDP_COMM_REDUCE_OP_H_
#define FSDP_COMM_REDUCE_OP_H_

#include <string>

namespace fsdp::comm {

enum class ReduceOpKind { kSum, kAvg, kMax, kMin, kPremulSum };

// A reduction. PREMUL_SUM(f) is sum_r(f * x_r), FSDP's way to fold its gradient divide
// factor into the reduce-scatter. Cheap to copy.
class ReduceOp {
 public:
  static ReduceOp Sum() { return ReduceOp(ReduceOpKind::kSum, 1.0); }
  static ReduceOp Avg() { return ReduceOp(ReduceOpKind::kAvg, 1.0); }
  static ReduceOp Max() { return ReduceOp(ReduceOpKind::kMax, 1.0); }
  static ReduceOp Min() { return ReduceOp(ReduceOpKind::kMin, 1.0); }
  static ReduceOp PremulSum(double factor) { return ReduceOp(ReduceOpKind::kPremulSum, factor); }

  ReduceOpKind kind() const { return kind_; }
  // The pre-multiplication factor; 1.0 for every kind except PREMUL_SUM.
  double factor() const { return factor_; }
  // "SUM", "AVG", "MAX", "MIN" or "PREMUL_SUM(0.25)".
  std::string ToString() const;

  friend bool operator==(const ReduceOp& a, const ReduceOp& b) { return a.kind_ == b.kind_ && a.factor_ == b.factor_; }

 private:
  ReduceOp(ReduceOpKind kind, double factor) : kind_(kind), factor_(factor) {}
  ReduceOpKind kind_;
  double factor_;
};

}  // namespace fsdp::comm

#endif  // FSDP_COMM_REDUCE_OP_H_
