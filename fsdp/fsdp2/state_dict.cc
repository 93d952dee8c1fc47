#include "fsdp/fsdp2/state_dict.h"

#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/module.h>

#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/tensor_dict_file.h"
#include "distributed_parameters/distributed_parameters.h"
#include "dtensor/dtensor.h"
#include "fsdp/fsdp2/fsdp_state.h"
#include "fsdp/meta/meta.h"

namespace fsdp::fsdp2 {
namespace {

// One state-dict key of the model: an FSDP-managed parameter (fsdp_param set) or a plain
// tensor (buffer, ignored or unmanaged parameter).
struct Entry {
  std::string fqn;
  FSDPParam* fsdp_param = nullptr;
  at::Tensor tensor;
  // A tensor-parallel parameter no fully_shard manages: `tensor` is its local shard.
  std::optional<dtensor::DTensorSpec> tp_spec;

  std::vector<int64_t> global_shape() const {
    if (fsdp_param) return fsdp_param->sharding_spec().shape;
    return tp_spec ? tp_spec->shape : tensor.sizes().vec();
  }
};

// Every FSDP group resharded (PyTorch's to_sharded pre-save / pre-load hook); the FSDPParam
// of each managed parameter tensor.
absl::flat_hash_map<const c10::TensorImpl*, FSDPParam*> ReshardedParams(torch::nn::Module& root, const char* caller) {
  absl::flat_hash_map<const c10::TensorImpl*, FSDPParam*> by_impl;
  for (FSDPState* s : CollectStates(root)) {
    s->CheckNotPoisoned(caller);
    FSDPParamGroup* g = s->param_group();
    if (g == nullptr) continue;
    TORCH_CHECK(g->training_state() == TrainingState::kIdle, caller, ": the FSDP group of '", g->module_fqn(),
                "' is in training state ", ToString(g->training_state()),
                "; state dicts are taken and loaded outside forward/backward");
    g->Reshard();
    for (const auto& p : g->fsdp_params()) by_impl.emplace(p->param().unsafeGetTensorImpl(), p.get());
  }
  return by_impl;
}

FSDPParam* Find(const absl::flat_hash_map<const c10::TensorImpl*, FSDPParam*>& by_impl, const at::Tensor& t) {
  auto it = by_impl.find(t.unsafeGetTensorImpl());
  return it == by_impl.end() ? nullptr : it->second;
}

// The model's keys in named_parameters() then named_buffers() order.
std::vector<Entry> ModelEntries(torch::nn::Module& root, const char* caller) {
  const auto by_impl = ReshardedParams(root, caller);
  const auto tp_specs = distributed_parameters::DistributedParameterSpecs(root);
  std::vector<Entry> entries;
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    if (!item.value().defined()) continue;
    Entry e{item.key(), Find(by_impl, item.value()), item.value()};
    if (e.fsdp_param == nullptr) {
      if (auto it = tp_specs.find(item.value().unsafeGetTensorImpl()); it != tp_specs.end()) e.tp_spec = it->second;
    }
    entries.push_back(std::move(e));
  }
  for (const auto& item : root.named_buffers(/*recurse=*/true)) {
    if (item.value().defined()) entries.push_back({item.key(), nullptr, item.value()});
  }
  return entries;
}

// The group all ranks of the model share (the meshes' world), or null without FSDP.
comm::ProcessGroupPtr WorldGroup(const std::vector<Entry>& entries) {
  for (const Entry& e : entries) {
    if (e.fsdp_param) return e.fsdp_param->sharding_spec().mesh->world();
  }
  return nullptr;
}

// Copies this rank's rows of `full` (the parameter's global value) into the sharded
// parameter.
void CopyIntoShard(FSDPParam& p, const at::Tensor& full) {
  at::NoGradGuard no_grad;
  const at::Tensor shard = LocalShardOf(p, full);
  if (shard.numel() > 0) p.param().data().copy_(shard);
  p.ResetShardedParam();  // PyTorch's load_state_dict post-hook
  p.MarkInitialized();    // deferred init (meta_init.h)
}

// A tensor built on the meta device is allocated on FSDP's device first. A tensor-parallel
// parameter takes its box of `value` (the global tensor).
void CopyIntoPlain(const Entry& e, const at::Tensor& value, c10::Device device) {
  at::NoGradGuard no_grad;
  ::fsdp::MaterializeEmpty(e.tensor, device);
  at::Tensor box = value;
  if (e.tp_spec) {
    const dtensor::LocalShapeAndOffset local = e.tp_spec->local_shape_and_offset();
    for (size_t d = 0; d < local.shape.size(); ++d) {
      box = box.narrow(static_cast<int64_t>(d), local.offset[d], local.shape[d]);
    }
  }
  e.tensor.data().copy_(box);
}

// rank0_only loads of a plain FSDP parameter (1-D mesh over the whole world, dim-0 shards,
// no TP): rank 0 sends each rank only its rows (one all-to-all in which only rank 0 sends),
// instead of broadcasting the whole tensor to every rank.
bool ScatterableFromRank0(const FSDPParam& p, const comm::ProcessGroup& world) {
  const auto& mesh = p.sharding_spec().mesh;
  // Decided alike on every rank (nothing rank-specific), so all take the same path.
  bool identity = mesh->ndim() == 1 && mesh->size() == world.size();
  for (size_t r = 0; identity && r < mesh->ranks().size(); ++r) identity = mesh->ranks()[r] == static_cast<int>(r);
  return identity && !p.tp_spec() && !p.has_all_gather_extension() && p.shard_dim() == 0 &&
         p.sharding_spec().placements.size() == 1 && p.sharding_spec().placements[0].is_shard(0);
}

void ScatterShardFromRank0(FSDPParam& p, const at::Tensor& full) {
  const comm::ProcessGroupPtr& group = p.sharding_spec().mesh->group(0);
  const int64_t w = group->size();
  const std::vector<int64_t>& orig = p.orig_size();
  const int64_t inner = orig.empty() ? 1 : Numel(orig) / std::max<int64_t>(orig[0], 1);
  std::vector<int64_t> input_splits(w, 0), output_splits(w, 0);
  if (group->rank() == 0) {
    for (int64_t r = 0; r < w; ++r) input_splits[r] = MakeDimShardLayout(orig, 0, w, r).sharded_size[0] * inner;
  }
  output_splits[0] = Numel(p.sharded_size());
  // On the group's object-collective device (NCCL: its CUDA device; rank 0's full tensor
  // may come from the CPU), as PyTorch's broadcast of a full state dict.
  const at::Tensor input = comm::ToObjectCollectiveDevice(
      *group, group->rank() == 0 ? full.contiguous().view(-1) : at::empty({0}, at::TensorOptions(p.orig_dtype())));
  at::Tensor shard =
      comm::ToObjectCollectiveDevice(*group, at::empty(p.sharded_size(), at::TensorOptions(p.orig_dtype())));
  group->all_to_all_single(shard.view(-1), input, output_splits, input_splits)->wait();
  at::NoGradGuard no_grad;
  if (shard.numel() > 0) p.param().data().copy_(shard);
  p.ResetShardedParam();
  p.MarkInitialized();
}

// FSDP's compute device (the CPU without FSDP parameters).
c10::Device ComputeDevice(const std::vector<Entry>& entries) {
  for (const Entry& e : entries) {
    if (e.fsdp_param) return e.fsdp_param->device();
  }
  return c10::Device(c10::kCPU);
}

// What load_state_dict reports, in PyTorch's wording; empty when nothing is wrong.
struct LoadErrors {
  std::vector<std::string> missing, unexpected, problems;

