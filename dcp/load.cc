// dcp::Load (dcp.h): torch/distributed/checkpoint/state_dict_loader.py load with the
// default planner (default_planner.py create_default_local_load_plan: a read of each stored
// chunk that overlaps a destination) into the model's and optimizer's local shards, then
// state_dict.py set_model_state_dict / set_optimizer_state_dict. The phases are
// load_job.h's; Validate is in load_validate.cc.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "comm/profiler_range.h"
#include "dcp/collectives.h"
#include "dcp/dcp.h"
#include "dcp/load_job.h"
#include "fsdp/meta/meta.h"

namespace fsdp::dcp {
namespace internal {

namespace {

// The span of stored rows `box` (dim 0: our global rows [g, g + n)) reads: rows[g, g + n)'s
// smallest to largest, with the box's other dims.
StoredRows PlanStoredRows(const std::vector<int64_t>& rows, const Box& box) {
  const auto first = rows.begin() + box.global_offsets[0];
  const auto last = first + box.sizes[0];
  StoredRows s{box.global_offsets, box.sizes, at::empty({box.sizes[0]}, at::kLong)};
  if (first == last) return s;  // an empty box
  const auto [lo, hi] = std::minmax_element(first, last);
  s.offsets[0] = *lo;
  s.sizes[0] = *hi - *lo + 1;
  int64_t* index = s.index.data_ptr<int64_t>();
  for (auto it = first; it != last; ++it) *index++ = *it - *lo;
  return s;
}

}  // namespace

template <class Fn>
void LoadJob::ForEachRead(Fn&& fn) {
  for (ModelTarget& t : model_targets_) fn(t.read);
  for (ModelTarget& t : stateful_targets_) fn(t.read);
  for (StateTarget& t : state_targets_) fn(t.read);
}

// The destination: the live tensor when the load reads in place and it is a CPU tensor of
// the stored dtype and the local size, else fresh memory; then each box's chunks are located
// and checked (DcpReader::Prepare).
void LoadJob::PlanRead(TensorRead& r) {
  const at::ScalarType dtype = r.entry->properties.dtype;
  const at::Tensor& live = r.live;
  if (in_place_ && live.defined() && !live.is_meta() && live.is_cpu() && live.scalar_type() == dtype &&
      live.sizes() == c10::IntArrayRef(r.local_size)) {
    r.value = live;
  } else if (r.staging_of != nullptr) {
    r.value = r.staging_of->Staging(dtype);
  } else {
    r.value = at::empty(r.local_size, at::TensorOptions().dtype(dtype));
  }
  for (const Box& box : r.boxes) {
    if (r.rows.empty()) {
      reader_->Prepare(r.entry->fqn, box.global_offsets, BoxOf(r.value, box));
      continue;
    }
    TORCH_CHECK(box.flat_local_offset < 0, kLoad, ": '", r.entry->fqn,
                "' is read through LoadOptions::layout's rows, which an FSDP1 flat shard cannot read");
    r.stored_rows.push_back(PlanStoredRows(r.rows, box));
    const StoredRows& s = r.stored_rows.back();
    reader_->Prepare(r.entry->fqn, s.offsets, at::empty(s.sizes, at::TensorOptions().dtype(dtype).device(at::kMeta)));
  }
}

void LoadJob::Plan() {
  ForEachRead([&](TensorRead& r) { PlanRead(r); });
  for (const StateTarget& t : state_targets_) optim_.state[t.fqn][t.name] = t.read.value;
  // In place, the optimizer's tensors are filled before Apply: its state must install.
  if (in_place_ && has_optimizer_state_) adapter_.CheckOptimState(model_, *optimizer_, optim_);
}

void LoadJob::Read() {
  ForEachRead([&](TensorRead& r) {
    for (size_t i = 0; i < r.boxes.size(); ++i) {
      const Box& box = r.boxes[i];
      if (r.rows.empty()) {
        reader_->ReadInto(r.entry->fqn, box.global_offsets, BoxOf(r.value, box));
        continue;
      }
      // One box's stored rows at a time: a box's span of them, not a whole stored tensor.
      const StoredRows& s = r.stored_rows[i];
      const at::Tensor stored = at::empty(s.sizes, at::TensorOptions().dtype(r.entry->properties.dtype));
      reader_->ReadInto(r.entry->fqn, s.offsets, stored);
      BoxOf(r.value, box).detach().copy_(stored.index_select(0, s.index));
    }
  });
}

void LoadJob::Apply() {
  // The read tensors become the optimizer's (no copy, where the adapter allows): the live
  // ones, or the staging ones.
  if (has_optimizer_state_) adapter_.LoadOptimState(model_, *optimizer_, optim_, kLoad);
  at::NoGradGuard no_grad;
  for (const ModelTarget& t : stateful_targets_) {
    if (!t.read.value.is_same(t.tensor)) t.tensor.copy_(t.read.value);
  }
  // Before the model: an object that refuses its state (a throw) leaves the model as it was
  // (with all_or_nothing; in place it is read already).
  for (auto& [leaf, value] : stateful_values_) leaf.set(value);
  for (size_t i = 0; i < options_.stateful.size(); ++i) {
    options_.stateful[i].second->load_state_dict(stateful_dicts_[i]);
  }
  for (const ModelTarget& t : model_targets_) {
    if (t.sharded != nullptr) {
      t.sharded->Commit(t.read.value);
    } else if (!t.read.value.is_same(t.tensor)) {
      ::fsdp::MaterializeEmpty(t.tensor, adapter_.device());
      t.tensor.data().copy_(t.read.value);
    }
  }
}

void RunLoadPhases(const comm::ProcessGroupPtr& world, bool in_place, const std::function<void()>& prepare,
                   const std::function<void()>& read, const std::function<void()>& apply, const char* caller,
                   const char* what, const char* option) {
  // Profiler ranges of the phases (torch/distributed/checkpoint/state_dict_loader.py's
  // local_step / read_data): dcp.load.plan, dcp.load.read, dcp.load.apply.
  static const comm::ProfilerLabel kPlan("dcp.load.plan"), kRead("dcp.load.read"), kApply("dcp.load.apply");
  std::optional<comm::ProfilerRange> phase(std::in_place, kPlan);
  std::string error = ErrorOf(prepare);
  AgreeOrThrow(world, error, caller);
  phase.reset();
  if (in_place) {
    phase.emplace(kRead);
    error = ErrorOf(read);
    if (!error.empty()) {
      absl::StrAppend(&error, " [", caller, " was reading in place: ", what,
                      " now partly loaded; load a checkpoint again before training (", option,
                      " reads into fresh memory first)]");
    }
    AgreeOrThrow(world, error, caller);
    phase.reset();
  }
  phase.emplace(kApply);
  error = ErrorOf(apply);
  AgreeOrThrow(world, error, caller);
}

}  // namespace internal

// Everything that needs no tensor bytes is checked on every rank first, and nothing changes
// unless every rank could. Then the tensors are read: in place (as Python's dcp.load) into
// the live tensors, or (all_or_nothing, and for kinds that cannot load in place) into
// staging tensors installed only once every rank read everything.
void Load(torch::nn::Module& model, torch::optim::Optimizer* optimizer, const std::string& dir,
          const LoadOptions& options) {
  using internal::kLoad;
  static const comm::ProfilerLabel kLabel("dcp.load");
  comm::ProfilerRange load_range(kLabel);
  const std::unique_ptr<internal::ModelAdapter> adapter = internal::AdapterFor(model, kLoad);  // reshards
  const comm::ProcessGroupPtr world = adapter->world();
  const bool in_place = !options.all_or_nothing && adapter->CanLoadInPlace();
  internal::LoadJob job(model, optimizer, dir, options, *adapter, in_place);
  internal::RunLoadPhases(
      world, in_place,
      [&] {
        job.Validate();
        job.Plan();
        if (!in_place) job.Read();
      },
      [&] { job.Read(); }, [&] { job.Apply(); }, kLoad, "the model and optimizer are", "LoadOptions::all_or_nothing");
}

}  // namespace fsdp::dcp
