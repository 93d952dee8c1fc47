#include "tensor_parallel/local_annotation.h"

#include <c10/util/intrusive_ptr.h>

#include <utility>

#include "absl/container/flat_hash_map.h"

namespace fsdp::tensor_parallel {

using ::fsdp::dtensor::DTensor;
namespace {

struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> tensor;
  LocalAnnotation annotation;
};

// Keyed by the TensorImpl address; the weak pointer tells a live tensor from a new one at
// a reused address. Pruned as it grows, so a forward's dead outputs do not accumulate.
absl::flat_hash_map<const c10::TensorImpl*, Entry>& Annotations() {
  thread_local absl::flat_hash_map<const c10::TensorImpl*, Entry> annotations;
  return annotations;
}

constexpr size_t kPruneAbove = 256;

}  // namespace

void AnnotateLocal(const at::Tensor& local, LocalAnnotation annotation) {
  TORCH_CHECK(local.defined(), "AnnotateLocal: the local tensor is undefined");
  auto& map = Annotations();
  if (map.size() >= kPruneAbove) {
    absl::erase_if(map, [](const auto& item) { return item.second.tensor.expired(); });
  }
  map.insert_or_assign(
      local.unsafeGetTensorImpl(),
      Entry{c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(local.getIntrusivePtr()),
            std::move(annotation)});
}

std::optional<LocalAnnotation> FindLocalAnnotation(const at::Tensor& local) {
  if (!local.defined()) return std::nullopt;
  auto& map = Annotations();
  const auto it = map.find(local.unsafeGetTensorImpl());
  if (it == map.end()) return std::nullopt;
  if (it->second.tensor.expired()) {
    map.erase(it);
    return std::nullopt;
  }
  return it->second.annotation;
}

std::optional<DTensor> AsDTensor(const at::Tensor& local) {
  auto annotation = FindLocalAnnotation(local);
  if (!annotation) return std::nullopt;
  return DTensor::FromSpec(local, std::move(annotation->spec));
}

}  // namespace fsdp::tensor_parallel
