// clip_grad_norm_ over FSDP2's sharded gradients (see the header for the design and how it
// relates to PyTorch 2.15's torch/nn/utils/clip_grad.py and DTensor's _NormPartial in
// torch/distributed/tensor/_ops/_math_ops.py).
#include "fsdp/fsdp2/clip_grad_norm.h"

#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "comm/process_group.h"
#include "distributed_parameters/distributed_parameters.h"
#include "dtensor/dtensor_spec.h"
#include "fsdp/common/nonfinite.h"
#include "fsdp/fsdp2/fsdp_param.h"
#include "fsdp/fsdp2/fsdp_state.h"

namespace fsdp::fsdp2 {
namespace {

constexpr const char* kCaller = "clip_grad_norm_";

// One parameter to clip: FSDP's (sharded gradient), a tensor-parallel one no fully_shard
// manages (its local gradient, laid out by its module's spec), or a whole one.
struct Target {
  at::Tensor param;
  FSDPParam* fsdp_param = nullptr;
  const dtensor::DTensorSpec* tp_spec = nullptr;
  std::string name;  // its first FQN under the root, for errors
};

// The gradients whose norms reduce over the same process groups, and the value to reduce:
// sum |g|^p over this rank's elements (p finite) or max |g| (p = inf), as a 0-d tensor.
struct Layout {
  std::vector<comm::ProcessGroupPtr> groups;    // the sharding mesh dims' groups, mesh-dim order
  c10::Device device = c10::Device(c10::kCPU);  // where its collectives run (FSDP's compute device)
  std::vector<at::Tensor> grads;
  at::Tensor value;
};

void CheckArguments(double max_norm, double norm_type) {
  // PyTorch checks neither: a negative max_norm flips the gradients' sign and a NaN one
  // turns them into NaN; norm types <= 0 are not norms a total can be clipped by (p = 0
  // counts nonzeros, -inf is the min), and the reduction below assumes |g|^p grows with |g|.
  TORCH_CHECK(!std::isnan(max_norm) && max_norm >= 0, kCaller, ": max_norm must be >= 0 (inf: no clipping), got ",
              max_norm);
  TORCH_CHECK(norm_type > 0, kCaller, ": norm_type must be > 0 or inf, got ", norm_type);  // NaN fails too
}

// The FSDPParam managing each parameter tensor of root's tree. Every group must be idle:
// inside forward/backward the sharded gradients are not final (and a group's unsharded
// gradient may still be waiting for its reduce-scatter).
absl::flat_hash_map<const c10::TensorImpl*, FSDPParam*> ManagedParams(torch::nn::Module& root) {
  absl::flat_hash_map<const c10::TensorImpl*, FSDPParam*> by_impl;
  for (FSDPState* s : CollectStates(root)) {
    s->CheckNotPoisoned(kCaller);
    FSDPParamGroup* g = s->param_group();
    if (g == nullptr) continue;
    TORCH_CHECK(g->training_state() == TrainingState::kIdle, kCaller, ": the FSDP group of '", g->module_fqn(),
                "' is in training state ", ToString(g->training_state()),
                "; clip gradients after backward, before the optimizer step");
    for (const auto& p : g->fsdp_params()) by_impl.emplace(p->param().unsafeGetTensorImpl(), p.get());
  }
  return by_impl;
}

// The parameters' layouts: FSDP's (which include a TP layout under fully_shard), then the
// tensor-parallel specs of parameters no fully_shard manages.
struct Layouts {
  absl::flat_hash_map<const c10::TensorImpl*, FSDPParam*> managed;
  absl::flat_hash_map<const c10::TensorImpl*, dtensor::DTensorSpec> tp;
};

Target MakeTarget(const Layouts& layouts, const at::Tensor& t) {
  if (auto it = layouts.managed.find(t.unsafeGetTensorImpl()); it != layouts.managed.end()) return {t, it->second};
  if (auto it = layouts.tp.find(t.unsafeGetTensorImpl()); it != layouts.tp.end()) return {t, nullptr, &it->second};
  return {t};
}

// The gradient to clip: FSDP's sharded gradient (wherever the runtime keeps it: param.grad()
// while sharded, stashed while the group stays unsharded after backward), else param.grad().
at::Tensor GradOf(const Target& t) {
  if (t.fsdp_param == nullptr) return t.param.grad();
  at::Tensor g = t.fsdp_param->sharded_grad();
  // The sharded gradient is this rank's real rows (FSDPParam::AdoptShardedGrad): padding
  // rows would be zeros for the norm but a wrong shape to clip, so insist.
  TORCH_CHECK(!g.defined() || g.sizes() == c10::IntArrayRef(t.fsdp_param->sharded_size()), kCaller,
              ": the sharded gradient of '", t.fsdp_param->fqn(), "' has shape ", c10::str(c10::IntArrayRef(g.sizes())),
              " but the shard has ", c10::str(c10::IntArrayRef(t.fsdp_param->sharded_size())));
  return g;
}

// The dtype the parameter's gradient has: FSDP's sharded gradient is in the original dtype
// even while a mixed-precision unsharded parameter is registered.
c10::ScalarType ParamDtype(const Target& t) {
  return t.fsdp_param ? t.fsdp_param->orig_dtype() : t.param.scalar_type();
}

// The groups of the mesh dims that shard the gradient (Shard / StridedShard), skipping
// one-rank dims (nothing to reduce). Replicate dims (HSDP's replicate dim, TP-replicated
// parameters on the tp dim) hold the same value on every rank: no reduction.
std::vector<comm::ProcessGroupPtr> ShardingGroups(const dtensor::DTensorSpec& spec, const std::string& what) {
  std::vector<comm::ProcessGroupPtr> groups;
  for (size_t d = 0; d < spec.placements.size(); ++d) {
    const dtensor::Placement& placement = spec.placements[d];
    TORCH_CHECK(!placement.is_partial(), kCaller, ": the gradient of ", what, " has placements ",
                dtensor::ToString(spec.placements), "; a Partial gradient has no norm until it is reduced");
    if (placement.is_shard() && spec.mesh->size(static_cast<int>(d)) > 1) {
      groups.push_back(spec.mesh->group(static_cast<int>(d)));
    }
  }
  return groups;
}

bool SameGroups(const std::vector<comm::ProcessGroupPtr>& a, const std::vector<comm::ProcessGroupPtr>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].get() != b[i].get()) return false;
  }
  return true;
}

