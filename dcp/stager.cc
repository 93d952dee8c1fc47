// See stager.h. The copying is save.cc's (internal::StagerAccess).
#include "dcp/stager.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <future>
#include <utility>
#include <vector>

#include "dcp/stager_access.h"

namespace fsdp::dcp {

struct Stager::State {
  StagerOptions options;
  bool pin = false;
  device::StreamPoolPtr pool;  // a device's streams, when the stager made options.stream there
  device::EventPtr staging;    // the last async copy's completion, until waited for
  std::vector<at::Tensor> buffers;
  int64_t bytes = 0;
  int64_t allocations = 0;
  double wait_seconds = 0;
  std::shared_future<void> in_flight;  // ready once the last save's thread wrote its file
  internal::SavePlanCache cache;
};

Stager::Stager(StagerOptions options) : state_(std::make_unique<State>()) {
  state_->pin = options.pin_memory && at::hasCUDA();
  state_->options = std::move(options);
}
Stager::~Stager() { internal::StagerAccess::WaitIdle(*this); }

int64_t Stager::staged_bytes() const { return state_->bytes; }
int64_t Stager::allocations() const { return state_->allocations; }
bool Stager::pinned() const { return state_->pin; }
double Stager::wait_seconds() const { return state_->wait_seconds; }

void Stager::WaitForStaging() {
  device::EventPtr staging = std::move(state_->staging);
  if (staging != nullptr) staging->Synchronize(comm::kDefaultTimeout);
}

namespace internal {

SavePlanCache& StagerAccess::Cache(Stager& stager) { return stager.state_->cache; }

void StagerAccess::WaitIdle(Stager& stager) {
  Stager::State& s = *stager.state_;
  if (!s.in_flight.valid()) return;
  const auto start = std::chrono::steady_clock::now();
  s.in_flight.wait();  // a broken promise (the save's thread died) is ready too
  s.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  s.in_flight = {};
}

std::vector<at::Tensor> StagerAccess::Stage(Stager& stager, const std::vector<at::Tensor>& sources) {
  Stager::State& s = *stager.state_;
  bool same = s.buffers.size() == sources.size();
  for (size_t i = 0; same && i < sources.size(); ++i) {
    same = s.buffers[i].sizes() == sources[i].sizes() && s.buffers[i].scalar_type() == sources[i].scalar_type();
  }
  if (!same) {
    s.buffers.clear();
    s.bytes = 0;
    for (const at::Tensor& t : sources) {
      at::Tensor b = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()).pinned_memory(s.pin));
      if (b.numel() > 0) b.zero_();  // touched now, so no save page-faults into them
      s.bytes += static_cast<int64_t>(b.nbytes());
      s.buffers.push_back(std::move(b));
    }
    ++s.allocations;
  }
  if (!s.options.async_staging) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < sources.size(); ++i) s.buffers[i].copy_(sources[i]);
    return s.buffers;
  }
  device::StreamPtr& stream = s.options.stream;
  if (stream == nullptr) {
    const c10::Device device = sources.empty() ? c10::Device(c10::kCPU) : sources.front().device();
    if (device.is_cpu()) {
      stream = device::NewAsyncCpuStream("dcp staging", comm::kDefaultTimeout, std::chrono::microseconds(0));
    } else {
      s.pool = device::StreamPool::Create(device, {});
      stream = s.pool->NewStream("dcp staging");
    }
  }
  // On a device: after the work that produced the sources (the host's CPU work is done).
  if (s.pool != nullptr) stream->WaitStream(s.pool->current());
  for (const at::Tensor& t : sources) stream->KeepAlive(t);
  stream->Launch([buffers = s.buffers, sources] {
    at::NoGradGuard no_grad;  // the worker's own grad mode: the sources may require grad
    for (size_t i = 0; i < sources.size(); ++i) buffers[i].copy_(sources[i], /*non_blocking=*/true);
  });
  s.staging = stream->RecordEvent();
  return s.buffers;
}

device::EventPtr StagerAccess::StagingEvent(Stager& stager) { return stager.state_->staging; }

std::shared_ptr<std::promise<void>> StagerAccess::MarkBusy(Stager& stager) {
  auto done = std::make_shared<std::promise<void>>();
  stager.state_->in_flight = done->get_future().share();
  return done;
}

}  // namespace internal
}  // namespace fsdp::dcp
