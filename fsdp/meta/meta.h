// Building models larger than one rank: parameters and buffers on the meta device (shapes and
// dtypes, no storage), for both FSDPs' deferred init (fsdp/fsdp2/meta_init.h,
// fsdp/fsdp1/fsdp_options.h's param_init_fn).
//
// LibTorch has no `with torch.device("meta")`: a module's constructor allocates and
// initializes its parameters where it is built. So build a large model piece by piece and
// move each piece to the meta device as soon as it exists; peak memory is then one piece:
//
//   auto model = std::make_shared<fsdp::HookedImpl<NetImpl>>(/*n_blocks=*/0);
//   for (int i = 0; i < n; ++i) model->blocks->push_back(fsdp::MakeOnMeta<Block>(dim));
//
// Contract:
//  * ToMeta(module) replaces the data of every parameter and buffer of `module` and its
//    submodules by a meta tensor of the same shape, dtype and requires_grad, in place: the
//    tensors keep their identity (modules, optimizers and tied references still see them)
//    and their old storage is freed when nothing else holds it. Gradients are dropped.
//  * ReplaceData(t, data) is t.set_data(data) that also moves to or from the meta device.
//  * MaterializeEmpty(t, device) gives a meta tensor storage on `device` in place
//    (uninitialized, same shape and dtype); other tensors are left alone. Returns whether
//    it allocated.
//  * FindMetaTensor(module) names the first parameter or buffer still on the meta device
//    (its FQN relative to `module`), or returns nullopt.
//  Not thread-safe: one thread per module tree.
#ifndef FSDP_FSDP_META_META_H_
#define FSDP_FSDP_META_META_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <string>
#include <utility>

namespace torch::nn {
class Module;
}

namespace fsdp {

void ToMeta(torch::nn::Module& module);

// tensor.set_data(data), also between the meta device and a real one (which set_data itself
// refuses): `tensor` keeps its identity and takes data's storage, shape, dtype and device.
void ReplaceData(const at::Tensor& tensor, const at::Tensor& data);

// Builds a `Holder` (a torch::nn::ModuleHolder such as fsdp::Hooked<BlockImpl> or
// torch::nn::Linear) from `args` and moves it to the meta device before returning.
template <class Holder, class... Args>
Holder MakeOnMeta(Args&&... args) {
  Holder holder(std::forward<Args>(args)...);
  ToMeta(*holder);
  return holder;
}

bool MaterializeEmpty(const at::Tensor& tensor, c10::Device device);

std::optional<std::string> FindMetaTensor(const torch::nn::Module& module);

}  // namespace fsdp

#endif  // FSDP_FSDP_META_META_H_