// torch.utils._foreach_utils: the CPU and the devices with foreach kernels.
bool DeviceHasForeach(c10::DeviceType type) {
  return type == c10::kCPU || type == c10::kCUDA || type == c10::kXPU || type == c10::kMTIA ||
         type == c10::kPrivateUse1;
}

bool UseForeach(const c10::Device& device, std::optional<bool> foreach) {
  if (!foreach.has_value()) return DeviceHasForeach(device.type());
  if (!*foreach) return false;
  TORCH_CHECK(DeviceHasForeach(device.type()), kCaller, ": foreach=true was passed, but can't use the foreach API on ",
              device.type(), " tensors");
  return true;
}

// _group_tensors_by_device_and_dtype: buckets in first-occurrence order.
std::vector<std::vector<at::Tensor>> GroupByDeviceAndDtype(const std::vector<at::Tensor>& tensors) {
  std::vector<std::vector<at::Tensor>> groups;
  for (const at::Tensor& t : tensors) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const std::vector<at::Tensor>& g) {
      return g.front().device() == t.device() && g.front().scalar_type() == t.scalar_type();
    });
    if (it == groups.end()) {
      groups.push_back({t});
    } else {
      it->push_back(t);
    }
  }
  return groups;
}

// This rank's part of a layout's norm: the p-norm of the gradients' local p-norms (the
// local tensor of DTensor's Partial result), raised to p for the sum across ranks
// (_NormPartial's pre-reduce transform). Empty shards are left out: they add 0 to a sum of
// |g|^p and are the identity of a max of |g| >= 0, where linalg.vector_norm(inf) on an empty
// tensor raises.
at::Tensor LocalValue(const std::vector<at::Tensor>& grads, double p, c10::ScalarType dtype, const c10::Device& device,
                      std::optional<bool> foreach) {
  std::vector<at::Tensor> nonempty;
  for (const at::Tensor& g : grads) {
    if (g.numel() > 0) nonempty.push_back(g);
  }
  std::vector<at::Tensor> norms;
  for (const std::vector<at::Tensor>& group : GroupByDeviceAndDtype(nonempty)) {
    if (UseForeach(group.front().device(), foreach)) {
      for (at::Tensor& n : at::_foreach_norm(group, p)) norms.push_back(std::move(n));
    } else {
      for (const at::Tensor& g : group) norms.push_back(at::linalg_vector_norm(g, p));
    }
  }
  if (norms.empty()) return at::zeros({}, at::TensorOptions().dtype(dtype).device(device));
  for (at::Tensor& n : norms) n = n.to(device, dtype);
  const at::Tensor local = at::linalg_vector_norm(at::stack(norms), p);
  return std::isinf(p) ? local : local.pow(p);
}

