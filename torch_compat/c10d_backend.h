// The flat-tensor collectives of a c10d::Backend under the names of the LibTorch being
// compiled against, and a copy of a backend's options for split().
//
// PyTorch 2.15 names them all_gather_single / reduce_scatter_single / all_to_all_single and
// keeps the old names (_allgather_base / _reduce_scatter_base / alltoall_base) as deprecated
// aliases that forward to them; 2.11 has only the old names. Each function calls the new
// name where the backend class declares it, else the old one (a requires-expression, so
// the choice follows the headers, not a version number).
// Contract: as the c10d method called; the tensors are passed by non-const reference
// because c10d takes them so. Errors: whatever the backend throws.
#pragma once

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdint>
#include <vector>

namespace fsdp::torch_compat {

template <class BackendT = c10d::Backend>
c10::intrusive_ptr<c10d::Work> AllGatherSingle(BackendT& backend, at::Tensor& output, at::Tensor& input) {
  if constexpr (requires { backend.all_gather_single(output, input); }) {
    return backend.all_gather_single(output, input);
  } else {
    return backend._allgather_base(output, input);
  }
}

template <class BackendT = c10d::Backend>
c10::intrusive_ptr<c10d::Work> ReduceScatterSingle(BackendT& backend, at::Tensor& output, at::Tensor& input,
                                                   const c10d::ReduceScatterOptions& options) {
  if constexpr (requires { backend.reduce_scatter_single(output, input, options); }) {
    return backend.reduce_scatter_single(output, input, options);
  } else {
    return backend._reduce_scatter_base(output, input, options);
  }
}

template <class BackendT = c10d::Backend>
c10::intrusive_ptr<c10d::Work> AllToAllSingle(BackendT& backend, at::Tensor& output, at::Tensor& input,
                                              std::vector<int64_t>& output_split_sizes,
                                              std::vector<int64_t>& input_split_sizes) {
  if constexpr (requires { backend.all_to_all_single(output, input, output_split_sizes, input_split_sizes); }) {
    return backend.all_to_all_single(output, input, output_split_sizes, input_split_sizes);
  } else {
    return backend.alltoall_base(output, input, output_split_sizes, input_split_sizes);
  }
}

// An independent copy of a backend's options, of their concrete type, for split(): split
// implementations mutate the options they are given (group name, global ranks, ...), and
// getBackendOptions() returns the parent's live object, so passing it on would change the
// parent (PyTorch 2.15's ProcessGroup::splitGroup clones for the same reason). 2.15 has
// Options::clone(); before it, the Gloo options are copied by type, and any other type is
// shared, as splitGroup falls back to sharing when a clone would slice.
template <class OptionsT = c10d::Backend::Options>
c10::intrusive_ptr<OptionsT> CloneBackendOptions(const c10::intrusive_ptr<OptionsT>& options) {
  if (!options) return options;
  if constexpr (requires { options->clone(); }) {
    return options->clone();
  } else {
    if (auto gloo = c10::dynamic_intrusive_pointer_cast<c10d::ProcessGroupGloo::Options>(options)) {
      return c10::make_intrusive<c10d::ProcessGroupGloo::Options>(*gloo);
    }
    return options;
  }
}

}  // namespace fsdp::torch_compat
