#include "device/stream.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <string_view>

#include "device/internal/pools.h"
#include "env/environment.h"

namespace fsdp::device {

Event::Event(std::string stream_name, bool completed) : stream_name_(std::move(stream_name)), done_(completed) {}

std::shared_ptr<Event> Event::Completed() {
  // One shared instance: inline streams record one per launch, and nothing changes a
  // completed event (streams only add pending work to events they made themselves).
  static const std::shared_ptr<Event> completed = [] {
    auto event = std::make_shared<Event>("host", /*completed=*/true);
    event->always_complete_ = true;  // waits and queries on it return at once (~170 instructions each)
    return event;
  }();
  return completed;
}

bool Event::Query() {
  if (always_complete_) return true;
  std::vector<comm::WorkPtr> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) return false;
    pending = pending_;
  }
  for (const auto& w : pending) {
    if (!w->is_completed()) return false;
  }
  return !native_query || native_query();
}

void Event::Synchronize(Timeout timeout) {
  if (always_complete_) return;
  SynchronizePendingWork(timeout);
  if (native_synchronize) native_synchronize(timeout);
}

void Event::SynchronizePendingWork(Timeout timeout) {
  if (always_complete_) return;
  std::vector<comm::WorkPtr> pending;
  {
    std::unique_lock<std::mutex> lock(mu_);
    TORCH_CHECK(done_ || cv_.wait_for(lock, timeout, [this] { return done_; }), "waiting for an event of stream '",
                stream_name_, "': the work recorded before it did not finish within ", timeout.count(),
                " ms (a hung collective or a stream blocked on an event that never completes)");
    if (error_) std::rethrow_exception(error_);
    pending = pending_;
  }
  for (const auto& w : pending) w->wait();  // collectives: their group's own timeout
}

void Event::Complete(std::exception_ptr error) {
  TORCH_CHECK(!always_complete_, "Event::Complete: called on the shared completed event (Event::Completed())");
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

void Event::AddPendingWork(comm::WorkPtr work) {
  TORCH_CHECK(!always_complete_, "Event::AddPendingWork: called on the shared completed event (Event::Completed())");
  std::lock_guard<std::mutex> lock(mu_);
  pending_.push_back(std::move(work));
}

uint64_t CollectiveSequencer::TakeTicket() {
  std::lock_guard<std::mutex> lock(mu_);
  return next_ticket_++;
}

comm::WorkPtr CollectiveSequencer::IssueInTurn(uint64_t ticket, TaskRef<comm::WorkPtr> issue, Timeout timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  // Once the order is broken (an issue failed or timed out) nothing waits any more.
  const auto ready = [&] { return turn_ == ticket || error_; };
  const bool turn = ready() || cv_.wait_for(lock, timeout, ready);  // in turn: no clock read
  if (!turn) {  // the earlier collective's stream is stuck: break the order for good
    error_ = std::make_exception_ptr(c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                                "collective #" + std::to_string(ticket) + " waited " +
                                                    std::to_string(timeout.count()) + " ms for collective #" +
                                                    std::to_string(turn_) + " of this rank to be issued first"));
  }
  if (error_) {
    std::exception_ptr failure = error_;
    lock.unlock();
    cv_.notify_all();
    std::rethrow_exception(failure);
  }
  comm::WorkPtr work;
  try {
    work = issue();
  } catch (...) {
    error_ = std::current_exception();
  }
  ++turn_;
  std::exception_ptr failure = error_;
  lock.unlock();
  cv_.notify_all();
  if (failure) std::rethrow_exception(failure);
  return work;
}

void Stream::KeepAlive(at::Tensor tensor) {
  Launch([held = std::move(tensor)]() mutable { held.reset(); });
}

StreamOptions StreamOptionsFromEnv() { return ApplyStreamEnvOverride(StreamOptions{}); }

StreamOptions ApplyStreamEnvOverride(StreamOptions options) {
  const std::optional<std::string> raw = env::Get(env::kCpuStreams);
  if (!raw) return options;
  const std::string_view value(*raw);
  if (value.empty() || value == "inline") {
    options.cpu_mode = CpuStreamMode::kInline;
    options.cpu_task_delay = std::chrono::microseconds(0);
    return options;
  }
  constexpr std::string_view kAsync = "async";
  TORCH_CHECK(value.substr(0, kAsync.size()) == kAsync,
              "FSDP_CPU_STREAMS must be 'inline', 'async' or 'async:<microseconds>', got '", value, "'");
  options.cpu_mode = CpuStreamMode::kAsync;
  options.cpu_task_delay = std::chrono::microseconds(0);
  if (value.size() == kAsync.size()) return options;
  TORCH_CHECK(value[kAsync.size()] == ':' && value.size() > kAsync.size() + 1,
              "FSDP_CPU_STREAMS must be 'inline', 'async' or 'async:<microseconds>', got '", value, "'");
  const std::string digits(value.substr(kAsync.size() + 1));
  char* end = nullptr;
  const long long us = std::strtoll(digits.c_str(), &end, 10);
  TORCH_CHECK(end != nullptr && *end == '\0' && us >= 0 && us <= 1000000,
              "FSDP_CPU_STREAMS: the task delay must be 0..1000000 microseconds, got '", digits, "'");
  options.cpu_task_delay = std::chrono::microseconds(us);
  return options;
}

namespace internal {
void PruneFinished(std::vector<comm::WorkPtr>& pending) {
  if (pending.empty()) return;
  auto finished = [](const comm::WorkPtr& w) {
    if (!w->is_completed()) return false;
    w->wait();
    return true;
  };
  pending.erase(std::remove_if(pending.begin(), pending.end(), finished), pending.end());
}
}  // namespace internal

std::shared_ptr<StreamPool> StreamPool::Create(c10::Device device, StreamOptions options) {
  TORCH_CHECK(options.timeout.count() > 0, "StreamPool::Create: options.timeout must be positive, got ",
              options.timeout.count(), " ms");
  if (device.is_cpu()) return internal::CreateCpuStreamPool(options);
  if (device.is_cuda()) return internal::CreateCudaStreamPool(device, options);
  TORCH_CHECK(false, "StreamPool::Create: no streams for device ", device, " (supported: cpu, cuda)");
}

}  // namespace fsdp::device
