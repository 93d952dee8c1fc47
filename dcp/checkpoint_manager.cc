// See checkpoint_manager.h.
#include "dcp/checkpoint_manager.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <numeric>
#include <system_error>
#include <utility>

#include "absl/strings/str_join.h"

namespace fsdp::dcp {
namespace {

constexpr char kManager[] = "CheckpointManager";

int64_t AllReduceInt(const comm::ProcessGroupPtr& group, int64_t value, comm::ReduceOp op) {
  if (group == nullptr || group->size() == 1) return value;
  at::Tensor t = comm::ToObjectCollectiveDevice(*group, at::tensor({value}, at::kLong));
  group->all_reduce(t, op)->wait();
  return t.item<int64_t>();
}

// `.metadata` first: a removal cut short leaves a directory that no longer looks complete.
// Failures are warnings (rank 0 alone purges; torchtitan's purge thread logs them too).
void RemoveCheckpointDir(const std::string& dir) {
  const std::string md = dir + "/.metadata";
  if (::unlink(md.c_str()) != 0 && errno != ENOENT) {
    TORCH_WARN(kManager, ": cannot remove '", md, "' (", std::strerror(errno), "); the checkpoint stays");
    return;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  if (ec) TORCH_WARN(kManager, ": cannot remove '", dir, "' (", ec.message(), ")");
}

}  // namespace

CheckpointManager::CheckpointManager(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                                     StatefulItems stateful, CheckpointManagerOptions options,
                                     comm::ProcessGroupPtr world)
    : model_(model),
      optimizer_(optimizer),
      stateful_(std::move(stateful)),
      options_(std::move(options)),
      world_(std::move(world)) {
  const CheckpointManagerOptions& o = options_;
  TORCH_CHECK(!o.folder.empty(), kManager, ": folder is empty");
  TORCH_CHECK(o.interval >= 1, kManager, ": interval must be >= 1, got ", o.interval);
  TORCH_CHECK(o.keep_latest_k == 0 || o.keep_latest_k >= 2, kManager,
              ": keep_latest_k must be 0 (keep all) or >= 2 (a newer checkpoint may be incomplete), got ",
              o.keep_latest_k);
  TORCH_CHECK(o.load_step >= -1, kManager, ": load_step must be -1 (the newest) or a step, got ", o.load_step);
  std::vector<std::string> excludable = {"optimizer"};
  for (const auto& item : stateful_) excludable.push_back(item.first);
  for (const std::string& name : o.exclude_from_loading) {
    TORCH_CHECK(name != "model", kManager, ": exclude_from_loading cannot name the model");
    TORCH_CHECK(std::find(excludable.begin(), excludable.end(), name) != excludable.end(), kManager,
                ": exclude_from_loading names '", name, "', which is none of ", absl::StrJoin(excludable, ", "));
  }
}

CheckpointManager::~CheckpointManager() {
  if (in_flight_ == nullptr) return;
  try {
    in_flight_->wait();
  } catch (const std::exception& e) {
    TORCH_WARN(kManager, ": the checkpoint save to '", in_flight_dir_, "' failed: ", e.what());
  }
}

std::string CheckpointManager::StepDirectory(int64_t step) const { return StepCheckpointDir(options_.folder, step); }

int64_t CheckpointManager::Load() {
  Wait();
  int64_t step = options_.load_step;
  last_scan_ = {};
  if (step == -1) {
    last_scan_ = ScanCheckpoints(options_.folder);
    const CheckpointScan& scan = last_scan_;
    const int64_t lo = AllReduceInt(world_, scan.latest_step, comm::ReduceOp::Min());
    const int64_t hi = AllReduceInt(world_, scan.latest_step, comm::ReduceOp::Max());
    TORCH_CHECK(lo == hi, kManager, ": the ranks disagree on the newest complete checkpoint under '", options_.folder,
                "' (steps ", lo, " to ", hi, "): is it a folder every rank shares?");
    if (scan.latest_step < 0) return -1;
    step = scan.latest_step;
  }
  LoadOptions load;
  const auto excluded = [&](const std::string& name) {
    return std::find(options_.exclude_from_loading.begin(), options_.exclude_from_loading.end(), name) !=
           options_.exclude_from_loading.end();
  };
  for (const auto& item : stateful_) {
    if (!excluded(item.first)) load.stateful.push_back(item);
  }
  if (options_.stored_fqn) {
    const auto stored = [name = options_.stored_fqn](const std::string& fqn) { return StoredTensor{name(fqn), {}}; };
    load.layout.model = stored;
    load.layout.optimizer = stored;
  }
  dcp::Load(model_, excluded("optimizer") ? nullptr : optimizer_, StepDirectory(step), load);
  return step;
}

void CheckpointManager::Save(int64_t step, bool last_step) {
  last_wait_seconds_ = 0;
  const bool due = last_step || step % options_.interval == 0 || (step == 1 && options_.enable_first_step_checkpoint);
  if (!due) {
    // A save in flight that ended (on every rank: the ranks agree, so that they all report a
    // failure at the same step) is finished here: its error surfaces at the step after it.
    if (in_flight_ != nullptr && AllReduceInt(world_, in_flight_->done() ? 1 : 0, comm::ReduceOp::Min()) == 1) {
      Wait();
    }
    return;
  }
  const auto wait_start = std::chrono::steady_clock::now();
  Wait();  // at most one save in flight
  last_wait_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count();
  ReportFailures([&] { StartSave(step, last_step); });
}

void CheckpointManager::StartSave(int64_t step, bool last_step) {
  const std::string dir = StepDirectory(step);
  SaveOptions save;
  save.flatten_optimizer_state_dict = options_.flatten_optimizer_state_dict;
  save.stored_fqn = options_.stored_fqn;
  if (options_.on_rank_file_written) {
    save.on_rank_file_written = [hook = options_.on_rank_file_written, step](const std::string& file) {
      hook(step, file);
    };
  }
  if (last_step && options_.last_save_model_only) {
    save.dtype = options_.export_dtype;
    dcp::Save(model_, nullptr, dir, save);
    Purge();
    return;
  }
  save.stateful = stateful_;
  if (!options_.async) {
    dcp::Save(model_, optimizer_, dir, save);
    Purge();
    return;
  }
  if (background_ == nullptr && world_ != nullptr && world_->size() > 1) {
    std::vector<int> ranks(world_->size());
    std::iota(ranks.begin(), ranks.end(), 0);
    background_ = world_->new_subgroup(ranks, "checkpoint_manager_async_save");
  }
  if (stager_ == nullptr) {
    stager_ = std::make_shared<Stager>(
        StagerOptions{.pin_memory = options_.pin_memory, .async_staging = options_.async_staging});
  }
  save.stager = stager_;
  in_flight_ = std::make_unique<AsyncSaveHandle>(AsyncSave(model_, optimizer_, dir, save, background_));
  in_flight_dir_ = dir;
}

void CheckpointManager::ReportFailures(const std::function<void()>& body) {
  try {
    body();
  } catch (const c10::Error& e) {
    if (!options_.continue_on_save_failure) throw;
    ++failures_;
    last_failure_ = e.what_without_backtrace();
    TORCH_WARN(kManager, ": a checkpoint save failed; training goes on (continue_on_save_failure): ", last_failure_);
  }
}

void CheckpointManager::MaybeWaitForStaging() {
  if (stager_ != nullptr) stager_->WaitForStaging();
}

void CheckpointManager::Wait() {
  if (in_flight_ == nullptr) return;
  std::unique_ptr<AsyncSaveHandle> handle = std::move(in_flight_);
  ReportFailures([&] {
    handle->wait();  // every rank throws when any rank's write failed
    Purge();
  });
}

void CheckpointManager::Purge() {
  if (options_.keep_latest_k == 0 || (world_ != nullptr && world_->rank() != 0)) return;
  const CheckpointScan scan = ScanCheckpoints(options_.folder);
  const std::vector<int64_t>& complete = scan.complete_steps;
  const size_t keep = static_cast<size_t>(options_.keep_latest_k);
  for (size_t i = 0; i + keep < complete.size(); ++i) RemoveCheckpointDir(StepDirectory(complete[i]));
  for (const IncompleteCheckpoint& bad : scan.incomplete) {
    // A Hugging Face export (torchtitan's last_save_in_hf writes one into step-<N>) is no
    // leftover of a save.
    std::error_code ec;
    const bool hf_export = std::filesystem::exists(bad.dir + "/model.safetensors", ec) ||
                           std::filesystem::exists(bad.dir + "/model.safetensors.index.json", ec);
    if (bad.step < scan.latest_step && !hf_export) RemoveCheckpointDir(bad.dir);
  }
}

}  // namespace fsdp::dcp