  void SizeMismatch(const std::string& fqn, c10::IntArrayRef have, c10::IntArrayRef want) {
    problems.push_back(
        absl::StrCat("size mismatch for ", fqn, ": copying a param with shape ", c10::str(c10::IntArrayRef(have)),
                     " from checkpoint, the shape in current model is ", c10::str(c10::IntArrayRef(want)), "."));
  }
  std::string ToString() const {
    std::string out;
    if (!missing.empty()) absl::StrAppend(&out, "Missing key(s) in state_dict: ", absl::StrJoin(missing, ", "), ". ");
    if (!unexpected.empty()) {
      absl::StrAppend(&out, "Unexpected key(s) in state_dict: ", absl::StrJoin(unexpected, ", "), ". ");
    }
    absl::StrAppend(&out, absl::StrJoin(problems, " "));
    return out;
  }
};

std::string Mismatches(const std::vector<Entry>& entries, const FullStateDict& dict) {
  LoadErrors errors;
  absl::flat_hash_set<std::string> known;
  for (const Entry& e : entries) {
    known.insert(e.fqn);
    const at::Tensor* value = dict.find(e.fqn);
    if (value == nullptr) {
      errors.missing.push_back(e.fqn);
    } else if (value->sizes().vec() != e.global_shape()) {
      errors.SizeMismatch(e.fqn, value->sizes(), e.global_shape());
    }
  }
  for (const auto& item : dict) {
    if (!known.contains(item.key())) errors.unexpected.push_back(item.key());
  }
  return errors.ToString();
}

}  // namespace

