// FSDP2's float8 all-gather of float8 linears' weights (torchao's torchao/float8/fsdp_utils.py:
// WeightWithDynamicFloat8CastTensor's fsdp_pre_all_gather / fsdp_post_all_gather, and
// precompute_float8_dynamic_scale_for_fsdp).
//
// With Float8LinearConfig::enable_fsdp_float8_all_gather, convert_to_float8_training gives each
// converted weight a Float8WeightAllGather, which fully_shard finds (the float8 linear is the
// module's AllGatherExtensionProvider). Each unshard then casts this rank's shard to float8 with
// the weight's tensorwise scale and all-gathers the float8 bytes: half of bfloat16's, a quarter
// of float32's. No high-precision unsharded weight exists: while unsharded the parameter is a
// placeholder (AllGatherExtension's contract; its one element is NaN, so a read of it shows),
// and the float8 linear's forward takes the gathered float8 weight and its scale from here.
// The same bits as torchao casting the unsharded weight with the same scale.
//
// The scale: the weight's amax over all its shards, either all-reduced inside each unshard
// (one small all-reduce per weight per all-gather), or once per step for all weights by
// precompute_float8_dynamic_scale_for_fsdp after the optimizer step, which the unshards then
// use until the next precompute (torchao's semantics: call it after every optimizer step).
//
//   convert_to_float8_training(*model, {.enable_fsdp_float8_all_gather = true});
//   ... fully_shard ...; loop { forward; backward; optimizer.step();
//                               precompute_float8_dynamic_scale_for_fsdp(*model); }
//
// Thread-safety: as FSDP's unshard. Errors: c10::Error naming the weight.
#ifndef FSDP_FLOAT8_FSDP_FLOAT8_H_
#define FSDP_FLOAT8_FSDP_FLOAT8_H_

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <optional>
#include <vector>

#include "float8/float8_tensor.h"
#include "fsdp/fsdp2/all_gather_extension.h"

namespace fsdp::float8 {

class Float8WeightAllGather : public fsdp2::AllGatherExtension {
 public:
  explicit Float8WeightAllGather(c10::ScalarType float8_dtype) : float8_dtype_(float8_dtype) {}

  // The shard cast with the precomputed scale, else with one computed from the amax
  // all-reduced (MAX) over the shard mesh dim. Inputs: the float8 shard; metadata: the scale.
  PreAllGatherResult PreAllGather(const at::Tensor& sharded_param, const mesh::DeviceMesh& shard_mesh,
                                  const std::vector<int64_t>& orig_size,
                                  const MixedPrecisionPolicy& mp_policy) override;
  // Keeps the gathered float8 weight (a view of FSDP's all-gather output) and its scale;
  // returns the placeholder.
  at::Tensor PostAllGather(const std::vector<at::Tensor>& outputs, const c10::IValue& metadata,
                           c10::ScalarType param_dtype, const at::Tensor& out) override;

  // The float8 weight of the last all-gather if `weight` is its placeholder (the parameter is
  // unsharded), else nullopt (not sharded by FSDP, or sharded now).
  std::optional<Float8Tensor> Gathered(const at::Tensor& weight) const;

  // The scale the next unshards use (0-D float32), from precompute_float8_dynamic_scale_for_fsdp.
  void set_precomputed_scale(at::Tensor scale) { precomputed_scale_ = std::move(scale); }
  const at::Tensor& precomputed_scale() const { return precomputed_scale_; }
  c10::ScalarType float8_dtype() const { return float8_dtype_; }

 private:
  c10::ScalarType float8_dtype_;
  at::Tensor precomputed_scale_;
  at::Tensor gathered_data_;   // [out, in] float8, aliasing FSDP's all-gather output
  at::Tensor gathered_scale_;  // 0-D float32
  at::Tensor placeholder_;     // the unsharded parameter's data: one NaN, expanded
  std::vector<int64_t> orig_size_;
};

// Computes the tensorwise scale of every float8-all-gathered weight in root's tree with one
// all-reduce per sharded mesh dim (MAX of the stacked local amaxes over the weights' FSDP mesh
// and their tensor-parallel dim), for the next unshards. Call after the optimizer step, between
// steps. Errors: a converted weight no fully_shard manages, weights of different float8 dtypes.
void precompute_float8_dynamic_scale_for_fsdp(torch::nn::Module& root);

}  // namespace fsdp::float8

#endif  // FSDP_FLOAT8_FSDP_FLOAT8_H_
