#include "checkpoint/checkpoint_writer.h"

#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/pickle.h>

namespace fsdp::checkpoint {
namespace {

void CheckCpu(const c10::IValue& value, int depth) {
  TORCH_CHECK(depth <= 64, "WriteCheckpoint: the value nests deeper than 64 containers");
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    TORCH_CHECK(!t.defined() || t.device().is_cpu(), "WriteCheckpoint: a tensor is on ", t.device(),
                "; move it to the CPU first");
  } else if (value.isTuple()) {
    for (const auto& v : value.toTupleRef().elements()) CheckCpu(v, depth + 1);
  } else if (value.isList()) {
    for (const auto& v : value.toListRef()) CheckCpu(v, depth + 1);
  } else if (value.isGenericDict()) {
    for (const auto& item : value.toGenericDict()) CheckCpu(item.value(), depth + 1);
  }
}

}  // namespace

std::vector<char> WriteCheckpoint(const c10::IValue& value) {
  CheckCpu(value, 0);
  return torch::jit::pickle_save(value);
}

}  // namespace fsdp::checkpoint
