// Staging buffers for dcp::AsyncSave: the C++ counterpart of PyTorch 2.15's DefaultStager with
// StagingOptions (torch/distributed/checkpoint/staging.py) and of torchtitan's async_mode
// "async_with_pinned_mem": host buffers for this rank's snapshot, allocated (and touched) at
// the first save and reused by every later save of the same layout, so that a save stalls the
// step only for the copy into them: no allocation, no page faults.
//
//   auto stager = std::make_shared<fsdp::dcp::Stager>();
//   fsdp::dcp::SaveOptions options;
//   options.stager = stager;
//   auto handle = fsdp::dcp::AsyncSave(*model, &optim, dir, options);   // copies into the buffers
//
// With async_staging (PyTorch's StagingOptions.use_async_staging, which torchtitan's
// async_with_pinned_mem turns on) the copy itself runs on a staging stream, ordered after the
// work launched before the save (CUDA: a side stream waiting for the current one, non-blocking
// copies; CPU: a worker thread), so AsyncSave returns before it finished and the copy overlaps
// the next step's forward and backward. The caller must then call WaitForStaging() before it
// changes anything the save holds (the optimizer step: torchtitan's maybe_wait_for_staging);
// the save's writer thread waits for the copy too.
//
// Contract: the buffers are pinned (page-locked, through the CUDA host allocator) when
// `pin_memory` and CUDA is available, else ordinary host memory. A save through a stager first
// waits until the previous save through it has written its file (that save's thread reads the
// buffers): at most one save in flight per stager; the wait is what wait_seconds() adds up. A
// save whose items differ in number, shapes or dtypes from the buffers' reallocates them
// (allocations() counts it). Like PyTorch's DefaultSavePlanner(enable_plan_caching=True), a
// stager also keeps the last save's plan and this rank's predicted fragment: while every
// rank's plan is unchanged, a save agrees on that in one all-gather instead of planning again,
// and while this rank's items keep their keys, shapes and byte lengths it reuses its fragment.
// Thread-compatible: one save at a time per stager.
#ifndef FSDP_DCP_STAGER_H_
#define FSDP_DCP_STAGER_H_

#include <cstdint>
#include <memory>

#include "device/stream.h"

namespace fsdp::dcp {

namespace internal {
struct StagerAccess;  // dcp/save.cc
}  // namespace internal

struct StagerOptions {
  bool pin_memory = true;
  bool async_staging = false;
  // The stream async staging copies on; null: one the stager makes for the saved tensors'
  // device at the first save (CPU: an async stream, device/stream.h).
  device::StreamPtr stream;
};

class Stager {
 public:
  explicit Stager(StagerOptions options = {});
  ~Stager();
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;

  int64_t staged_bytes() const;  // the buffers' total size
  int64_t allocations() const;   // times the buffers were (re)allocated: 1 in a steady run
  bool pinned() const;           // the buffers are page-locked
  double wait_seconds() const;   // time saves spent waiting for the previous one's write
  // Blocks until the last save's copy into the buffers finished (at once without async
  // staging, or when it already did); throws its error (a c10::Error). Thread-compatible.
  void WaitForStaging();

 private:
  friend struct internal::StagerAccess;
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace fsdp::dcp

#endif  // FSDP_DCP_STAGER_H_
