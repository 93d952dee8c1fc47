// The streams FSDP1 issues its work on (PyTorch's _init_streams in torch/distributed/fsdp/_runtime_utils.py)
// and the storage rules that let the host free a buffer while a stream may still use it.
//
// The host assigns tensors and metadata at once; the streams fill the data later:
//   unshard        the low precision shard's cast (PyTorch's pre-unshard stream) and the
//                  all-gather into the padded unsharded flat parameter
//   post_backward  the gradient reduction: cast, pre-divide, reduce-scatter (NO_SHARD:
//                  all-reduce) or the communication hook, post-divide, accumulation, offload
//   all_reduce     HYBRID_SHARD's inter-node all-reduce and what follows it
// The compute stream waits for a handle's unshard event before the unsharded flat parameter
// is used (FlatParamHandle::WaitForUnshard) and for the post-backward streams before the
// gradients are visible (the post-backward final callback). Every collective is issued
// through the root's CollectiveSequencer, so each rank issues them in program order even when
// two async streams are ready at once.
#ifndef FSDP_FSDP_FSDP1_FLAT_PARAM_STREAMS_H_
#define FSDP_FSDP_FSDP1_FLAT_PARAM_STREAMS_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <initializer_list>
#include <memory>
#include <utility>
#include <vector>

#include "device/stream.h"

namespace fsdp::fsdp1 {

// Non-owning: the FlatParamStreamContext (or the calling thread) owns the streams.
struct FlatParamStreams {
  device::Stream* current = nullptr;  // compute
  device::Stream* unshard = nullptr;
  device::Stream* post_backward = nullptr;
  device::Stream* all_reduce = nullptr;
  device::CollectiveSequencer* sequencer = nullptr;
  device::Timeout timeout = comm::kDefaultTimeout;  // host waits on events (rate limiter)
  // Inline CPU streams: the host waits for each collective right after issuing it, as
  // PyTorch's FSDP1 does (torch/distributed/fsdp/_flat_param.py and _runtime_utils.py call
  // all_gather_into_tensor / reduce_scatter_tensor with async_op=False, whose work.wait()
  // blocks the host on a CPU backend). The backend's temporaries (Gloo's flat all-gather
  // output, its copy of the reduce-scatter input) are then freed before compute resumes
  // instead of living through the next unit's backward, which would hold the allocation peak
  // above PyTorch's (docs/design/measured-choices.md; C10dWork::ReleaseAfterWait in
  // comm/internal/c10d_adapter.cc does the rest). Async CPU streams (tests) and CUDA streams
  // keep their collectives in flight; FSDPState::PrefetchHandle's own wait for a prefetched
  // CPU all-gather covers async CPU streams too.
  bool host_waits_for_collectives = false;
};

// Issues `issue` on `stream` through the streams' sequencer; with host_waits_for_collectives
// waits for it (and anything else pending on `stream`) before returning.
template <class Issue>
void LaunchCollective(const FlatParamStreams& streams, device::Stream& stream, Issue&& issue) {
  stream.LaunchCollective(*streams.sequencer, std::forward<Issue>(issue));
  if (streams.host_waits_for_collectives) stream.Synchronize();
}

// One root's streams (FSDPRuntimeContext holds it; every handle of the tree uses them), on
// `device`, with `options` (FSDPOptions::stream_options; FSDP_CPU_STREAMS overrides them).
class FlatParamStreamContext {
 public:
  FlatParamStreamContext(c10::Device device, const device::StreamOptions& options);
  FlatParamStreamContext(const FlatParamStreamContext&) = delete;
  FlatParamStreamContext& operator=(const FlatParamStreamContext&) = delete;
  const FlatParamStreams& streams() const { return streams_; }

 private:
  device::StreamPoolPtr pool_;
  std::vector<device::StreamPtr> owned_;
  FlatParamStreams streams_;
};

// Inline streams of the calling thread, for a handle used without the FSDP runtime (tests of
// the handle alone): work runs on the host, collectives stay pending until waited for.
const FlatParamStreams& ThreadInlineFlatParamStreams();

// A tensor aliasing `t`'s current memory through its own (non-owning) storage. Stream work
// captures it for buffers whose storage the host frees in place (fsdp/common/storage.h): the
// host may swap the storage's memory before the stream runs, the alias keeps pointing at the
// memory the work was launched for, which FreeStorageAfterStreams keeps alive.
at::Tensor StreamAlias(const at::Tensor& t);

// FreeStorage(t) for the host (t's storage holds 0 bytes at once, the next AllocStorage gets
// new memory), while the memory itself is released only after the work enqueued so far on
// every stream of `streams` finished (record_stream's role). No-op when already freed.
void FreeStorageAfterStreams(const at::Tensor& t, std::initializer_list<device::Stream*> streams);

}  // namespace fsdp::fsdp1

#endif  // FSDP_FSDP_FSDP1_FLAT_PARAM_STREAMS_H_
