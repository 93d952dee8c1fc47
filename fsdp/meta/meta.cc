#include "fsdp/meta/meta.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <mutex>
#include <typeinfo>

namespace fsdp {
namespace {

// TensorImpl::shallow_copy_from takes a c10::intrusive_ptr<TensorImpl>, a Tensor holds one
// with UndefinedTensorImpl as its null type: converting copies it (an atomic increment and
// decrement, 8 per fully_shard'ed Linear per step). This borrows the pointer instead, the way
// c10::MaybeOwnedTraits<intrusive_ptr> borrows (reclaim, then release without a decrement);
// the caller's tensor keeps it alive throughout.
class BorrowedImpl {
 public:
  explicit BorrowedImpl(c10::TensorImpl* impl) : ptr_(c10::intrusive_ptr<c10::TensorImpl>::reclaim(impl)) {}
  ~BorrowedImpl() { (void)ptr_.release(); }
  BorrowedImpl(const BorrowedImpl&) = delete;
  BorrowedImpl& operator=(const BorrowedImpl&) = delete;
  const c10::intrusive_ptr<c10::TensorImpl>& get() const { return ptr_; }

 private:
  c10::intrusive_ptr<c10::TensorImpl> ptr_;
};

}  // namespace

void ReplaceData(const at::Tensor& tensor, const at::Tensor& data) {
  c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  if (impl->has_compatible_shallow_copy_type(data.key_set())) {
    if (data.dtype() == tensor.dtype() && data.device() == tensor.device()) {
      // What set_data ends with (torch/csrc/autograd/variable.cpp, VariableHooks::set_data),
      // without the dispatcher (4 calls per FSDP2 parameter and step; see
      // docs/design/measured-choices.md): with dtype and device unchanged it keeps the
      // gradient accumulator and its checks hold.
      impl->shallow_copy_from(BorrowedImpl(data.unsafeGetTensorImpl()).get());
    } else {
      tensor.set_data(data);
    }
    return;
  }
  // set_data refuses a move between the meta device and a real one: its
  // _has_compatible_shallow_copy_type does not count Meta as dense. Both are plain strided
  // TensorImpls, so the shallow copy set_data would do is sound; Python's Module._apply
  // swaps in a new Parameter instead, but C++ modules hold their tensors in members, so the
  // TensorImpl must stay.
  const auto plain = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && !t.is_quantized() &&
           typeid(*t.unsafeGetTensorImpl()) == typeid(c10::TensorImpl);
  };
  TORCH_CHECK((tensor.is_meta() || data.is_meta()) && plain(tensor) && plain(data),
              "ReplaceData: cannot give a tensor with keys ", tensor.key_set(), " the data of one with keys ",
              data.key_set());
  if (torch::autograd::AutogradMeta* meta = torch::autograd::impl::get_autograd_meta(tensor)) {
    std::lock_guard<std::mutex> lock(meta->mutex_);
    meta->grad_accumulator_.reset();  // bound to the old device (as set_data resets it)
  }
  impl->shallow_copy_from(data.getIntrusivePtr());
}

void ToMeta(torch::nn::Module& module) {
  at::NoGradGuard no_grad;
  const auto to_meta = [](const at::Tensor& t) {
    if (!t.defined() || t.is_meta()) return;
    // set_data keeps the tensor (and its requires_grad) and swaps what it points at.
    ReplaceData(t, at::empty(t.sizes(), t.options().device(c10::kMeta)));
    if (t.grad().defined()) t.mutable_grad() = at::Tensor();
  };
  for (const auto& p : module.parameters(/*recurse=*/true)) to_meta(p);
  for (const auto& b : module.buffers(/*recurse=*/true)) to_meta(b);
}

bool MaterializeEmpty(const at::Tensor& tensor, c10::Device device) {
  if (!tensor.defined() || !tensor.is_meta()) return false;
  at::NoGradGuard no_grad;
  ReplaceData(tensor, at::empty(tensor.sizes(), tensor.options().device(device)));
  return true;
}

std::optional<std::string> FindMetaTensor(const torch::nn::Module& module) {
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (item.value().defined() && item.value().is_meta()) return item.key();
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    if (item.value().defined() && item.value().is_meta()) return item.key();
  }
  return std::nullopt;
}

}  // namespace fsdp
