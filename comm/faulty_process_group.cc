#include "comm/faulty_process_group.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"

namespace fsdp::comm {
namespace {

using Clock = std::chrono::steady_clock;

// The Work of a faulted collective.
class FaultWork final : public Work {
 public:
  FaultWork(std::string description, Timeout timeout, Fault::Kind kind, WorkPtr inner, std::chrono::milliseconds delay)
      : Work(std::move(description), timeout), kind_(kind), inner_(std::move(inner)), ready_at_(Clock::now() + delay) {
    if (kind_ == Fault::Kind::kFail) {
      error_ = std::make_exception_ptr(
          c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                absl::StrCat(this->description(), " failed: injected fault (FaultyProcessGroup)")));
    }
  }

  bool is_completed() override {
    if (kind_ == Fault::Kind::kFail) return true;
    if (kind_ == Fault::Kind::kHang) return false;
    return Clock::now() >= ready_at_ && inner_->is_completed();
  }
  std::exception_ptr exception() override { return error_; }

 protected:
  bool WaitFor(Timeout timeout) override {
    switch (kind_) {
      case Fault::Kind::kFail: return true;
      case Fault::Kind::kHang: std::this_thread::sleep_for(timeout); return false;
      default: {
        const auto deadline = Clock::now() + timeout;
        if (ready_at_ > deadline) {
          std::this_thread::sleep_until(deadline);
          return false;
        }
        std::this_thread::sleep_until(ready_at_);
        try {
          inner_->wait(std::chrono::duration_cast<Timeout>(deadline - Clock::now()));
        } catch (...) {
          error_ = std::current_exception();
        }
        return true;
      }
    }
  }
  std::string TimeoutDetail() override {
    return kind_ == Fault::Kind::kHang ? "injected hang (FaultyProcessGroup)" : "injected delay (FaultyProcessGroup)";
  }

 private:
  Fault::Kind kind_;
  WorkPtr inner_;
  Clock::time_point ready_at_;
  std::exception_ptr error_;
};

}  // namespace

FaultyProcessGroup::FaultyProcessGroup(ProcessGroupPtr inner, std::vector<Fault> faults)
    : ForwardingProcessGroup(std::move(inner), "FaultyProcessGroup") {
  Arm(std::move(faults));
}

void FaultyProcessGroup::Arm(std::vector<Fault> faults) {
  for (const Fault& f : faults) {
    TORCH_CHECK(f.index >= 0, "FaultyProcessGroup: fault index must be >= 0, got ", f.index);
    TORCH_CHECK(f.delay.count() >= 0, "FaultyProcessGroup: fault delay must be >= 0 ms, got ", f.delay.count());
  }
  faults_ = std::move(faults);
  calls_.clear();
  total_calls_ = 0;
}

std::string FaultyProcessGroup::backend_name() const { return absl::StrCat("faulty(", inner()->backend_name(), ")"); }

WorkPtr FaultyProcessGroup::Intercept(const CollectiveCall& call, c10::function_ref<WorkPtr()> issue) {
  const char* op = call.op;
  const at::Tensor& output = call.output;
  int64_t* op_calls = nullptr;
  for (auto& [name, n] : calls_) {
    if (name == op) op_calls = &n;
  }
  if (op_calls == nullptr) op_calls = &calls_.emplace_back(op, 0).second;
  const Fault* fault = nullptr;
  for (const Fault& f : faults_) {
    if ((f.op.empty() && f.index == total_calls_) || (f.op == op && f.index == *op_calls)) fault = &f;
  }
  ++*op_calls;
  ++total_calls_;
  if (fault == nullptr) return issue();
  ++injected_;
  // A send has no output: it is named by what it sends.
  const std::string description =
      absl::StrCat(op, " ", DescribeTensor(output.defined() ? output : call.input), " on ", WhoAmI());
  switch (fault->kind) {
    case Fault::Kind::kFail:
    case Fault::Kind::kHang:
      return std::make_shared<FaultWork>(description, timeout(), fault->kind, nullptr, std::chrono::milliseconds(0));
    case Fault::Kind::kDelay:
      return std::make_shared<FaultWork>(description, timeout(), fault->kind, issue(), fault->delay);
    case Fault::Kind::kCorrupt: {
      TORCH_CHECK(output.defined(), "FaultyProcessGroup: a kCorrupt fault hit ", description,
                  ", which has no output to corrupt (corrupt the peer's recv instead)");
      WorkPtr work = issue();
      work->AddCompletionStep([output, nan = fault->corrupt_with_nan] {
        if (output.numel() == 0) return;
        at::NoGradGuard no_grad;
        at::Tensor first = output.view(-1).narrow(0, 0, 1);
        if (nan) {
          first.fill_(std::numeric_limits<double>::quiet_NaN());
        } else {
          first.add_(1);
        }
      });
      return work;
    }
  }
  TORCH_CHECK(false, "FaultyProcessGroup: unknown fault kind");
  return nullptr;  // not reached; gcc does not know TORCH_CHECK(false) throws (-Wreturn-type)
}

}  // namespace fsdp::comm