std::vector<NamedParameter> NamedParameters(torch::nn::Module& root) {
  const auto by_impl = ReshardedParams(root, "NamedParameters");
  std::vector<NamedParameter> out;
  absl::flat_hash_set<const c10::TensorImpl*> seen;
  for (const auto& item : root.named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = item.value();
    if (t.defined() && seen.insert(t.unsafeGetTensorImpl()).second) out.push_back({item.key(), t, Find(by_impl, t)});
  }
  return out;
}

at::Tensor LocalShardOf(const FSDPParam& p, const at::Tensor& full) {
  TORCH_CHECK(full.sizes() == c10::IntArrayRef(p.sharding_spec().shape), "LocalShardOf(", p.fqn(),
              "): expects the global shape ", c10::str(c10::IntArrayRef(p.sharding_spec().shape)), " but got ",
              c10::str(c10::IntArrayRef(full.sizes())));
  at::Tensor local = full;
  if (const auto& tp = p.tp_spec()) {
    local = dtensor::distribute_tensor(full, tp->mesh, tp->placements, std::nullopt).to_local();
  }
  const DimShardLayout& layout = p.layout();
  return local.narrow(layout.shard_dim, layout.offset, layout.sharded_size[layout.shard_dim]);
}

at::Tensor GatherLikeParam(const FSDPParam& p, const at::Tensor& local) {
  at::NoGradGuard no_grad;
  const auto& tp = p.tp_spec();
  if (!tp) return dtensor::DTensor::FromSpec(local, p.sharding_spec()).full_tensor().detach();
  // FSDP + TP: FSDP's rows are its torch.chunk of this rank's TP shard, so gather them back
  // into the TP shard first (over the FSDP mesh dim only), then the TP shards. This is what
  // PyTorch 2.15's full_tensor() returns: its redistribute reads the _StridedShard as a
  // shard order (TP first, then FSDP). The _StridedShard split layout of the spec agrees
  // with it only while FSDP's chunks do not straddle (e.g. not for a colwise Linear(17, 19)
  // on dp 3 x tp 2, whose TP shards of 10 and 9 rows FSDP cuts 4/4/2 and 3/3/3).
  const dtensor::DTensorSpec& spec = p.sharding_spec();
  const int fsdp_dim = p.sharding_spec_fsdp_dim();
  if (fsdp_dim < 0) return dtensor::DTensor::FromSpec(local, *tp).full_tensor().detach();  // DDP: local is the TP shard
  dtensor::Placements fsdp_only(spec.placements.size(), dtensor::Placement::Replicate());
  fsdp_only[fsdp_dim] = dtensor::Placement::Shard(p.shard_dim());
  const dtensor::DTensorSpec tp_local_spec =
      dtensor::DTensorSpec::Make(spec.mesh, fsdp_only, p.layout().orig_size, local.scalar_type());
  const at::Tensor tp_local = dtensor::DTensor::FromSpec(local, tp_local_spec).full_tensor();
  return dtensor::DTensor::FromSpec(tp_local, *tp).full_tensor().detach();
}

ShardedStateDict GetShardedStateDict(torch::nn::Module& root) {
  ShardedStateDict out;
  for (const Entry& e : ModelEntries(root, "GetShardedStateDict")) {
    if (e.fsdp_param) {
      out.dtensors.insert(e.fqn, e.fsdp_param->ShardedDTensor());
    } else if (e.tp_spec) {
      out.dtensors.insert(e.fqn, dtensor::DTensor::FromSpec(e.tensor.detach(), *e.tp_spec));
    } else {
      out.tensors.insert(e.fqn, e.tensor.detach());
    }
  }
  return out;
}

