#include "fsdp/fsdp2/meta_init.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <vector>

#include "absl/container/flat_hash_map.h"
#include "fsdp/fsdp2/fsdp_param.h"
#include "fsdp/fsdp2/state_dict.h"

namespace fsdp::fsdp2 {
namespace {

// An FSDP parameter whose full tensor is materialized until its last holder is initialized.
struct Pending {
  FSDPParam* param = nullptr;
  at::Tensor full;
  int holders_left = 0;
};

}  // namespace

void InitMetaParameters(torch::nn::Module& root, const ModuleInitFn& init_fn) {
  TORCH_CHECK(init_fn != nullptr, "InitMetaParameters: init_fn is empty");
  absl::flat_hash_map<const c10::TensorImpl*, FSDPParam*> fsdp_of;
  c10::Device device(c10::kCPU);
  bool have_device = false;
  for (const NamedParameter& p : NamedParameters(root)) {  // reshards every group
    if (p.fsdp_param == nullptr) continue;
    fsdp_of.emplace(p.param.unsafeGetTensorImpl(), p.fsdp_param);
    if (!have_device) device = p.fsdp_param->device(), have_device = true;
  }
  // How many modules hold each parameter directly (tied parameters: more than one).
  absl::flat_hash_map<const c10::TensorImpl*, int> holders;
  for (const auto& m : root.modules(/*include_self=*/true)) {
    for (const auto& p : m->parameters(/*recurse=*/false)) {
      if (p.defined()) ++holders[p.unsafeGetTensorImpl()];
    }
  }

  at::NoGradGuard no_grad;
  absl::flat_hash_map<const c10::TensorImpl*, Pending> pending;
  for (const auto& m : root.modules(/*include_self=*/true)) {
    std::vector<const c10::TensorImpl*> held;  // this module's pending FSDP parameters
    bool deferred = false;
    for (const auto& p : m->parameters(/*recurse=*/false)) {
      if (!p.defined()) continue;
      const c10::TensorImpl* impl = p.unsafeGetTensorImpl();
      auto fsdp = fsdp_of.find(impl);
      if (fsdp == fsdp_of.end()) {
        deferred |= MaterializeEmpty(p, device);
        continue;
      }
      FSDPParam* fp = fsdp->second;
      auto it = pending.find(impl);
      if (it == pending.end()) {
        if (!fp->needs_init()) continue;
        at::Tensor full =
            at::empty(fp->sharding_spec().shape, p.options().dtype(fp->orig_dtype()).device(fp->device()));
        p.set_data(full);
        it = pending.emplace(impl, Pending{fp, full, holders[impl]}).first;
      }
      held.push_back(impl);
      deferred = true;
    }
    for (const auto& b : m->buffers(/*recurse=*/false)) deferred |= MaterializeEmpty(b, device);
    if (!deferred) continue;
    init_fn(*m);
    for (const c10::TensorImpl* impl : held) {
      Pending& p = pending.at(impl);
      if (--p.holders_left > 0) continue;
      p.param->InitShard(LocalShardOf(*p.param, p.full));
      pending.erase(impl);
    }
  }
  TORCH_INTERNAL_ASSERT(pending.empty(), "InitMetaParameters: a tied parameter was not visited by all its holders");
}

}  // namespace fsdp::fsdp2
