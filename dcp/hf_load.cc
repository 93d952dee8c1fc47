// dcp::LoadHuggingFace (hf.h): HuggingFaceStorageReader's read_metadata and read_data with
// set_model_state_dict, run in dcp::Load's phases (load.cc): check everything on every rank,
// agree, read (in place or into staging), agree, install, agree.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/hf_checkpoint.h"
#include "dcp/adapter.h"
#include "dcp/collectives.h"
#include "dcp/hf.h"
#include "dcp/hf_model.h"
#include "dcp/load_job.h"
#include "dcp/plan.h"
#include "fsdp/meta/meta.h"

namespace fsdp::dcp {
namespace {

constexpr char kLoadHf[] = "dcp::LoadHuggingFace";

struct Target {
  const internal::HfModelTensor* tensor = nullptr;
  std::string key;  // the checkpoint's
  std::vector<int64_t> local_size;
  std::vector<internal::Box> boxes;
  at::Tensor value;  // where it is read
  bool in_place = false;
};

class HfLoadJob {
 public:
  HfLoadJob(torch::nn::Module& model, const std::string& dir, const HfLoadOptions& options,
            const internal::ModelAdapter& adapter, bool in_place)
      : model_(model), dir_(dir), options_(options), adapter_(adapter), in_place_(in_place) {}

  // Every check, and where each tensor is read. Changes nothing.
  void Validate() {
    reader_ = std::make_unique<checkpoint::HfCheckpointReader>(dir_, kLoadHf);
    tensors_ = internal::HfModelTensors(model_, adapter_, options_.key_of, kLoadHf);
    absl::flat_hash_set<std::string> claimed;
    std::vector<std::string> missing, unexpected, misshaped;
    for (const internal::HfModelTensor& t : tensors_) {
      const checkpoint::HfTensor* found = nullptr;
      for (const std::string& key : t.keys) {
        const checkpoint::HfTensor* h = reader_->Find(key);
        if (h == nullptr) continue;
        claimed.insert(key);
        if (found == nullptr) found = h;
      }
      if (found == nullptr) {
        missing.push_back(t.keys.front());
        continue;
      }
      if (found->size != t.global_size) {
        misshaped.push_back(absl::StrCat("'", found->name, "' is ", c10::str(c10::IntArrayRef(found->size)),
                                         " in the checkpoint and ", c10::str(c10::IntArrayRef(t.global_size)),
                                         " in the model"));
        continue;
      }
      if (t.sharded != nullptr && !t.sharded->live().defined()) continue;  // this rank holds none of it
      Target target{&t,
                    found->name,
                    t.sharded ? t.sharded->local_size() : t.global_size,
                    t.sharded ? t.sharded->boxes() : std::vector<internal::Box>{internal::WholeBox(t.global_size)},
                    {},
                    false};
      targets_.push_back(std::move(target));
    }
    for (const checkpoint::HfTensor& h : reader_->tensors()) {
      if (!claimed.contains(h.name) && !options_.allow_unexpected_keys) unexpected.push_back(h.name);
    }
    TORCH_CHECK(misshaped.empty(), kLoadHf, ": ", misshaped.size(), " tensors of '", dir_,
                "' do not have the model's shape: ", absl::StrJoin(misshaped, "; "));
    if (!options_.allow_partial_load && (!missing.empty() || !unexpected.empty())) {
      std::string what;
      if (!missing.empty()) {
        absl::StrAppend(&what, "the model's ", internal::ListKeys(missing), " (", missing.size(), " of ",
                        tensors_.size(), ") are missing");
      }
      if (!unexpected.empty()) {
        absl::StrAppend(&what, what.empty() ? "" : "; ", internal::ListKeys(unexpected), " (", unexpected.size(),
                        " of ", reader_->tensors().size(), ") are unexpected (no model tensor has that key)");
      }
      TORCH_CHECK(false, kLoadHf, ": '", dir_, "' does not match the model: ", what,
                  " (a checkpoint of another model, or key_of maps names wrongly? allow_partial_load accepts it)");
    }
    for (Target& t : targets_) Plan(t);
  }

  void Read() {
    for (Target& t : targets_) {
      for (const internal::Box& box : t.boxes) reader_->ReadInto(t.key, box.global_offsets, BoxOf(t.value, box));
    }
  }

  void Apply() {
    at::NoGradGuard no_grad;
    for (const Target& t : targets_) {
      if (t.tensor->sharded != nullptr) {
        t.tensor->sharded->Commit(t.value);  // in place too: the adapter's post-load step
      } else if (!t.in_place) {
        ::fsdp::MaterializeEmpty(t.tensor->tensor, adapter_.device());
        t.tensor->tensor.data().copy_(t.value);
      }
    }
  }

 private:
  // In place: the live tensor when it is CPU memory of the local size (any dtype: the read
  // converts). Else fresh memory of the model's dtype, installed by Apply.
  void Plan(Target& t) {
    const at::Tensor live = t.tensor->sharded ? t.tensor->sharded->live() : t.tensor->tensor;
    if (in_place_ && live.defined() && !live.is_meta() && live.is_cpu() &&
        live.sizes() == c10::IntArrayRef(t.local_size)) {
      t.value = live;
      t.in_place = true;
    } else if (t.tensor->sharded != nullptr) {
      t.value = t.tensor->sharded->Staging(live.defined() ? live.scalar_type() : t.tensor->tensor.scalar_type());
    } else {
      t.value = at::empty(t.local_size, at::TensorOptions().dtype(t.tensor->tensor.scalar_type()));
    }
  }

  torch::nn::Module& model_;
  const std::string dir_;
  const HfLoadOptions& options_;
  const internal::ModelAdapter& adapter_;
  const bool in_place_;
  std::unique_ptr<checkpoint::HfCheckpointReader> reader_;
  std::vector<internal::HfModelTensor> tensors_;
  std::vector<Target> targets_;
};

}  // namespace

void LoadHuggingFace(torch::nn::Module& model, const std::string& dir, const HfLoadOptions& options) {
  const std::unique_ptr<internal::ModelAdapter> adapter = internal::AdapterFor(model, kLoadHf);  // reshards
  const comm::ProcessGroupPtr world = adapter->world();
  const bool in_place = !options.all_or_nothing && adapter->CanLoadInPlace();
  HfLoadJob job(model, dir, options, *adapter, in_place);
  internal::RunLoadPhases(
      world, in_place,
      [&] {
        job.Validate();
        if (!in_place) job.Read();
      },
      [&] { job.Read(); }, [&] { job.Apply(); }, kLoadHf, "the model is", "HfLoadOptions::all_or_nothing");
}

}  // namespace fsdp::dcp
