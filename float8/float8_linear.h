// Float8 linear layers for training (torchao's torchao/float8/float8_linear.py and
// float8_linear_utils.py): convert_to_float8_training turns the Linears of a model into float8
// linears in place, whose three matmuls run on float8 operands through at::_scaled_mm while
// the parameters stay in high precision.
//
//   float8::convert_to_float8_training(*model, float8::Float8LinearConfig::FromRecipeName("rowwise"),
//                                      float8::FilterFqns({"output"}));
//   fsdp2::fully_shard(...);   // after converting, as torchtitan does
//
// The Linears must be fsdp::Hooked<torch::nn::LinearImpl> (the hooked-module layer's Linear):
// PyTorch swaps the module object; a C++ model's members are typed holders, so here each
// module keeps its type, parameters and FQNs and gets a Float8Linear forward replacement
// (fsdp/hooked_module/hooked_module.h). Optimizers, state dicts and checkpoints see the same
// parameters as before. Plain torch::nn::Linear modules cannot be converted (an error names
// them when the filter selects them).
//
// Thread-safety: converting is not; a converted forward is as thread-safe as Linear's.
#ifndef FSDP_FLOAT8_FLOAT8_LINEAR_H_
#define FSDP_FLOAT8_FLOAT8_LINEAR_H_

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "float8/config.h"
#include "fsdp/fsdp2/all_gather_extension.h"
#include "fsdp/hooked_module/hooked_module.h"

namespace fsdp::float8 {

class Float8WeightAllGather;

// The float8 forward of one Linear (torchao's Float8Linear.forward): output =
// matmul_with_hp_or_float8_args(input, weight^T) + bias, the backward's two matmuls in float8
// as the config says. With enable_fsdp_float8_all_gather it provides FSDP2 the weight's
// float8 all-gather extension and uses the float8 weight that all-gather produced.
class Float8Linear : public ForwardReplacement<at::Tensor, const at::Tensor&>,
                     public fsdp2::AllGatherExtensionProvider {
 public:
  // `linear` owns this replacement (set on it by convert_to_float8_training) and outlives it.
  Float8Linear(torch::nn::LinearImpl& linear, const Float8LinearConfig& config);
  at::Tensor Forward(const at::Tensor& input) override;
  std::shared_ptr<fsdp2::AllGatherExtension> all_gather_extension(const std::string& param_name) const override;

  const ResolvedFloat8Config& config() const { return config_; }
  // The weight's all-gather extension (null without enable_fsdp_float8_all_gather).
  const std::shared_ptr<Float8WeightAllGather>& weight_all_gather() const { return weight_all_gather_; }
  torch::nn::LinearImpl& linear() const { return linear_; }
  // torchao's extra_repr: "in_features=.., out_features=.., bias=.., cast_configs=i:..,w:..,go:..".
  std::string ToString() const;

 private:
  torch::nn::LinearImpl& linear_;
  ResolvedFloat8Config config_;
  std::shared_ptr<Float8WeightAllGather> weight_all_gather_;
};

// Which Linears to convert: the module and its FQN under the root ("" for the root).
using ModuleFilterFn = std::function<bool(const torch::nn::LinearImpl& linear, const std::string& fqn)>;

// torchtitan's module_filter_fn (torchtitan/components/quantization/utils.py): in_features and
// out_features multiples of 16 (float8 tensor cores need them) and no entry of `filter_fqns` a
// substring of the FQN.
ModuleFilterFn FilterFqns(std::vector<std::string> filter_fqns);

// torchao's _auto_filter_for_recipe (float8_linear_utils.py): FilterFqns plus the size
// thresholds below which float8 does not pay ("tensorwise": skips K <= 4096 and N <= 1024;
// "rowwise": skips N <= 2048, K <= 1024, or N <= 4096 and K <= 2048). Errors for other recipes.
ModuleFilterFn AutoFilterForRecipe(const std::string& recipe_name, std::vector<std::string> filter_fqns);

// Converts the Linears of `root`'s tree (root included) that `module_filter_fn` selects (all
// when null), visiting children before parents as torchao's swap_linear_layers. Returns how
// many it converted. Errors (nothing converted then): a selected Linear that is not a
// Hooked<LinearImpl>, one already converted, one already under fully_shard (convert first).
int convert_to_float8_training(torch::nn::Module& root, const Float8LinearConfig& config = {},
                               const ModuleFilterFn& module_filter_fn = nullptr);

// The float8 linear of `module`, or null when it was not converted.
std::shared_ptr<Float8Linear> AsFloat8Linear(torch::nn::Module& module);

}  // namespace fsdp::float8

#endif  // FSDP_FLOAT8_FLOAT8_LINEAR_H_