// The gradients to clip grouped by how their norm is reduced (the same sharding groups on the
// same device), with the dtype and device of the total (PyTorch's: the promoted parameter
// dtype, the first gradient's device).
struct Grouped {
  std::vector<Layout> layouts;
  std::vector<at::Tensor> grads;  // every gradient to clip, in parameter order
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device result_device = c10::Device(c10::kCPU);
};

Grouped GroupByLayout(const std::vector<Target>& targets) {
  Grouped out;
  std::optional<c10::Device> first_grad_device;
  for (const Target& t : targets) {
    const at::Tensor grad = GradOf(t);
    // The layouts (hence the all-reduces) come from the parameters that take part, not from
    // which gradients this rank happens to hold, so every rank issues the same collectives.
    if (!grad.defined() && !t.param.requires_grad()) continue;
    if (c10::isFloatingType(ParamDtype(t))) {
      out.dtype = out.dtype == c10::ScalarType::Undefined ? ParamDtype(t) : c10::promoteTypes(out.dtype, ParamDtype(t));
    }
    std::vector<comm::ProcessGroupPtr> groups;
    c10::Device device(c10::kCPU);
    if (t.fsdp_param != nullptr) {
      groups = ShardingGroups(t.fsdp_param->sharding_spec(), "'" + t.fsdp_param->fqn() + "'");
      device = t.fsdp_param->device();
    } else if (t.tp_spec != nullptr) {
      groups = ShardingGroups(*t.tp_spec, "a tensor-parallel parameter of shape " + t.tp_spec->ToString());
      device = t.param.device();
    }
    // Whole gradients (no sharding group) share one layout whatever their device: they are
    // never communicated.
    auto it = std::find_if(out.layouts.begin(), out.layouts.end(), [&](const Layout& l) {
      return SameGroups(l.groups, groups) && (groups.empty() || l.device == device);
    });
    if (it == out.layouts.end()) {
      out.layouts.push_back(Layout{std::move(groups), device, {}, {}});
      it = out.layouts.end() - 1;
    }
    if (!grad.defined()) continue;
    if (!first_grad_device) first_grad_device = grad.device();
    it->grads.push_back(grad);
    out.grads.push_back(grad);
  }
  if (out.dtype == c10::ScalarType::Undefined) out.dtype = at::typeMetaToScalarType(at::get_default_dtype());
  out.result_device = first_grad_device.value_or(c10::Device(c10::kCPU));
  return out;
}

