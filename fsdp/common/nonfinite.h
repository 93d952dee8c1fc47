// The non-finite gradient sentinel's verdict, shared by FSDP2, FSDP1 and clip_grad_norm_:
// from every rank's flags (gathered by the caller over its group) to one error line.
//
// Contract: `gathered` is [ranks, parameters] of bytes (nonzero: that rank's gradient of that
// parameter held NaN or Inf), the same on every rank; `fqns` names the parameters in column
// order. Pure: no communication.
#ifndef FSDP_FSDP_COMMON_NONFINITE_H_
#define FSDP_FSDP_COMMON_NONFINITE_H_

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

namespace fsdp {

struct NonfiniteVerdict {
  std::string fqn;             // the first flagged parameter
  std::vector<int64_t> ranks;  // the ranks that flagged it
  int64_t flagged_parameters = 0;
  // "'l1.bias' held NaN or Inf in its unreduced gradient on rank(s) 1"; `where` is the part
  // after the FQN ("held NaN or Inf in its unreduced gradient").
  std::string Describe(const std::string& where) const;
};

// nullopt when no rank flagged any parameter.
std::optional<NonfiniteVerdict> JudgeNonfinite(const at::Tensor& gathered, const std::vector<std::string>& fqns);

}  // namespace fsdp

#endif  // FSDP_FSDP_COMMON_NONFINITE_H_
