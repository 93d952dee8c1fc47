// FlatParamHandle's gradient path: flatten the originals' gradients, reduce-scatter with the
// PyTorch's divide factors, sharded / unsharded gradient views.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/work.h"
#include "device/stream.h"
#include "fsdp/common/grad_divide.h"
#include "fsdp/common/storage.h"
#include "fsdp/fsdp1/flat_param.h"

namespace fsdp::fsdp1 {
namespace {

// The same memory as `view` without being an autograd view: optimizers (LibTorch's
// zero_grad) detach_() gradients, which views refuse. A contiguous one is AliasStorage's
// (no dispatcher); other strides take set_.
at::Tensor AliasWithoutView(const at::Tensor& view) {
  if (view.is_contiguous()) return AliasStorage(view, view.storage_offset(), view.sizes());
  at::Tensor t = at::empty({0}, view.options());
  t.set_(view.storage(), view.storage_offset(), view.sizes(), view.strides());
  return t;
}

// `t` cast to `dtype` by work on `stream`: the host allocates the result now.
at::Tensor CastOn(device::Stream& stream, const at::Tensor& t, c10::ScalarType dtype) {
  at::Tensor out = at::empty(t.sizes(), t.options().dtype(dtype));
  stream.Launch([out, t] { out.copy_(t); });
  return out;
}

}  // namespace

bool FlatParamHandle::FlattenOrigGrads() {
  at::NoGradGuard no_grad;
  FlatParameter& fp = flat_param_;
  CheckUnsharded(fp.param);
  at::Tensor first;
  for (const at::Tensor& t : orig_tensors_) {
    if (t.grad().defined()) {
      first = t.grad();
      break;
    }
  }
  if (!first.defined()) return false;
  at::Tensor flat_grad = fp.param.grad();
  const bool fresh = !flat_grad.defined();
  // A fresh flat gradient on the CPU without alignment padding is written slice by slice
  // (each gradient copied, zeros where a parameter has none) instead of zeroed first.
  const bool fill = fresh && first.is_cpu() && aligned_numel_ == 0;
  if (fresh) {
    flat_grad = fill ? EmptyBuffer(fp.unpadded_unsharded_size, first.options())
                     : at::zeros(fp.unpadded_unsharded_size, first.options());
  } else {
    CheckUnsharded(flat_grad);
  }
  std::vector<at::Tensor> views = UnflatAliases(flat_grad);
  for (int64_t i = 0; i < fp.num_params; ++i) {
    at::Tensor& t = orig_tensors_[i];
    const at::Tensor g = t.grad();
    if (!g.defined()) {
      if (fill && views[i].nbytes() > 0) std::memset(views[i].data_ptr(), 0, views[i].nbytes());
      continue;
    }
    if (!SameStorage(g, flat_grad)) {  // an unsharded gradient view is already in place
      TORCH_CHECK(g.sizes() == views[i].sizes(), "FlattenOrigGrads: gradient of ", fp.fqns[i], " has shape ",
                  c10::str(c10::IntArrayRef(g.sizes())), " but the unsharded parameter has shape ",
                  c10::str(c10::IntArrayRef(views[i].sizes())));
      // Into a fresh flat gradient, a copy: what autograd's cat of the views' gradients
      // gives PyTorch's flat_param.grad (it keeps -0.0, which 0 + g would not).
      if (fresh && g.is_cpu() && g.is_contiguous() && views[i].is_contiguous() && g.dtype() == flat_grad.dtype()) {
        if (g.nbytes() > 0) std::memcpy(views[i].data_ptr(), g.data_ptr(), g.nbytes());
      } else if (fresh) {
        views[i].copy_(g);
      } else {
        views[i].add_(g);
      }
    }
    t.mutable_grad() = at::Tensor();
    if (options_.use_orig_params && t.requires_grad()) fp.is_grad_none_mask[i] = false;
  }
  fp.param.mutable_grad() = flat_grad;
  return true;
}

at::Tensor FlatParamHandle::ReduceScatterGrad(const comm::ProcessGroupPtr& inter_node_group,
                                              const CommHook& comm_hook) {
  at::NoGradGuard no_grad;
  FlatParameter& fp = flat_param_;
  at::Tensor grad = fp.param.grad();
  TORCH_CHECK(grad.defined(), "ReduceScatterGrad: flat_param.grad is undefined (FlattenOrigGrads found no gradient)");
  TORCH_CHECK(!grad.requires_grad(), "FSDP does not support gradients of gradients");
  TORCH_CHECK(IsHybrid(options_.sharding_strategy) == (inter_node_group != nullptr),
              "ReduceScatterGrad: inter_node_group must be given exactly for hybrid strategies, but the strategy is ",
              ToString(options_.sharding_strategy), " and inter_node_group is ", inter_node_group ? "set" : "null");
  TORCH_CHECK(!(comm_hook && inter_node_group), "ReduceScatterGrad: communication hooks are not supported for ",
              ToString(options_.sharding_strategy));
  CheckUnsharded(grad);
  fp.post_backward_called = true;
  // PyTorch's post-backward stream: everything below is launched there after the compute
  // stream's work so far (which produced the gradient); the host only allocates and assigns.
  const FlatParamStreams& s = streams();
  device::Stream& stream = *s.post_backward;
  stream.WaitStream(*s.current);
  if (grad.scalar_type() != reduce_dtype_ && !force_full_precision()) grad = CastOn(stream, grad, reduce_dtype_);
  const double data_parallel_size =
      static_cast<double>(world_size_ * (inter_node_group ? inter_node_group->size() : 1));
  const double predivide = GradientPredivideFactor(data_parallel_size);
  const double postdivide = data_parallel_size / predivide;
  const comm::ProcessGroupPtr& group = options_.process_group;
  // A communication hook fills its output synchronously, issuing its own collectives: it runs
  // in one collective's turn so that they stay in this rank's program order.
  auto launch_hook = [&](const at::Tensor& input, const at::Tensor& output) {
    LaunchCollective(s, stream, [hook = comm_hook, group, input, output] {
      hook(group, input, output);
      return comm::MakeCompletedWork("FSDP communication hook");
    });
  };
  device::Stream* last = &stream;  // where the reduction's last step runs
  at::Tensor grad_to_offload;
  if (uses_sharded_strategy()) {
    // _get_reduce_scatter_tensors: pad to world_size * chunks[0].numel().
    fp.param.mutable_grad() = at::Tensor();
    const int64_t chunk = (grad.numel() + world_size_ - 1) / world_size_;
    const int64_t numel_to_pad = world_size_ * chunk - grad.numel();
    at::Tensor padded = grad;
    if (numel_to_pad > 0) {
      padded = EmptyBuffer({world_size_ * chunk}, grad.options());
      stream.Launch([padded, grad] {
        padded.narrow(0, 0, grad.numel()).copy_(grad);
        padded.narrow(0, grad.numel(), padded.numel() - grad.numel()).zero_();
      });
    }
    at::Tensor new_sharded_grad = EmptyBuffer({chunk}, padded.options());
    if (comm_hook) {
      launch_hook(padded, new_sharded_grad);
    } else {
      if (predivide > 1) stream.Launch([padded, predivide] { DivideInPlace(padded, predivide); });
      LaunchCollective(s, stream, [group, new_sharded_grad, padded] {
        return group->reduce_scatter_tensor(new_sharded_grad, padded, comm::ReduceOp::Sum());
      });
      if (inter_node_group) {
        // PyTorch's all-reduce stream: the next handle's reduce-scatter need not wait for it.
        s.all_reduce->WaitStream(stream);
        last = s.all_reduce;
        LaunchCollective(s, *last, [inter_node_group, new_sharded_grad] {
          return inter_node_group->all_reduce(new_sharded_grad, comm::ReduceOp::Sum());
        });
      }
      if (postdivide > 1) last->Launch([new_sharded_grad, postdivide] { DivideInPlace(new_sharded_grad, postdivide); });
    }
    // _accumulate_sharded_grad, after _cast_grad_to_param_dtype (the sharded parameter's dtype).
    if (new_sharded_grad.scalar_type() != orig_param_dtype_) {
      new_sharded_grad = CastOn(*last, new_sharded_grad, orig_param_dtype_);
    }
    if (fp.saved_grad_shard.defined()) {
      TORCH_CHECK(fp.saved_grad_shard.sizes() == new_sharded_grad.sizes(),
                  "Shape mismatch when accumulating gradients: existing gradient shape=",
                  c10::str(c10::IntArrayRef(fp.saved_grad_shard.sizes())),
                  " new gradient shape=", c10::str(c10::IntArrayRef(new_sharded_grad.sizes())));
      TORCH_CHECK(fp.saved_grad_shard.device() == new_sharded_grad.device(),
                  "Device mismatch when accumulating gradients: existing gradient device=",
                  fp.saved_grad_shard.device(), " new gradient device=", new_sharded_grad.device());
      last->Launch([saved = fp.saved_grad_shard, new_sharded_grad] { saved.add_(new_sharded_grad); });
    } else {
      fp.saved_grad_shard = new_sharded_grad;
    }
    grad_to_offload = fp.saved_grad_shard;
  } else {
    if (comm_hook) {
      launch_hook(grad, at::Tensor());
    } else {
      if (predivide > 1) stream.Launch([grad, predivide] { DivideInPlace(grad, predivide); });
      LaunchCollective(s, stream, [group, grad] { return group->all_reduce(grad, comm::ReduceOp::Sum()); });
      if (postdivide > 1) stream.Launch([grad, postdivide] { DivideInPlace(grad, postdivide); });
    }
    // NO_SHARD keeps low precision gradients by omitting the cast.
    if (!options_.keep_low_precision_grads && grad.scalar_type() != orig_param_dtype_) {
      grad = CastOn(stream, grad, orig_param_dtype_);
    }
    fp.param.mutable_grad() = grad;
    grad_to_offload = grad;
  }
  if (options_.offload_params) {
    last->Launch([cpu_grad = fp.cpu_grad, grad_to_offload] { cpu_grad.copy_(grad_to_offload); });
  }
  // Used alone: the results are in place on return.
  if (streams_ == nullptr) s.current->WaitStream(*last);
  return grad_to_offload;
}

void FlatParamHandle::PrepareGradientForBackward() {
  TORCH_CHECK(training_state_ == HandleTrainingState::BACKWARD_PRE || training_state_ == HandleTrainingState::IDLE,
              "Expects to be in `BACKWARD_PRE` or `IDLE` (if prefetching) but got ", ToString(training_state_));
  at::NoGradGuard no_grad;
  FlatParameter& fp = flat_param_;
  const at::Tensor grad = fp.param.grad();
  if (grad.defined() &&
      (grad.sizes() != c10::IntArrayRef(fp.unpadded_unsharded_size) || grad.device() != fp.param.device())) {
    CheckOnComputeDevice(fp.param);
    const bool grad_offloaded = grad.device() != options_.device;
    TORCH_CHECK(!grad_offloaded || options_.offload_params, "Expects the sharded gradient to be on ", options_.device,
                " but got ", grad.device());
    const bool prev_iter_synced_gradients = grad.sizes() == fp.local_shard.sizes();
    if (prev_iter_synced_gradients) {
      at::Tensor* sharded_grad = nullptr;
      if (!grad_offloaded) {
        fp.saved_grad_shard = grad;
        sharded_grad = &fp.saved_grad_shard;
      } else {
        TORCH_CHECK(fp.cpu_grad.defined(), "`_cpu_grad` should be defined if the gradient is on CPU");
        sharded_grad = &fp.cpu_grad;
      }
      // Low precision gradients kept from the last step accumulate in full precision.
      const c10::ScalarType local_shard_dtype = fp.local_shard.scalar_type();
      if (options_.keep_low_precision_grads && sharded_grad->scalar_type() != local_shard_dtype) {
        *sharded_grad = sharded_grad->to(local_shard_dtype);
      }
    } else {
      TORCH_CHECK(grad.sizes() == c10::IntArrayRef(fp.padded_unsharded_size),
                  "Expects `.grad` to be the unsharded gradient in `no_sync()` with size ",
                  c10::str(c10::IntArrayRef(fp.padded_unsharded_size)), " but got size ",
                  c10::str(c10::IntArrayRef(grad.sizes())));
    }
    fp.param.mutable_grad() = at::Tensor();
  }
  // C++: autograd accumulates into the originals, so they must not hold the sharded gradient
  // views the optimizer saw: unsharded views of an accumulated (no_sync) gradient, or none.
  if (fp.param.grad().defined()) {
    UseUnshardedGradViews();
  } else {
    for (at::Tensor& t : orig_tensors_) t.mutable_grad() = at::Tensor();
  }
}

void FlatParamHandle::ResetFlatParamGradInfoIfNeeded() {
  if (!options_.use_orig_params) return;
  FlatParameter& fp = flat_param_;
  bool all_grad_none = true;
  bool requires_grad = false;
  for (const at::Tensor& p : fp.params) {
    all_grad_none = all_grad_none && !p.grad().defined();
    requires_grad = requires_grad || p.requires_grad();
  }
  if (all_grad_none) {
    fp.param.mutable_grad() = at::Tensor();
    // Also mark them none: with CPU offloading the sharded gradient views are taken from
    // cpu_grad, which still holds the last step's gradient (PyTorch would re-expose it after
    // the post-forward reshard and write it back as an accumulated gradient).
    fp.is_grad_none_mask.assign(fp.num_params, true);
  }
  // As long as one parameter requires gradient, the flat parameter must.
  fp.param.set_requires_grad(requires_grad);
}

void FlatParamHandle::ResetIsGradNone() {
  if (!options_.use_orig_params) return;
  TORCH_CHECK(training_state_ == HandleTrainingState::BACKWARD_POST,
              "Expects to only be called in the post-backward after gradient computation (state: ",
              ToString(training_state_), ")");
  FlatParameter& fp = flat_param_;
  for (int64_t i = 0; i < fp.num_params; ++i) {
    if (fp.params[i].requires_grad()) fp.is_grad_none_mask[i] = false;
  }
}

void FlatParamHandle::PrepareGradientForOptim() {
  at::NoGradGuard no_grad;
  FlatParameter& fp = flat_param_;
  auto cast_grad_to_param_dtype_if_needed = [&] {
    if (!force_full_precision() && options_.keep_low_precision_grads) {
      TORCH_CHECK(fp.param.grad().defined(), "Unexpected None grad!");
      if (fp.param.grad().scalar_type() != fwd_bwd_param_dtype_) {
        fp.param.mutable_grad() = fp.param.grad().to(fwd_bwd_param_dtype_);
        if (options_.use_orig_params) UseShardedGradViews();
      }
    }
  };
  if (fp.cpu_grad.defined()) {
    CheckSharded(fp.param);
    fp.param.mutable_grad() = fp.cpu_grad;
    cast_grad_to_param_dtype_if_needed();
  } else if (fp.saved_grad_shard.defined()) {
    CheckSharded(fp.param);
    CheckOnComputeDevice(fp.param);
    if (fp.post_backward_called) {
      fp.param.mutable_grad() = fp.saved_grad_shard;
      cast_grad_to_param_dtype_if_needed();
    }
  } else {
    TORCH_CHECK(!uses_sharded_strategy() || !fp.post_backward_called,
                "All sharded parameters that received a gradient in the post-backward should use "
                "`_saved_grad_shard`");
  }
  fp.saved_grad_shard = at::Tensor();
}

at::Tensor FlatParamHandle::sharded_grad() const {
  const FlatParameter& fp = flat_param_;
  if (fp.cpu_grad.defined()) return fp.cpu_grad;
  if (fp.saved_grad_shard.defined()) return fp.saved_grad_shard;
  TORCH_CHECK(!fp.param.grad().defined() || !uses_sharded_strategy() ||
                  training_state_ == HandleTrainingState::FORWARD || training_state_ == HandleTrainingState::IDLE,
              "Sharded strategies should use `_cpu_grad` or `_saved_grad_shard` unless in IDLE or FORWARD (state: ",
              ToString(training_state_), ")");
  return fp.param.grad();
}

void FlatParamHandle::UseShardedGradViews() {
  at::NoGradGuard no_grad;
  TORCH_CHECK(options_.use_orig_params, "UseShardedGradViews requires use_orig_params");
  FlatParameter& fp = flat_param_;
  CheckSharded(fp.param);
  const at::Tensor grad = sharded_grad();
  if (!grad.defined()) {
    for (at::Tensor& p : fp.params) p.mutable_grad() = at::Tensor();
    return;
  }
  CheckSharded(grad);
  for (int64_t i = 0; i < fp.num_params; ++i) {
    at::Tensor& p = fp.params[i];
    const ShardParamInfo& info = fp.shard_param_infos[i];
    if (info.in_shard && p.requires_grad() && !fp.is_grad_none_mask[i]) {
      p.mutable_grad() = AliasWithoutView(grad.narrow(0, info.offset_in_shard, info.numel_in_shard).view(p.sizes()));
    } else {
      p.mutable_grad() = at::Tensor();
    }
  }
}

void FlatParamHandle::UseUnshardedGradViews() {
  at::NoGradGuard no_grad;
  FlatParameter& fp = flat_param_;
  const at::Tensor grad = fp.param.grad();
  if (!grad.defined()) {
    for (at::Tensor& p : orig_tensors_) p.mutable_grad() = at::Tensor();
    return;
  }
  CheckUnsharded(grad);
  // Aliases already where the flat gradient is contiguous; views (other strides) get one.
  std::vector<at::Tensor> slices = UnflatAliases(grad);
  for (int64_t i = 0; i < fp.num_params; ++i) {
    orig_tensors_[i].mutable_grad() = slices[i].is_view() ? AliasWithoutView(slices[i]) : slices[i];
  }
}

}  // namespace fsdp::fsdp1