// One all-reduce per distinct sharding group, in order of first use (the same on every rank:
// parameter order, then mesh-dim order), over the values of every layout it shards. Sums of
// |g|^p (and maxima) reduce in any order, so a layout sharded over several groups is complete
// once each of them has reduced it.
void ReduceAcrossShards(std::vector<Layout>& layouts, bool is_inf) {
  std::vector<comm::ProcessGroupPtr> order;
  for (const Layout& l : layouts) {
    for (const comm::ProcessGroupPtr& g : l.groups) {
      if (std::none_of(order.begin(), order.end(), [&](const auto& o) { return o.get() == g.get(); })) {
        order.push_back(g);
      }
    }
  }
  for (const comm::ProcessGroupPtr& group : order) {
    std::vector<Layout*> members;
    for (Layout& l : layouts) {
      if (std::any_of(l.groups.begin(), l.groups.end(), [&](const auto& g) { return g.get() == group.get(); })) {
        members.push_back(&l);
      }
    }
    const c10::Device device = members.front()->device;
    std::vector<at::Tensor> values;
    for (Layout* l : members) values.push_back(l->value.to(device));
    at::Tensor packed = at::stack(values);
    group->all_reduce(packed, is_inf ? comm::ReduceOp::Max() : comm::ReduceOp::Sum())->wait();
    for (size_t i = 0; i < members.size(); ++i) members[i]->value = packed[static_cast<int64_t>(i)];
  }
}

// The total norm from the layouts' reduced values (sums of |g|^p, or maxima).
at::Tensor TotalNorm(const Grouped& grouped, double norm_type) {
  const bool is_inf = std::isinf(norm_type);
  at::Tensor total;
  for (const Layout& l : grouped.layouts) {
    const at::Tensor v = l.value.to(grouped.result_device);
    total = !total.defined() ? v : is_inf ? at::maximum(total, v) : total + v;
  }
  if (!total.defined()) return at::zeros({}, at::TensorOptions().dtype(grouped.dtype).device(grouped.result_device));
  return is_inf ? total : total.pow(1.0 / norm_type);
}

// clip_grads_with_norm_: multiplying by the coefficient clamped to 1 avoids a branch on the
// norm (a device-to-host sync).
void ScaleGrads(const std::vector<at::Tensor>& grads, const at::Tensor& total, double max_norm,
                std::optional<bool> foreach) {
  const at::Tensor clip_coef = max_norm / (total + 1e-6);
  const at::Tensor clip_coef_clamped = at::clamp(clip_coef, std::nullopt, 1.0);
  for (std::vector<at::Tensor>& group : GroupByDeviceAndDtype(grads)) {
    const c10::Device device = group.front().device();
    const at::Tensor coef = clip_coef_clamped.to(device);
    if (UseForeach(device, foreach)) {
      at::_foreach_mul_(group, coef);
    } else {
      for (at::Tensor& g : group) g.mul_(coef);
    }
  }
}

// PyTorch's error_if_nonfinite message, and (a sentinel PyTorch lacks) the first parameter
// whose gradient is non-finite and the ranks holding it: collective over the world of the
// first sharded parameter (every rank gets here: they share the total).
[[noreturn]] void ThrowNonfinite(const std::vector<Target>& targets, double value, double norm_type) {
  const int64_t n = static_cast<int64_t>(targets.size());
  at::Tensor flags = at::zeros({n}, at::kByte);
  comm::ProcessGroupPtr world;
  for (int64_t i = 0; i < n; ++i) {
    const Target& t = targets[i];
    if (world == nullptr && t.fsdp_param != nullptr) world = t.fsdp_param->sharding_spec().mesh->world();
    if (world == nullptr && t.tp_spec != nullptr) world = t.tp_spec->mesh->world();
    const at::Tensor g = GradOf(t);
    // A NaN or Inf element makes the sum non-finite.
    if (g.defined() && !at::isfinite(g.sum()).item<bool>()) flags[i] = 1;
  }
  at::Tensor all = flags.unsqueeze(0);
  if (world != nullptr && world->size() > 1) {
    all = at::empty({world->size(), n}, at::kByte);
    world->all_gather_into_tensor(all, flags)->wait();
  }
  std::vector<std::string> names;
  for (const Target& t : targets) names.push_back(t.name);
  std::string culprit;
  if (const std::optional<NonfiniteVerdict> verdict = JudgeNonfinite(all, names)) {
    culprit =
        world ? absl::StrCat(" The first parameter with a non-finite gradient: ", verdict->Describe("(its shard)"), ".")
              : absl::StrCat(" The first parameter with a non-finite gradient: '", verdict->fqn, "'.");
  }
  TORCH_CHECK(false, kCaller, ": the total norm of order ", norm_type,
              " for gradients from `parameters` is non-finite (", value,
              "), so it cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
              "anyway, set error_if_nonfinite=false.",
              culprit);
  std::abort();  // unreachable
}

