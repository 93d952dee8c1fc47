// dcp::Load (dcp.h): torch/distributed/checkpoint/state_dict_loader.py load with the
// default planner (default_planner.py create_default_local_load_plan: a read of each stored
// chunk that overlaps a destination) into the model's and optimizer's local shards, then
// state_dict.py set_model_state_dict / set_optimizer_state_dict.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/dcp_storage.h"
#include "dcp/collectives.h"
#include "dcp/dcp.h"
#include "dcp/plan.h"
#include "dcp/state_items.h"
#include "fsdp/fsdp1/fsdp_state.h"
#include "fsdp/fsdp1/fully_sharded_data_parallel.h"
#include "fsdp/fsdp2/fsdp_param.h"
#include "fsdp/fsdp2/state_dict.h"
#include "fsdp/meta/meta.h"
#include "optim_state/fsdp1_optim_state.h"
#include "optim_state/fsdp2_optim_state.h"
#include "optim_state/optimizer_adapter.h"

namespace fsdp::dcp {
namespace {

using checkpoint::DcpEntry;
using checkpoint::DcpMetadata;

constexpr char kLoad[] = "dcp::Load";

// "'a', 'b', 'c' (and 4 more)".
std::string ListKeys(const std::vector<std::string>& keys) {
  std::vector<std::string> shown;
  for (size_t i = 0; i < keys.size() && i < 5; ++i) shown.push_back("'" + keys[i] + "'");
  std::string out = absl::StrJoin(shown, ", ");
  if (keys.size() > shown.size()) absl::StrAppend(&out, " (and ", keys.size() - shown.size(), " more)");
  return out;
}

// A tensor entry of the checkpoint with the global size `want`.
const DcpEntry& TensorEntry(const std::string& dir, const DcpMetadata& md, const std::string& key,
                            const std::vector<int64_t>& want, const std::string& what) {
  const DcpEntry* e = md.Find(key);
  TORCH_CHECK(e != nullptr, kLoad, ": the checkpoint '", dir, "' has no entry '", key, "'");
  TORCH_CHECK(!e->is_bytes, kLoad, ": '", key, "' in the checkpoint '", dir, "' is a bytes entry, but ", what,
              " is a tensor");
  TORCH_CHECK(e->size == want, kLoad, ": '", key, "' in the checkpoint '", dir, "' has size ",
              c10::str(c10::IntArrayRef(e->size)), ", but ", what, " has size ", c10::str(c10::IntArrayRef(want)),
              " (a checkpoint of another model?)");
  return *e;
}

// A staging tensor for a local shard: for an FSDP2 parameter sharded on dim 0 laid out like
// its padded shard (zero padding), so that FSDPParam::ResetShardedParam adopts its storage
// instead of copying it (CommitShard).
at::Tensor Staging(const fsdp2::FSDPParam* fsdp, const std::vector<int64_t>& local_sizes, at::ScalarType dtype) {
  const at::TensorOptions options = at::TensorOptions().dtype(dtype);
  const at::Tensor& shard = fsdp != nullptr ? fsdp->sharded_param_data() : at::Tensor();
  if (!shard.defined() || fsdp->shard_dim() != 0 || shard.scalar_type() != dtype || !shard.is_cpu()) {
    return at::empty(local_sizes, options);
  }
  const int64_t padded = shard.numel();
  int64_t numel = 1;
  for (int64_t s : local_sizes) numel *= s;
  at::Tensor flat = at::empty({padded}, options);
  if (padded > numel) flat.narrow(0, numel, padded - numel).zero_();
  return flat.narrow(0, 0, numel).view(local_sizes);
}

// The tensors a load fills: each box of each entry is prepared (its chunks located and
// checked) when added, and read by ReadAll, straight into its destination: the live tensor
// when the load reads in place, else a staging tensor.
class ReadPlan {
 public:
  ReadPlan(checkpoint::DcpReader& reader, bool in_place) : reader_(reader), in_place_(in_place) {}

