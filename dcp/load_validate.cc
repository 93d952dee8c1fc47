// dcp::Load's first phase (load_job.h): torch/distributed/checkpoint/default_planner.py
// create_default_local_load_plan's checks (every key the state dict asks for is in the
// metadata, with its size) before anything is read or changed.
#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string_view>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint_reader.h"
#include "dcp/load_job.h"
#include "dcp/state_items.h"
#include "optim_state/optimizer_adapter.h"

namespace fsdp::dcp::internal {
namespace {

using checkpoint::DcpEntry;

// "<prefix><i>.<option>" -> (i, option); false for other keys.
bool ParseGroupKey(const std::string& key, const std::string& prefix, size_t* group, std::string* option) {
  if (!absl::StartsWith(key, prefix)) return false;
  const std::string rest = key.substr(prefix.size());
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

}  // namespace

std::string ListKeys(const std::vector<std::string>& keys) {
  std::vector<std::string> shown;
  for (size_t i = 0; i < keys.size() && i < 5; ++i) shown.push_back("'" + keys[i] + "'");
  std::string out = absl::StrJoin(shown, ", ");
  if (keys.size() > shown.size()) absl::StrAppend(&out, " (and ", keys.size() - shown.size(), " more)");
  return out;
}

LoadJob::LoadJob(torch::nn::Module& model, torch::optim::Optimizer* optimizer, std::string dir,
                 const LoadOptions& options, const ModelAdapter& adapter, bool in_place)
    : model_(model),
      optimizer_(optimizer),
      dir_(std::move(dir)),
      options_(options),
      adapter_(adapter),
      in_place_(in_place) {}

void LoadJob::Validate() {
  try {
    md_ = checkpoint::ReadMetadata(dir_);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, kLoad, ": '", dir_, "' holds no complete checkpoint: ", e.what_without_backtrace());
  }
  reader_ = std::make_unique<checkpoint::DcpReader>(dir_, md_);
  ValidateModel();
  ValidateStateful();
  if (optimizer_ == nullptr) return;
  ValidateParamGroups();
  if (has_optimizer_state_) ValidateState();
}

StoredTensor LoadJob::StoredModel(const std::string& fqn) const {
  return options_.layout.model ? options_.layout.model(fqn) : StoredTensor{fqn, {}};
}

StoredTensor LoadJob::StoredOptimizer(const std::string& fqn) const {
  return options_.layout.optimizer ? options_.layout.optimizer(fqn) : StoredTensor{fqn, {}};
}

// A tensor entry of the checkpoint with the global size `want`, or, read through `rows`, with
// want's sizes past dim 0 and at least the rows `rows` names.
const DcpEntry& LoadJob::TensorEntry(const std::string& key, const std::vector<int64_t>& want, const std::string& what,
                                     const std::vector<int64_t>& rows) const {
  const DcpEntry* e = md_.Find(key);
  TORCH_CHECK(e != nullptr, kLoad, ": the checkpoint '", dir_, "' has no entry '", key, "'");
  TORCH_CHECK(!e->is_bytes, kLoad, ": '", key, "' in the checkpoint '", dir_, "' is a bytes entry, but ", what,
              " is a tensor");
  if (rows.empty()) {
    TORCH_CHECK(e->size == want, kLoad, ": '", key, "' in the checkpoint '", dir_, "' has size ",
                c10::str(c10::IntArrayRef(e->size)), ", but ", what, " has size ", c10::str(c10::IntArrayRef(want)),
                " (a checkpoint of another model?)");
    return *e;
  }
  const bool same_rows_shape =
      !want.empty() && e->size.size() == want.size() && std::equal(want.begin() + 1, want.end(), e->size.begin() + 1);
  TORCH_CHECK(same_rows_shape && static_cast<int64_t>(rows.size()) == want[0], kLoad, ": '", key,
              "' in the checkpoint '", dir_, "' has size ", c10::str(c10::IntArrayRef(e->size)), ", but ", what,
              " of size ", c10::str(c10::IntArrayRef(want)), " is read from ", rows.size(),
              " of its rows (LoadOptions::layout)");
  for (const int64_t r : rows) {
    TORCH_CHECK(r >= 0 && r < e->size[0], kLoad, ": LoadOptions::layout reads ", what, " from row ", r, " of '", key,
                "' in the checkpoint '", dir_, "', which has ", e->size[0], " rows");
  }
  return *e;
}

c10::IValue LoadJob::ReadValue(const std::string& key) {
  const std::vector<char> bytes = reader_->ReadBytes(key);
  return checkpoint::ReadCheckpoint(bytes.data(), bytes.size(), absl::StrCat("entry '", key, "' of '", dir_, "'"));
}

// Parameters (a tied tensor under its first name), then buffers.
void LoadJob::ValidateModel() {
  std::vector<std::pair<std::string, at::Tensor>> targets = UniqueParameters(model_);
  const size_t params = targets.size();
  for (const auto& item : model_.named_buffers(/*recurse=*/true)) {
    if (item.value().defined()) targets.emplace_back(item.key(), item.value());
  }
  std::vector<StoredTensor> stored;
  std::vector<std::string> missing;
  for (const auto& [fqn, tensor] : targets) {
    stored.push_back(StoredModel(fqn));
    stored.back().fqn.insert(0, options_.layout.model_prefix);
    if (md_.Find(stored.back().fqn) == nullptr) missing.push_back(stored.back().fqn);
  }
  TORCH_CHECK(missing.empty() || options_.allow_partial_load, kLoad, ": the checkpoint '", dir_, "' lacks ",
              missing.size(), " of the model's ", targets.size(), " keys: ", ListKeys(missing),
              " (a checkpoint of another model?)");
  for (size_t i = 0; i < targets.size(); ++i) {
    const auto& [fqn, tensor] = targets[i];
    const std::string& key = stored[i].fqn;
    if (md_.Find(key) == nullptr) continue;  // allow_partial_load
    const ShardedParam* sharded = i < params ? adapter_.Sharded(fqn) : nullptr;
    const DcpEntry& e = TensorEntry(key, sharded ? sharded->global_size() : tensor.sizes().vec(),
                                    absl::StrCat("the model's '", fqn, "'"), stored[i].rows);
    if (sharded == nullptr) {
      const std::vector<int64_t> sizes = tensor.sizes().vec();
      model_targets_.push_back(
          {tensor, nullptr, {&e, sizes, {WholeBox(sizes)}, tensor, nullptr, {}, std::move(stored[i].rows), {}}});
    } else if (sharded->live().defined()) {  // else this rank holds none of it
      model_targets_.push_back(
          {sharded->live(),
           sharded,
           {&e, sharded->local_size(), sharded->boxes(), sharded->live(), sharded, {}, std::move(stored[i].rows), {}}});
    }
  }
}

void LoadJob::ValidateStateful() {
  for (StateLeaf& leaf : FlattenStateful(options_.stateful, stateful_dicts_, kLoad)) {
    if (leaf.value.isTensor()) {
      const at::Tensor& tensor = leaf.value.toTensor();
      const std::vector<int64_t> sizes = tensor.sizes().vec();
      const DcpEntry& e = TensorEntry(leaf.key, sizes, absl::StrCat("stateful '", leaf.key, "'"));
      stateful_targets_.push_back({tensor, nullptr, {&e, sizes, {WholeBox(sizes)}, tensor, nullptr, {}}});
      continue;
    }
    const DcpEntry* e = md_.Find(leaf.key);
    TORCH_CHECK(e != nullptr, kLoad, ": the checkpoint '", dir_, "' has no entry '", leaf.key, "'");
    TORCH_CHECK(e->is_bytes, kLoad, ": '", leaf.key, "' in the checkpoint '", dir_, "' is a tensor, but stateful '",
                leaf.key, "' is a ", leaf.value.tagKind());
    c10::IValue value = ReadValue(leaf.key);
    stateful_values_.emplace_back(std::move(leaf), std::move(value));
  }
}

// The flattened param groups (StoredLayout): the optimizer's own groups, each with the options
// stored under its first parameter. False when the checkpoint has none.
bool LoadJob::ReadFlatParamGroups(const std::string& prefix) {
  const optim_state::OptimStateDict live = adapter_.GetOptimState(model_, *optimizer_);
  for (const optim_state::ParamGroupState& group : live.param_groups) {
    TORCH_CHECK(!group.params.empty(), kLoad, ": param group ", optim_.param_groups.size(),
                " of the optimizer is empty: a flattened optimizer state names groups by their first parameter");
    const std::string first = absl::StrCat(prefix, StoredOptimizer(group.params.front()).fqn, ".");
    optim_state::ParamGroupState loaded;
    loaded.params = group.params;
    for (const DcpEntry& e : md_.entries) {
      const std::string_view option = std::string_view(e.fqn).substr(std::min(first.size(), e.fqn.size()));
      if (absl::StartsWith(e.fqn, first) && !option.empty() && option.find('.') == std::string_view::npos) {
        loaded.options[std::string(option)] = ReadValue(e.fqn);
      }
    }
    if (loaded.options.empty()) {
      TORCH_CHECK(optim_.param_groups.empty(), kLoad, ": the checkpoint '", dir_, "' has no option entry '", first,
                  "<option>' of param group ", optim_.param_groups.size(), " (its first parameter is '",
                  group.params.front(), "')");
      return false;
    }
    optim_.param_groups.push_back(std::move(loaded));
  }
  return !optim_.param_groups.empty();
}

// Every "optim.param_groups.<i>.<option>" entry (PyTorch writes each option of each group,
// "params" the FQN list), or the flattened form (dcp.h, StoredLayout).
void LoadJob::ValidateParamGroups() {
  const std::string prefix = options_.layout.optimizer_prefix + "param_groups.";
  const bool nested = std::any_of(md_.entries.begin(), md_.entries.end(), [&](const DcpEntry& e) {
    size_t g;
    std::string option;
    return ParseGroupKey(e.fqn, prefix, &g, &option) && option == "params";
  });
  if (!nested) {
    TORCH_CHECK(ReadFlatParamGroups(prefix) || options_.allow_partial_load, kLoad, ": the checkpoint '", dir_,
                "' has no optimizer state (no entry '", prefix, "0.params')");
    if (optim_.param_groups.empty()) return;
    optim_.optimizer = optim_state::OptimizerAdapterFor(*optimizer_)->name();
    has_optimizer_state_ = true;
    return;
  }
  std::map<size_t, optim_state::ParamGroupState> groups;
  for (const DcpEntry& e : md_.entries) {
    size_t g;
    std::string option;
    if (!ParseGroupKey(e.fqn, prefix, &g, &option)) continue;
    const c10::IValue value = ReadValue(e.fqn);
    if (option != "params") {
      groups[g].options[option] = value;
      continue;
    }
    TORCH_CHECK(value.isList(), kLoad, ": '", e.fqn, "' in the checkpoint '", dir_, "' is a ", value.tagKind(),
                ", not a list of parameter names");
    for (const c10::IValue& name : value.toListRef()) {
      TORCH_CHECK(name.isString(), kLoad, ": '", e.fqn, "' in the checkpoint '", dir_, "' lists a ", name.tagKind(),
                  ", not a parameter name");
      groups[g].params.push_back(name.toStringRef());
    }
  }
  // A model holding part of the checkpoint's (a pipeline stage) takes the groups' parameters
  // it has, and the groups that keep any: as PyTorch's _split_optim_state_dict maps the
  // optimizer's own parameters to the stored groups and ignores the rest. A group lists stored
  // names: each stands for our parameters stored there (StoredLayout).
  absl::flat_hash_map<std::string, std::vector<std::string>> ours_of;  // by stored FQN
  for (const auto& [fqn, param] : UniqueParameters(model_)) ours_of[StoredOptimizer(fqn).fqn].push_back(fqn);
  size_t expected = 0;
  for (auto& [g, group] : groups) {
    TORCH_CHECK(g == expected, kLoad, ": the checkpoint '", dir_, "' has no entry '", prefix, expected,
                ".params' but has param group ", g);
    ++expected;
    TORCH_CHECK(!group.params.empty() || md_.Find(absl::StrCat(prefix, g, ".params")) != nullptr, kLoad,
                ": the checkpoint '", dir_, "' has no entry '", prefix, g, ".params'");
    const bool was_empty = group.params.empty();
    std::vector<std::string> kept;
    for (const std::string& stored : group.params) {
      if (auto it = ours_of.find(stored); it != ours_of.end())
        kept.insert(kept.end(), it->second.begin(), it->second.end());
    }
    if (!was_empty && kept.empty()) continue;  // none of this group's parameters is in the model
    group.params = std::move(kept);
    optim_.param_groups.push_back(std::move(group));
  }
  optim_.optimizer = optim_state::OptimizerAdapterFor(*optimizer_)->name();
  has_optimizer_state_ = true;
}

// "optim.state.<fqn>.<name>" for the optimizer's parameters (others are ignored); under a
// StoredLayout, each stored FQN's state goes to every parameter stored there.
void LoadJob::ValidateState() {
  struct Reader {
    std::string fqn;
    at::Tensor param;
    std::vector<int64_t> rows;
  };
  absl::flat_hash_map<std::string, std::vector<Reader>> readers_of;  // by stored FQN
  for (auto& [fqn, param] : UniqueParameters(model_)) {
    StoredTensor stored = StoredOptimizer(fqn);
    readers_of[stored.fqn].push_back({fqn, param, std::move(stored.rows)});
  }
  const optim_state::OptimStateDict live =
      in_place_ ? adapter_.GetOptimState(model_, *optimizer_) : optim_state::OptimStateDict();
  const std::string prefix = options_.layout.optimizer_prefix + "state.";
  for (const DcpEntry& e : md_.entries) {
    if (!absl::StartsWith(e.fqn, prefix)) continue;
    const std::string rest = e.fqn.substr(prefix.size());
    const size_t dot = rest.rfind('.');
    if (dot == std::string::npos) continue;
    auto it = readers_of.find(rest.substr(0, dot));
    if (it == readers_of.end()) continue;
    const std::string name = rest.substr(dot + 1);
    for (const Reader& r : it->second)
      ValidateStateEntry(e, r.fqn, name, r.param, LiveState(live, r.fqn, name), r.rows);
  }
}

// `live`: the optimizer's tensor, read into in place when it can be.
void LoadJob::ValidateStateEntry(const DcpEntry& e, const std::string& fqn, const std::string& name,
                                 const at::Tensor& param, const at::Tensor& live, const std::vector<int64_t>& rows) {
  optim_state::StateValue& value = optim_.state[fqn][name];
  if (e.is_bytes) {
    const c10::IValue v = ReadValue(e.fqn);
    TORCH_CHECK(v.isInt() || v.isDouble(), kLoad, ": '", e.fqn, "' in the checkpoint '", dir_, "' is a ", v.tagKind(),
                "; optimizer state values are tensors, ints or floats");
    value = v.isInt() ? optim_state::StateValue(v.toInt()) : optim_state::StateValue(v.toDouble());
  } else if (!e.size.empty()) {  // laid out like the parameter: read in Plan / Read
    const ShardedParam* sharded = adapter_.Sharded(fqn);
    TensorEntry(e.fqn, sharded ? sharded->global_size() : param.sizes().vec(), absl::StrCat("parameter '", fqn, "'"),
                rows);
    const std::vector<int64_t> local = sharded ? sharded->local_size() : param.sizes().vec();
    state_targets_.push_back(
        {fqn,
         name,
         {&e, local, sharded ? sharded->boxes() : std::vector<Box>{WholeBox(local)}, live, nullptr, {}, rows, {}}});
  } else {  // a 0-d value (`step`): read now, into fresh memory (no live tensor changes)
    at::Tensor scalar = at::empty({}, at::TensorOptions().dtype(e.properties.dtype));
    reader_->ReadInto(e.fqn, {}, scalar);
    if (name == "step") {  // PyTorch's 0-d float tensor; LibTorch's optimizers count in an int
      const double step = scalar.item<double>();
      TORCH_CHECK(step >= 0 && std::floor(step) == step, kLoad, ": '", e.fqn, "' in the checkpoint '", dir_, "' is ",
                  step, ", not a step count");
      value = static_cast<int64_t>(step);
    } else {
      value = scalar;
    }
  }
}

}  // namespace fsdp::dcp::internal