void LoadShardedStateDict(torch::nn::Module& root, const ShardedStateDict& state_dict) {
  const std::vector<Entry> entries = ModelEntries(root, "LoadShardedStateDict");
  LoadErrors errors;
  absl::flat_hash_set<std::string> known;
  for (const Entry& e : entries) {
    known.insert(e.fqn);
    const dtensor::DTensor* d = state_dict.dtensors.find(e.fqn);
    const at::Tensor* t = state_dict.tensors.find(e.fqn);
    if (d == nullptr && t == nullptr) {
      errors.missing.push_back(e.fqn);
    } else if (e.fsdp_param && d == nullptr) {
      errors.problems.push_back(absl::StrCat(e.fqn, " is sharded by FSDP and needs a DTensor, got a plain tensor."));
    } else if (e.tp_spec && d == nullptr) {
      errors.problems.push_back(absl::StrCat(e.fqn, " is tensor-parallel and needs a DTensor, got a plain tensor."));
    } else if (!e.fsdp_param && !e.tp_spec && t == nullptr) {
      errors.problems.push_back(absl::StrCat(e.fqn, " is not sharded and needs a plain tensor, got a DTensor."));
    } else {
      const std::vector<int64_t> have = d ? d->sizes() : t->sizes().vec();
      const dtensor::DTensorSpec* spec = e.fsdp_param ? &e.fsdp_param->sharding_spec()
                                         : e.tp_spec  ? &*e.tp_spec
                                                      : nullptr;
      if (have != e.global_shape()) {
        errors.SizeMismatch(e.fqn, have, e.global_shape());
      } else if (d && !dtensor::SameMesh(*d->device_mesh(), *spec->mesh)) {
        errors.problems.push_back(absl::StrCat(e.fqn, ": the checkpoint's mesh ", d->device_mesh()->ToString(),
                                               " differs from the parameter's mesh ", spec->mesh->ToString(),
                                               " (load a full state dict to change the world size)."));
      }
    }
  }
  for (const auto& item : state_dict.dtensors) {
    if (!known.contains(item.key())) errors.unexpected.push_back(item.key());
  }
  for (const auto& item : state_dict.tensors) {
    if (!known.contains(item.key())) errors.unexpected.push_back(item.key());
  }
  const std::string error = errors.ToString();
  TORCH_CHECK(error.empty(), "LoadShardedStateDict: Error(s) in loading state_dict: ", error);

  for (const Entry& e : entries) {
    if (!e.fsdp_param && !e.tp_spec) {
      CopyIntoPlain(e, state_dict.tensors[e.fqn], ComputeDevice(entries));
      continue;
    }
    // This rank's block of the DTensor in the parameter's placements.
    const dtensor::DTensor& d = state_dict.dtensors[e.fqn];
    const dtensor::DTensorSpec& want = e.fsdp_param ? e.fsdp_param->sharding_spec() : *e.tp_spec;
    const at::Tensor param = e.fsdp_param ? e.fsdp_param->param() : e.tensor;
    at::NoGradGuard no_grad;
    at::Tensor local = d.to_local().detach();
    if (dtensor::ToString(d.placements()) != dtensor::ToString(want.placements)) {
      local = dtensor::RedistributeLocal(local, d.spec(), want.placements);
    }
    const std::vector<int64_t> holds = e.fsdp_param ? e.fsdp_param->sharded_size() : e.tensor.sizes().vec();
    TORCH_CHECK(local.sizes() == c10::IntArrayRef(holds), "LoadShardedStateDict: ", e.fqn, ": local shard of shape ",
                c10::str(c10::IntArrayRef(local.sizes())), " but this rank holds ", c10::str(c10::IntArrayRef(holds)));
    param.data().copy_(local);
    if (!e.fsdp_param) continue;
    e.fsdp_param->ResetShardedParam();
    e.fsdp_param->MarkInitialized();
  }
}

