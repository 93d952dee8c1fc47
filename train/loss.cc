// See loss.h.
#include "train/loss.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <vector>

#include "dtensor/dtensor.h"
#include "tensor_parallel/local_annotation.h"
#include "tensor_parallel/loss_parallel.h"

namespace fsdp::train {

at::Tensor CrossEntropySum(const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(
      logits.dim() == 3 && labels.dim() == 2 && logits.size(0) == labels.size(0) && logits.size(1) == labels.size(1),
      "CrossEntropySum: logits [batch, seq, vocab] and labels [batch, seq], got ", logits.sizes(), " and ",
      labels.sizes());
  const at::Tensor flat_labels = labels.reshape({-1});
  const at::Tensor flat_logits = logits.to(at::kFloat).reshape({-1, logits.size(-1)});  // pred.flatten(0, 1).float()
  if (const std::optional<dtensor::DTensor> d = tensor_parallel::AsDTensor(logits)) {
    const int64_t vocab = d->sizes().back();
    const dtensor::DTensor sharded =
        dtensor::DTensor::from_local(flat_logits, d->device_mesh(), {dtensor::Placement::Shard(1)},
                                     std::vector<int64_t>{flat_logits.size(0), vocab});
    return tensor_parallel::loss_parallel_cross_entropy(sharded, flat_labels,
                                                        {tensor_parallel::LossReduction::kSum, kIgnoreIndex});
  }
  return at::cross_entropy_loss(flat_logits, flat_labels, /*weight=*/{}, at::Reduction::Sum, kIgnoreIndex);
}

}  // namespace fsdp::train