  // The destination of entry `e`'s local part of `local_sizes`: `live` when reading in place
  // is possible (the live tensor is a CPU tensor of the stored dtype and those sizes),
  // else `staging()`.
  template <class StagingFn>
  at::Tensor Destination(const DcpEntry& e, const at::Tensor& live, const std::vector<int64_t>& local_sizes,
                         StagingFn&& staging) const {
    if (in_place_ && live.defined() && !live.is_meta() && live.is_cpu() && live.scalar_type() == e.properties.dtype &&
        live.sizes() == c10::IntArrayRef(local_sizes)) {
      return live;
    }
    return staging();
  }
  at::Tensor Destination(const DcpEntry& e, const at::Tensor& live, const std::vector<int64_t>& local_sizes) const {
    return Destination(e, live, local_sizes,
                       [&] { return at::empty(local_sizes, at::TensorOptions().dtype(e.properties.dtype)); });
  }

  // Plans the reads of `boxes` of `e` into `dest` and returns it.
  at::Tensor Add(const DcpEntry& e, at::Tensor dest, std::vector<internal::Box> boxes) {
    for (const internal::Box& box : boxes) reader_.Prepare(e.fqn, box.global_offsets, internal::BoxOf(dest, box));
    reads_.push_back({&e, dest, std::move(boxes)});
    return dest;
  }
  // `fsdp`'s local part (the whole tensor when null) of `e`, of `local_sizes`.
  at::Tensor AddLocal(const DcpEntry& e, at::Tensor dest, const fsdp2::FSDPParam* fsdp,
                      const std::vector<int64_t>& local_sizes) {
    return Add(e, std::move(dest), internal::LocalBoxes(fsdp, local_sizes));
  }

  void ReadAll() {
    for (const Read& r : reads_) {
      for (const internal::Box& box : r.boxes) {
        reader_.ReadInto(r.entry->fqn, box.global_offsets, internal::BoxOf(r.dest, box));
      }
    }
    reads_.clear();
  }

