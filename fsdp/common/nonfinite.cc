#include "fsdp/common/nonfinite.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp {

std::string NonfiniteVerdict::Describe(const std::string& where) const {
  return absl::StrCat("'", fqn, "' ", where, " on rank(s) ", absl::StrJoin(ranks, ", "));
}

std::optional<NonfiniteVerdict> JudgeNonfinite(const at::Tensor& gathered, const std::vector<std::string>& fqns) {
  TORCH_CHECK(gathered.dim() == 2 && gathered.size(1) == static_cast<int64_t>(fqns.size()),
              "JudgeNonfinite: expected flags of [ranks, ", fqns.size(), "], got ", gathered.sizes());
  const at::Tensor per_param = gathered.cpu().sum(0) > 0;
  NonfiniteVerdict v;
  v.flagged_parameters = per_param.sum().item<int64_t>();
  if (v.flagged_parameters == 0) return std::nullopt;
  const int64_t first = per_param.nonzero()[0][0].item<int64_t>();
  v.fqn = fqns[first];
  const at::Tensor column = gathered.cpu().select(1, first);
  for (int64_t r = 0; r < column.size(0); ++r) {
    if (column[r].item<int64_t>() != 0) v.ranks.push_back(r);
  }
  return v;
}

}  // namespace fsdp
