#include "examples/training_checkpoints.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace fsdp::examples {
namespace {

constexpr char kStepKey[] = "train.step";

// {"step": <int64 tensor>} under "train": the step training resumes at.
class StepState : public dcp::Stateful {
 public:
  explicit StepState(int64_t step) : step_(at::tensor({step}, at::kLong)) {}
  dcp::StateDict state_dict() const override { return {{"step", step_}}; }
  void load_state_dict(const dcp::StateDict& state) override { step_ = state.at("step").toTensor(); }
  int64_t step() const { return step_.item<int64_t>(); }
  void set_step(int64_t step) { step_ = at::tensor({step}, at::kLong); }

 private:
  at::Tensor step_;
};

std::optional<std::string> ProcessEnv(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  return value == nullptr ? std::nullopt : std::optional<std::string>(value);
}

[[noreturn]] void KillSelf(int rank, const char* when, int64_t step) {
  std::fprintf(stderr, "[rank %d] fault injection (FSDP_FAULT): SIGKILL %s %ld\n", rank, when, static_cast<long>(step));
  std::fflush(nullptr);
  std::raise(SIGKILL);
  std::_Exit(137);  // not reached
}

}  // namespace

InjectedFault ReadInjectedFault(const std::function<std::optional<std::string>(const std::string&)>& getenv_in) {
  const auto getenv = getenv_in ? getenv_in : ProcessEnv;
  InjectedFault fault;
  const std::optional<std::string> spec = getenv("FSDP_FAULT");
  if (!spec || spec->empty()) return fault;
  const std::vector<std::string> parts = absl::StrSplit(*spec, ':');
  const bool kinds_ok = parts.size() == 3 && (parts[0] == "kill_at_step" || parts[0] == "kill_in_save");
  TORCH_CHECK(kinds_ok && absl::SimpleAtoi(parts[1], &fault.rank) && absl::SimpleAtoi(parts[2], &fault.step) &&
                  fault.rank >= 0 && fault.step >= 0,
              "FSDP_FAULT must be kill_at_step:<rank>:<step> or kill_in_save:<rank>:<step> (non-negative integers), "
              "got '",
              *spec, "'");
  if (std::optional<std::string> restarts = getenv("TORCHELASTIC_RESTART_COUNT")) {
    if (!restarts->empty() && *restarts != "0") return InjectedFault{};  // the relaunch runs clean
  }
  fault.kind = parts[0] == "kill_at_step" ? InjectedFault::Kind::kKillAtStep : InjectedFault::Kind::kKillInSave;
  return fault;
}

void InjectedFault::MaybeKillAt(int this_rank, int64_t step_now) const {
  if (kind == Kind::kKillAtStep && this_rank == rank && step_now == step) KillSelf(rank, "as step", step);
}

void InjectedFault::MaybeKillInSave(int this_rank, int64_t save_step) const {
  if (kind == Kind::kKillInSave && this_rank == rank && save_step == step) {
    KillSelf(rank, "after writing its data file of the checkpoint of step", step);
  }
}

PeriodicCheckpointer::PeriodicCheckpointer(std::string root, int64_t every, comm::ProcessGroupPtr world,
                                           InjectedFault fault, bool log)
    : root_(std::move(root)), every_(every), world_(std::move(world)), fault_(fault), log_(log) {
  TORCH_CHECK(every_ >= 0, "PeriodicCheckpointer: every must be >= 0, got ", every_);
  TORCH_CHECK(every_ == 0 || !root_.empty(), "PeriodicCheckpointer: periodic checkpoints need a root directory");
  step_ = std::make_unique<StepState>(0);
}

PeriodicCheckpointer::~PeriodicCheckpointer() = default;  // the manager waits for its save

dcp::CheckpointManager& PeriodicCheckpointer::Manager(torch::nn::Module& model, torch::optim::Optimizer* optimizer) {
  if (manager_ == nullptr) {
    const int rank = world_ ? world_->rank() : 0;
    const InjectedFault fault = fault_;
    manager_ = std::make_unique<dcp::CheckpointManager>(
        model, optimizer, dcp::StatefulItems{{"train", step_.get()}},
        dcp::CheckpointManagerOptions{
            .folder = root_,
            .interval = every_,
            .keep_latest_k = 0,
            .async = true,
            .on_rank_file_written = [fault, rank](int64_t step,
                                                  const std::string&) { fault.MaybeKillInSave(rank, step); }},
        world_);
  }
  return *manager_;
}

int64_t PeriodicCheckpointer::Resume(torch::nn::Module& model, torch::optim::Optimizer* optimizer) {
  if (every_ == 0) return 0;
  dcp::CheckpointManager& manager = Manager(model, optimizer);
  const int64_t loaded = manager.Load();  // the ranks agree on the newest complete one
  if (log_) {
    for (const dcp::IncompleteCheckpoint& bad : manager.last_scan().incomplete) {
      std::printf("skipping incomplete checkpoint %s: %s\n", bad.dir.c_str(), bad.reason.c_str());
    }
  }
  if (loaded < 0) return 0;
  const int64_t first = static_cast<const StepState&>(*step_).step();
  TORCH_CHECK(first == loaded, "PeriodicCheckpointer: '", manager.StepDirectory(loaded), "' holds ", kStepKey, " = ",
              first, ", not the step its name says");
  if (log_) {
    std::printf("resumed from %s: training continues at step %ld\n", manager.StepDirectory(loaded).c_str(),
                long(first));
  }
  return first;
}

void PeriodicCheckpointer::AfterStep(int64_t step, int64_t total, torch::nn::Module& model,
                                     torch::optim::Optimizer& optimizer) {
  const int64_t next = step + 1;
  if (every_ == 0 || next % every_ != 0 || next >= total) return;
  static_cast<StepState&>(*step_).set_step(next);  // AsyncSave takes its state now
  Manager(model, &optimizer).Save(next);
  ++saves_;
}

void PeriodicCheckpointer::Finish() {
  if (manager_ != nullptr) manager_->Wait();
}

}  // namespace fsdp::examples
