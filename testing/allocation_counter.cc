#include "testing/allocation_counter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <memory>
#include <mutex>

namespace fsdp::testing {
namespace {

thread_local std::shared_ptr<ScopedAllocationCounter::Counts> active;

// What a counted allocation's DataPtr owns: the real allocation and who to debit.
struct Counted {
  c10::DataPtr inner;
  std::shared_ptr<ScopedAllocationCounter::Counts> counts;
  int64_t bytes;
};

void DeleteCounted(void* ctx) {
  auto* c = static_cast<Counted*>(ctx);
  c->counts->current -= c->bytes;
  delete c;
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(size_t n) override {
    if (active != nullptr && n > 0) {
      const int64_t limit = active->limit.load();
      TORCH_CHECK(limit < 0 || active->current.load() + static_cast<int64_t>(n) <= limit,
                  "ScopedAllocationCounter: allocating ", n, " bytes would exceed this thread's limit of ", limit,
                  " bytes (", active->current.load(), " live)");
    }
    c10::DataPtr p = inner_->allocate(n);
    if (active == nullptr || n == 0) return p;
    active->Add(static_cast<int64_t>(n));
    void* data = p.get();
    const c10::Device device = p.device();
    return c10::DataPtr(data, new Counted{std::move(p), active, static_cast<int64_t>(n)}, &DeleteCounted, device);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

 private:
  c10::Allocator* inner_;
};

void InstallOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    static CountingAllocator allocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(&allocator, /*priority=*/100);
  });
}

}  // namespace

void ScopedAllocationCounter::Install() { InstallOnce(); }

ScopedAllocationCounter::ScopedAllocationCounter() : counts_(std::make_shared<Counts>()) {
  InstallOnce();
  TORCH_CHECK(active == nullptr, "ScopedAllocationCounter: one is already active on this thread");
  active = counts_;
}

ScopedAllocationCounter::~ScopedAllocationCounter() { active = nullptr; }

void ScopedAllocationCounter::Counts::Add(int64_t bytes) {
  const int64_t now = current += bytes;
  int64_t seen = peak.load();
  while (now > seen && !peak.compare_exchange_weak(seen, now)) {
  }
}

}  // namespace fsdp::testing