 private:
  struct Read {
    const DcpEntry* entry;
    at::Tensor dest;
    std::vector<internal::Box> boxes;
  };
  checkpoint::DcpReader& reader_;
  const bool in_place_;
  std::vector<Read> reads_;
};

c10::IValue ReadValue(checkpoint::DcpReader& reader, const std::string& dir, const std::string& key) {
  const std::vector<char> bytes = reader.ReadBytes(key);
  return checkpoint::ReadCheckpoint(bytes.data(), bytes.size(), absl::StrCat("entry '", key, "' of '", dir, "'"));
}

struct ModelUpdate {
  at::Tensor target;  // the live parameter or buffer
  fsdp2::FSDPParam* fsdp = nullptr;
  at::Tensor value;  // where its local part is read: `target` itself (in place) or staging
};

struct Pending {
  std::vector<ModelUpdate> model;
  std::vector<ModelUpdate> extra;  // LoadOptions::extra_state
  bool has_optimizer_state = false;
  optim_state::OptimStateDict optim;
};

void ReadModel(torch::nn::Module& model, const std::vector<fsdp2::NamedParameter>& params,
               const internal::FlatModel& flat, const std::string& dir, const DcpMetadata& md, ReadPlan& plan,
               const LoadOptions& options, Pending& out) {
  absl::flat_hash_map<const c10::TensorImpl*, fsdp2::FSDPParam*> by_impl;
  for (const auto& p : params) {
    if (p.fsdp_param) by_impl.emplace(p.param.unsafeGetTensorImpl(), p.fsdp_param);
  }
  struct Target {
    std::string fqn;
    at::Tensor tensor;
    fsdp2::FSDPParam* fsdp;
  };
  std::vector<Target> targets;
  absl::flat_hash_set<const c10::TensorImpl*> seen;  // a tied tensor is read under its first name
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = item.value();
    if (!t.defined() || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
    auto it = by_impl.find(t.unsafeGetTensorImpl());
    targets.push_back({item.key(), t, it == by_impl.end() ? nullptr : it->second});
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    if (item.value().defined()) targets.push_back({item.key(), item.value(), nullptr});
  }
  std::vector<std::string> missing;
  for (const Target& t : targets) {
    if (md.Find(internal::ModelKey(t.fqn)) == nullptr) missing.push_back(internal::ModelKey(t.fqn));
  }
  TORCH_CHECK(missing.empty() || options.allow_partial_load, kLoad, ": the checkpoint '", dir, "' lacks ",
              missing.size(), " of the model's ", targets.size(), " keys: ", ListKeys(missing),
              " (a checkpoint of another model?)");
  for (const Target& t : targets) {
    const std::string key = internal::ModelKey(t.fqn);
    if (md.Find(key) == nullptr) continue;                                   // allow_partial_load
    if (auto piece = flat.by_fqn.find(t.fqn); piece != flat.by_fqn.end()) {  // FSDP1: this rank's flat range
      const internal::FlatPiece& f = piece->second;
      const DcpEntry& e = TensorEntry(dir, md, key, f.shape, absl::StrCat("the model's '", t.fqn, "'"));
      if (!f.local.defined()) continue;
      const int64_t n = f.local.numel();
      out.model.push_back(
          {f.local, nullptr,
           plan.Add(e, plan.Destination(e, f.local, {n}), internal::FlatRangeBoxes(f.shape, f.flat_start, n))});
      continue;
    }
    const std::vector<int64_t> global = t.fsdp ? t.fsdp->sharding_spec().shape : t.tensor.sizes().vec();
    const DcpEntry& e = TensorEntry(dir, md, key, global, absl::StrCat("the model's '", t.fqn, "'"));
    const std::vector<int64_t> local = t.fsdp ? t.fsdp->sharded_size() : t.tensor.sizes().vec();
    const at::Tensor dest =
        plan.Destination(e, t.tensor, local, [&] { return Staging(t.fsdp, local, e.properties.dtype); });
    out.model.push_back({t.tensor, t.fsdp, plan.AddLocal(e, dest, t.fsdp, local)});
  }
}

// "optim.param_groups.<i>.<option>" -> (i, option); false for other keys.
bool ParseGroupKey(const std::string& key, size_t* group, std::string* option) {
  if (!absl::StartsWith(key, internal::kParamGroupsPrefix)) return false;
  const std::string rest = key.substr(std::strlen(internal::kParamGroupsPrefix));
  const size_t dot = rest.find('.');
  if (dot == std::string::npos || !absl::SimpleAtoi(rest.substr(0, dot), group)) return false;
  *option = rest.substr(dot + 1);
  return !option->empty();
}

// The optimizer's current tensor `name` of parameter `fqn` (undefined when it has none).
at::Tensor LiveState(const optim_state::OptimStateDict& live, const std::string& fqn, const std::string& name) {
  auto p = live.state.find(fqn);
  if (p == live.state.end()) return at::Tensor();
  auto v = p->second.find(name);
  if (v == p->second.end()) return at::Tensor();
  const at::Tensor* t = std::get_if<at::Tensor>(&v->second);
  return t != nullptr ? *t : at::Tensor();
}

void ReadOptimizer(const torch::optim::Optimizer& optimizer, const std::vector<fsdp2::NamedParameter>& params,
                   const internal::FlatModel& flat, const std::string& dir, const DcpMetadata& md,
                   checkpoint::DcpReader& reader, ReadPlan& plan, const optim_state::OptimStateDict& live,
                   const LoadOptions& options, Pending& out) {
  // Param groups: every "optim.param_groups.<i>.<option>" entry (PyTorch writes each option
  // of each group, "params" the FQN list).
  std::map<size_t, optim_state::ParamGroupState> groups;
  for (const DcpEntry& e : md.entries) {
    size_t g;
    std::string option;
    if (!ParseGroupKey(e.fqn, &g, &option)) continue;
    const c10::IValue value = ReadValue(reader, dir, e.fqn);
    if (option != "params") {
      groups[g].options[option] = value;
      continue;
    }
    TORCH_CHECK(value.isList(), kLoad, ": '", e.fqn, "' in the checkpoint '", dir, "' is a ", value.tagKind(),
                ", not a list of parameter names");
    for (const c10::IValue& name : value.toListRef()) {
      TORCH_CHECK(name.isString(), kLoad, ": '", e.fqn, "' in the checkpoint '", dir, "' lists a ", name.tagKind(),
                  ", not a parameter name");
      groups[g].params.push_back(name.toStringRef());
    }
  }
  if (groups.empty()) {
    TORCH_CHECK(options.allow_partial_load, kLoad, ": the checkpoint '", dir, "' has no optimizer state (no entry '",
                internal::ParamGroupKey(0, "params"), "')");
    return;
  }
  for (auto& [g, group] : groups) {
    const size_t next = out.optim.param_groups.size();  // groups are numbered 0, 1, ...
    TORCH_CHECK(g == next, kLoad, ": the checkpoint '", dir, "' has no entry '",
                internal::ParamGroupKey(next, "params"), "' but has param group ", g);
    TORCH_CHECK(!group.params.empty() || md.Find(internal::ParamGroupKey(g, "params")) != nullptr, kLoad,
                ": the checkpoint '", dir, "' has no entry '", internal::ParamGroupKey(g, "params"), "'");
    out.optim.param_groups.push_back(std::move(group));
  }
  // State: "optim.state.<fqn>.<name>" for the optimizer's parameters (others are ignored).
  absl::flat_hash_map<std::string, fsdp2::FSDPParam*> fsdp_of;
  absl::flat_hash_map<std::string, at::Tensor> param_of;
  for (const auto& p : params) {
    fsdp_of.emplace(p.fqn, p.fsdp_param);
    param_of.emplace(p.fqn, p.param);
  }
  for (const DcpEntry& e : md.entries) {
    if (!absl::StartsWith(e.fqn, internal::kOptimStatePrefix)) continue;
    const std::string rest = e.fqn.substr(std::strlen(internal::kOptimStatePrefix));
    const size_t dot = rest.rfind('.');
    if (dot == std::string::npos) continue;
    const std::string fqn = rest.substr(0, dot), name = rest.substr(dot + 1);
    auto it = fsdp_of.find(fqn);
    if (it == fsdp_of.end()) continue;
    fsdp2::FSDPParam* fsdp = it->second;
    optim_state::StateValue value;
    if (e.is_bytes) {
      const c10::IValue v = ReadValue(reader, dir, e.fqn);
      TORCH_CHECK(v.isInt() || v.isDouble(), kLoad, ": '", e.fqn, "' in the checkpoint '", dir, "' is a ", v.tagKind(),
                  "; optimizer state values are tensors, ints or floats");
      value = v.isInt() ? optim_state::StateValue(v.toInt()) : optim_state::StateValue(v.toDouble());
    } else if (auto piece = flat.by_fqn.find(fqn); piece != flat.by_fqn.end() && !e.size.empty()) {
      const internal::FlatPiece& f = piece->second;  // FSDP1: this rank's flat range of it
      TensorEntry(dir, md, e.fqn, f.shape, absl::StrCat("parameter '", fqn, "'"));
      const int64_t n = f.local.defined() ? f.local.numel() : 0;
      value = plan.Add(e, plan.Destination(e, at::Tensor(), {n}), internal::FlatRangeBoxes(f.shape, f.flat_start, n));
    } else if (!e.size.empty()) {
      const at::Tensor& param = param_of.at(fqn);
      const std::vector<int64_t> global = fsdp ? fsdp->sharding_spec().shape : param.sizes().vec();
      TensorEntry(dir, md, e.fqn, global, absl::StrCat("parameter '", fqn, "'"));
      const std::vector<int64_t> local = fsdp ? fsdp->sharded_size() : param.sizes().vec();
      value = plan.AddLocal(e, plan.Destination(e, LiveState(live, fqn, name), local), fsdp, local);
    } else {  // a 0-d value (`step`): read now, into fresh memory (no live tensor changes)
      at::Tensor scalar = at::empty({}, at::TensorOptions().dtype(e.properties.dtype));
      reader.ReadInto(e.fqn, {}, scalar);
      if (name == "step") {  // PyTorch's 0-d float tensor; LibTorch's optimizers count in an int
        const double step = scalar.item<double>();
        TORCH_CHECK(step >= 0 && std::floor(step) == step, kLoad, ": '", e.fqn, "' in the checkpoint '", dir, "' is ",
                    step, ", not a step count");
        value = static_cast<int64_t>(step);
      } else {
        value = scalar;
      }
    }
    out.optim.state[fqn][name] = std::move(value);
  }
  out.optim.optimizer = optim_state::OptimizerAdapterFor(optimizer)->name();
  out.has_optimizer_state = true;
}

}  // namespace

void Load(torch::nn::Module& model, torch::optim::Optimizer* optimizer, const std::string& dir,
          const LoadOptions& options) {
  const std::vector<fsdp2::NamedParameter> params = fsdp2::NamedParameters(model);  // reshards
  comm::ProcessGroupPtr world;
  const internal::FlatModel flat = internal::CollectFlatPieces(model, &world, kLoad);
  c10::Device device(c10::kCPU);  // FSDP's: where tensors built on the meta device go
  for (const auto& p : params) {
    if (p.fsdp_param != nullptr) {
      world = p.fsdp_param->sharding_spec().mesh->world();
      device = p.fsdp_param->device();
      break;
    }
  }
  // Check everything that needs no tensor bytes first (the metadata, every key and shape,
  // every chunk's file, range, header and dtype, non-tensor values, the optimizer state's
  // structure), and change nothing unless every rank could. Then read: in place (as Python's
  // dcp.load) into the live tensors, or, all_or_nothing (and always for FSDP1), into staging
  // tensors applied only once every rank read everything.
  const bool in_place = !options.all_or_nothing && flat.empty();
  Pending pending;
  DcpMetadata md;
  std::unique_ptr<checkpoint::DcpReader> reader;
  std::unique_ptr<ReadPlan> plan;
  std::string error = internal::ErrorOf([&] {
    try {
      md = checkpoint::ReadMetadata(dir);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, kLoad, ": '", dir, "' holds no complete checkpoint: ", e.what_without_backtrace());
    }
    reader = std::make_unique<checkpoint::DcpReader>(dir, md);
    plan = std::make_unique<ReadPlan>(*reader, in_place);
    ReadModel(model, params, flat, dir, md, *plan, options, pending);
    internal::CheckExtraState(options.extra_state, kLoad);
    for (const auto& [key, tensor] : options.extra_state) {
      const DcpEntry& e = TensorEntry(dir, md, key, tensor.sizes().vec(), absl::StrCat("extra_state '", key, "'"));
      const std::vector<int64_t> sizes = tensor.sizes().vec();
      pending.extra.push_back(
          {tensor, nullptr, plan->AddLocal(e, plan->Destination(e, tensor, sizes), nullptr, sizes)});
    }
    if (optimizer != nullptr) {
      const optim_state::OptimStateDict live =
          in_place ? optim_state::GetShardedOptimStateDict(model, *optimizer) : optim_state::OptimStateDict();
      ReadOptimizer(*optimizer, params, flat, dir, md, *reader, *plan, live, options, pending);
      if (in_place && pending.has_optimizer_state) {
        optim_state::CheckShardedOptimStateDict(model, *optimizer, pending.optim);
      }
    }
    if (!in_place) plan->ReadAll();
  });
  internal::AgreeOrThrow(world, error, kLoad);
  if (in_place) {
    error = internal::ErrorOf([&] { plan->ReadAll(); });
    if (!error.empty()) {
      absl::StrAppend(&error, " [", kLoad,
                      " was reading in place: the model and optimizer are now partly loaded; load a checkpoint "
                      "again before training (LoadOptions::all_or_nothing reads into fresh memory first)]");
    }
    internal::AgreeOrThrow(world, error, kLoad);
  }
  error = internal::ErrorOf([&] {
    if (pending.has_optimizer_state && flat.empty()) {
      // The read tensors become the optimizer's (no copy): the live ones, or our staging.
      optim_state::LoadShardedOptimStateDict(model, *optimizer, pending.optim, optim_state::StateTensors::kAdopt);
    } else if (pending.has_optimizer_state) {
      optim_state::LoadShardedOptimStateDict(fsdp1::FullyShardedDataParallel(fsdp1::GetState(model)),
                                             *optimizer, internal::PiecesToFlatOptim(pending.optim, flat, kLoad));
    }
    at::NoGradGuard no_grad;
    for (ModelUpdate& u : pending.extra) {
      if (!u.value.is_same(u.target)) u.target.copy_(u.value);
    }
    for (ModelUpdate& u : pending.model) {
      if (u.fsdp != nullptr) {
        const at::Tensor& param = u.fsdp->param();
        if (u.value.is_same(param)) {
          // read in place
        } else if (u.value.device() == param.device() && u.value.dtype() == param.dtype() && !param.is_meta()) {
          param.set_data(u.value);  // ResetShardedParam adopts a Staging tensor's storage
        } else {
          param.data().copy_(u.value);
        }
        u.fsdp->ResetShardedParam();  // PyTorch's load_state_dict post-hook
        u.fsdp->MarkInitialized();    // deferred init (fsdp/fsdp2/meta_init.h)
      } else if (!u.value.is_same(u.target)) {
        ::fsdp::MaterializeEmpty(u.target, device);
        u.target.data().copy_(u.value);
      }
    }
  });
  internal::AgreeOrThrow(world, error, kLoad);
}

}  // namespace fsdp::dcp
