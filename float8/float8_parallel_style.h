// torchao's float8 tensor-parallel styles (torchao/float8/float8_tensor_parallel.py): like
// ColwiseParallel, RowwiseParallel and PrepareModuleInput (tensor_parallel/parallel_style.h),
// but a float8 linear's input is cast to float8 before its all-gather, and its output gradient
// before the backward all-gather, so those collectives move float8 bytes (a quarter of
// float32's, half of bfloat16's) and each value is cast once.
//
//   float8::convert_to_float8_training(*block, Float8LinearConfig::FromRecipeName("tensorwise"));
//   tensor_parallel::parallelize_module(*block, tp_mesh, {
//       {"attention_norm", tensor_parallel::SequenceParallel()},
//       {"attention", float8::PrepareFloat8ModuleInput({.input_layouts = {Shard(1)},
//                                                       .desired_input_layouts = {Replicate()}})},
//       {"attention.wq", float8::Float8ColwiseParallel()}, ...,
//       {"attention.wo", float8::Float8RowwiseParallel({.output_layouts = Shard(1)})}});
//
// The scale of a sharded tensor is computed over all its shards (an all-reduce of MAX), so
// the float8 bits equal those of casting after a high-precision all-gather: the values are
// the generic styles' over float8 linears, only the bytes moved differ. As torchao, the casts
// are tensorwise with dynamic scales, unrounded (torchao's hp_tensor_to_float8_dynamic
// defaults): the input to float8_e4m3fn, the gradient to the linear's grad_output dtype.
//
// Contract: as the generic styles (parallel_style.h); Float8ColwiseParallel and
// Float8RowwiseParallel take only float8 linears (float8_linear.h) whose input and
// grad_output casts are dynamic and tensorwise (torchao: "this currently assumes tensorwise
// scaling"); PrepareFloat8ModuleInput takes a module with at least one float8 linear below it
// and float8_dtype float8_e4m3fn only. Errors (c10::Error) name the module's FQN and what is
// wrong; nothing is distributed then. A high-precision input that is Partial cannot be cast
// (the ranks' terms are not the value): an error at forward.
#ifndef FSDP_FLOAT8_FLOAT8_PARALLEL_STYLE_H_
#define FSDP_FLOAT8_FLOAT8_PARALLEL_STYLE_H_

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>
#include <vector>

#include "tensor_parallel/parallel_style.h"

namespace fsdp::float8 {

// `options.redistribution` must be null (the style provides its own).
tensor_parallel::ParallelStylePtr Float8ColwiseParallel(tensor_parallel::LinearStyleOptions options = {});
tensor_parallel::ParallelStylePtr Float8RowwiseParallel(tensor_parallel::LinearStyleOptions options = {});

struct PrepareFloat8ModuleInputOptions {
  std::vector<std::optional<dtensor::Placement>> input_layouts;
  std::vector<std::optional<dtensor::Placement>> desired_input_layouts;
  bool use_local_output = false;
  c10::ScalarType float8_dtype = c10::ScalarType::Float8_e4m3fn;
  // The float8 linear whose config the cast follows; unset: every float8 linear below the
  // module, which must agree.
  std::optional<std::string> fwd_config_submodule_fqn;
};
// PrepareModuleInput that casts each input it lays out to float8 first, so that several float8
// consumers of one activation (q, k and v) share one float8 all-gather.
tensor_parallel::ParallelStylePtr PrepareFloat8ModuleInput(PrepareFloat8ModuleInputOptions options);

}  // namespace fsdp::float8

#endif  // FSDP_FLOAT8_FLOAT8_PARALLEL_STYLE_H_
