// The DTensor layout of a module's local output: how a parallel style with
// use_local_output = false hands a DTensor to the next style (and to the user) through a
// forward that returns at::Tensor.
//
// Contract: an annotation lives as long as its tensor (weakly held) and only on the thread
// that made it (each rank's forward runs on one thread; the ranks of the threaded backend
// are threads, and must not see each other's). Not an owner of anything.
#ifndef FSDP_TENSOR_PARALLEL_LOCAL_ANNOTATION_H_
#define FSDP_TENSOR_PARALLEL_LOCAL_ANNOTATION_H_

#include <ATen/core/Tensor.h>

#include <optional>

#include "dtensor/dtensor.h"
#include "dtensor/dtensor_spec.h"
#include "dtensor/placement.h"

namespace fsdp::tensor_parallel {

struct LocalAnnotation {
  dtensor::DTensorSpec spec;            // the layout of the local tensor
  dtensor::Placements grad_placements;  // the layout its consumers deliver the gradient in
};

// Records `annotation` for `local` (replacing an earlier one).
void AnnotateLocal(const at::Tensor& local, LocalAnnotation annotation);
// The annotation of exactly this tensor (not of a view or a result computed from it).
std::optional<LocalAnnotation> FindLocalAnnotation(const at::Tensor& local);
// The DTensor a style returned as `local` (use_local_output = false), or nullopt.
std::optional<dtensor::DTensor> AsDTensor(const at::Tensor& local);

}  // namespace fsdp::tensor_parallel

#endif  // FSDP_TENSOR_PARALLEL_LOCAL_ANNOTATION_H_