at::Tensor ClipGradNorm(const std::vector<Target>& targets, double max_norm, double norm_type, bool error_if_nonfinite,
                        std::optional<bool> foreach) {
  at::NoGradGuard no_grad;
  Grouped grouped = GroupByLayout(targets);
  for (Layout& l : grouped.layouts) {
    l.value =
        LocalValue(l.grads, norm_type, grouped.dtype, l.groups.empty() ? grouped.result_device : l.device, foreach);
  }
  ReduceAcrossShards(grouped.layouts, std::isinf(norm_type));
  const at::Tensor total = TotalNorm(grouped, norm_type);
  if (error_if_nonfinite) {
    // Every rank holds the same total, so every rank throws (no rank is left in a collective).
    const double value = total.item<double>();
    if (!std::isfinite(value)) ThrowNonfinite(targets, value, norm_type);
  }
  ScaleGrads(grouped.grads, total, max_norm, foreach);
  return total;
}

}  // namespace

at::Tensor clip_grad_norm_(torch::nn::Module& root, double max_norm, double norm_type, bool error_if_nonfinite,
                           std::optional<bool> foreach) {
  CheckArguments(max_norm, norm_type);
  const Layouts layouts{ManagedParams(root), distributed_parameters::DistributedParameterSpecs(root)};
  std::vector<Target> targets;
  absl::flat_hash_set<const c10::TensorImpl*> seen;
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    // Tied parameters are listed under each name; their one gradient is clipped once.
    const at::Tensor& p = item.value();
    if (p.defined() && seen.insert(p.unsafeGetTensorImpl()).second) {
      targets.push_back(MakeTarget(layouts, p));
      targets.back().name = item.key();
    }
  }
  return ClipGradNorm(targets, max_norm, norm_type, error_if_nonfinite, foreach);
}

at::Tensor clip_grad_norm_(torch::nn::Module& root, const std::vector<at::Tensor>& parameters, double max_norm,
                           double norm_type, bool error_if_nonfinite, std::optional<bool> foreach) {
  CheckArguments(max_norm, norm_type);
  const Layouts layouts{ManagedParams(root), distributed_parameters::DistributedParameterSpecs(root)};
  absl::flat_hash_map<const c10::TensorImpl*, std::string> in_root;  // first names
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    if (item.value().defined()) in_root.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  std::vector<Target> targets;
  absl::flat_hash_set<const c10::TensorImpl*> seen;
  for (size_t i = 0; i < parameters.size(); ++i) {
    const at::Tensor& p = parameters[i];
    TORCH_CHECK(p.defined(), kCaller, ": parameters[", i, "] is an undefined tensor");
    // A tensor outside the tree might be some other model's sharded parameter: counting it
    // as whole would be the silent local-norm bug this function exists to avoid.
    TORCH_CHECK(in_root.contains(p.unsafeGetTensorImpl()), kCaller, ": parameters[", i, "] (shape ",
                c10::str(c10::IntArrayRef(p.sizes())), ") is not a parameter of the root module");
    if (seen.insert(p.unsafeGetTensorImpl()).second) {
      targets.push_back(MakeTarget(layouts, p));
      targets.back().name = in_root.at(p.unsafeGetTensorImpl());
    }
  }
  return ClipGradNorm(targets, max_norm, norm_type, error_if_nonfinite, foreach);
}

}  // namespace fsdp::fsdp2