FullStateDict GetFullStateDict(torch::nn::Module& root, const FullStateDictOptions& options) {
  const std::vector<Entry> entries = ModelEntries(root, "GetFullStateDict");
  const comm::ProcessGroupPtr world = WorldGroup(entries);
  const bool keep = !options.rank0_only || world == nullptr || world->rank() == 0;
  FullStateDict out;
  // Tied parameters are gathered once (on every rank alike, so the collectives match); ranks
  // that keep nothing drop each gathered tensor at once, holding at most one at a time.
  absl::flat_hash_map<const FSDPParam*, at::Tensor> gathered;
  at::NoGradGuard no_grad;
  for (const Entry& e : entries) {
    at::Tensor value;
    if (e.fsdp_param) {
      auto it = gathered.find(e.fsdp_param);
      if (it == gathered.end()) {
        at::Tensor full = GatherLikeParam(*e.fsdp_param, e.fsdp_param->param().data());
        it = gathered.emplace(e.fsdp_param, keep ? full : at::Tensor()).first;
      }
      value = it->second;
    } else if (e.tp_spec) {  // collective over its mesh, in entry order on every rank
      value = dtensor::DTensor::FromSpec(e.tensor.detach(), *e.tp_spec).full_tensor();
    } else {
      value = e.tensor.detach();
    }
    if (keep) out.insert(e.fqn, options.cpu_offload ? value.cpu() : value);
  }
  return out;
}

void LoadFullStateDict(torch::nn::Module& root, const FullStateDict& state_dict, const FullStateDictOptions& options) {
  const std::vector<Entry> entries = ModelEntries(root, "LoadFullStateDict");
  const comm::ProcessGroupPtr world = WorldGroup(entries);
  const bool broadcast = options.rank0_only && world != nullptr && world->size() > 1;
  const bool source = !broadcast || world->rank() == 0;
  const std::string error = source ? Mismatches(entries, state_dict) : std::string();
  if (broadcast) {  // every rank fails together instead of waiting on rank 0's broadcasts
    at::Tensor failed = comm::ToObjectCollectiveDevice(*world, at::full({1}, error.empty() ? 0 : 1, at::kInt));
    world->broadcast(failed, 0)->wait();
    TORCH_CHECK(failed.item<int>() == 0, "LoadFullStateDict: Error(s) in loading rank 0's state_dict: ",
                source ? error : std::string("(see rank 0's error)"));
  }
  TORCH_CHECK(error.empty(), "LoadFullStateDict: Error(s) in loading state_dict: ", error);

  absl::flat_hash_set<const FSDPParam*> loaded;  // tied: load once
  for (const Entry& e : entries) {
    if (e.fsdp_param && !loaded.insert(e.fsdp_param).second) continue;
    const c10::ScalarType dtype = e.fsdp_param ? e.fsdp_param->orig_dtype() : e.tensor.scalar_type();
    at::Tensor full;
    if (source) full = state_dict[e.fqn];
    if (broadcast && e.fsdp_param && ScatterableFromRank0(*e.fsdp_param, *world)) {
      ScatterShardFromRank0(*e.fsdp_param, source ? full.to(dtype) : at::Tensor());
      continue;
    }
    if (broadcast) {
      full = source ? full.to(dtype).contiguous() : at::empty(e.global_shape(), at::TensorOptions(dtype));
      full = comm::ToObjectCollectiveDevice(*world, full);  // NCCL: its CUDA device
      world->broadcast(full, 0)->wait();
    }
    if (!e.fsdp_param) {
      CopyIntoPlain(e, full, ComputeDevice(entries));
      continue;
    }
    CopyIntoShard(*e.fsdp_param, full);
  }
}

void SaveFullStateDict(const FullStateDict& state_dict, const std::string& path) {
  checkpoint::SaveTensorDictAs(state_dict, path, "SaveFullStateDict");
}

FullStateDict LoadFullStateDictFile(const std::string& path) {
  return checkpoint::LoadTensorDictAs(path, "LoadFullStateDictFile");
}

FullStateDict DeserializeFullStateDict(const std::vector<char>& bytes, const std::string& source) {
  return checkpoint::DeserializeTensorDict(bytes, source, "LoadFullStateDictFile");
}

}  // namespace fsdp::fsdp2
