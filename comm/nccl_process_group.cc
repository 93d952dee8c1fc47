// NCCL backend on the NCCL C API and the CUDA runtime only: no libtorch_cuda, no c10/cuda.
// Compiled only under --config=cuda (see comm/BUILD.bazel). The communicator wrapper and the
// per-call NCCL helpers live in comm/internal/nccl_comm.{h,cc}.
#include "comm/nccl_process_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/internal/cuda_utils.h"
#include "comm/internal/nccl_comm.h"
#include "comm/internal/tcp_store.h"
#include "comm/watchdog.h"

namespace fsdp::comm {
namespace {

using internal::CudaEvent;
using internal::DeviceGuard;
using internal::MakeWatchPoll;
using internal::NcclComm;
using internal::NcclErrorText;
using internal::NcclGroup;
using internal::NcclRedOp;
using internal::ToNcclType;

// What the group's collectives share with the watchdog (null members: watchdog off).
struct NcclWatch {
  std::shared_ptr<Watchdog> watchdog;
  std::shared_ptr<Watchdog::Communicator> comm;
};

class NcclWork final : public Work {
 public:
  NcclWork(std::string description, Timeout timeout, std::shared_ptr<NcclComm> comm, std::shared_ptr<CudaEvent> done,
           NcclWatch watch, std::shared_ptr<Watchdog::Collective> watched)
      : Work(std::move(description), timeout),
        comm_(std::move(comm)),
        done_(std::move(done)),
        watch_(std::move(watch)),
        watched_(std::move(watched)) {}

  bool is_completed() override { return Poll(Timeout(0)); }
  std::exception_ptr exception() override { return error_; }

 protected:
  // As in PyTorch, a timed-out wait aborts the communicator: the collective would keep
  // running (and later ones queue behind it) after the caller gave up on it.
  bool WaitFor(Timeout timeout) override {
    if (Poll(timeout)) return true;
    const std::string message =
        absl::StrCat(description(), " timed out after ", timeout.count(),
                     " ms in Work::wait (still running on cuda:", comm_->device(), "; a rank may not have joined it)");
    if (watched_ == nullptr) {
      comm_->Abort();
      return false;  // Work::wait reports the timeout, with TimeoutDetail
    }
    watch_.watchdog->Fail(watch_.comm, watched_.get(),
                          absl::StrCat(message, "; communicator ", watch_.comm->name(), " aborted by the watchdog"));
    return Poll(Timeout(0));  // failed now: by this timeout or a failure just before it
  }

  std::string TimeoutDetail() override {
    return absl::StrCat("the collective is still running on cuda:", comm_->device(),
                        " (a rank may not have joined it); the communicator was aborted, so "
                        "later collectives on this group fail");
  }

 private:
  // True once finished, successfully or not; a failure lands in error_. Polls the event
  // itself (fast completion) and the watchdog's verdict (failures found elsewhere).
  bool Poll(Timeout timeout) {
    if (finished_) return true;
    using Clock = std::chrono::steady_clock;
    const Clock::time_point deadline = Clock::now() + timeout;
    std::chrono::microseconds pause(10);
    while (true) {
      // A communicator aborted by another Work's failure: this collective's result is lost
      // (its event may still complete, as abort makes the kernels exit).
      if (watched_ == nullptr && comm_->aborted()) {
        return Fail(absl::StrCat(description(),
                                 " failed: the NCCL communicator was aborted "
                                 "after an earlier failure"));
      }
      const cudaError_t query = cudaEventQuery(done_->get());
      if (query != cudaSuccess) (void)cudaGetLastError();  // "not ready" must not linger
      // After the event: the watchdog marks the communicator failed before aborting it, so
      // an event completed by the abort is never taken for a result.
      if (watched_ != nullptr) {
        WatchPoll verdict = watched_->status();
        if (verdict.state == WatchPoll::State::kFailed) return Fail(std::move(verdict.error));
      }
      if (query == cudaSuccess) {
        comm_->PruneCompleted();  // release buffers now rather than at the next collective
        return finished_ = true;
      }
      if (query != cudaErrorNotReady) {
        return FailAndAbort(
            absl::StrCat("cudaEventQuery failed: ", cudaGetErrorName(query), " (", cudaGetErrorString(query), ")"));
      }
      const ncclResult_t async = comm_->AsyncError();
      if (async != ncclSuccess) {
        return FailAndAbort(absl::StrCat("NCCL async error: ", NcclErrorText(async)));
      }
      if (Clock::now() >= deadline) return false;  // still running after `timeout`
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1));
    }
  }

  // A failure seen by this Work: abort the communicator (through the watchdog, which also
  // fails the communicator's other collectives) and fail.
  bool FailAndAbort(const std::string& reason) {
    if (watched_ == nullptr) {
      comm_->Abort();
      return Fail(absl::StrCat(description(), " failed: ", reason, "; communicator aborted"));
    }
    watch_.watchdog->Fail(watch_.comm, watched_.get(),
                          absl::StrCat(description(), " failed: ", reason, "; communicator ", watch_.comm->name(),
                                       " aborted by the watchdog"));
    return Fail(watched_->status().error);  // ours, or the failure that came first
  }

  bool Fail(std::string message) {
    error_ = std::make_exception_ptr(
        c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, std::move(message)));
    return finished_ = true;
  }

  std::shared_ptr<NcclComm> comm_;
  std::shared_ptr<CudaEvent> done_;
  NcclWatch watch_;
  std::shared_ptr<Watchdog::Collective> watched_;  // null: watchdog off
  bool finished_ = false;
  std::exception_ptr error_;
};

class NcclProcessGroup final : public ProcessGroup {
 public:
  // `watchdog` null: no watchdog. Subgroups share their parent's.
  NcclProcessGroup(std::shared_ptr<NcclComm> comm, int rank, int size, Timeout timeout,
                   c10::intrusive_ptr<c10d::Store> store, std::shared_ptr<Watchdog> watchdog)
      : ProcessGroup(rank, size, timeout), comm_(std::move(comm)), store_(std::move(store)) {
    if (watchdog != nullptr) {
      watch_.comm = watchdog->AddCommunicator(absl::StrCat(WhoAmI(), " on cuda:", comm_->device()),
                                              [weak = std::weak_ptr<NcclComm>(comm_)] {
                                                if (std::shared_ptr<NcclComm> c = weak.lock()) c->Abort();
                                              });
      watch_.watchdog = std::move(watchdog);
    }
  }

  std::string backend_name() const override { return "nccl"; }

 protected:
  // Data movement (all_gather, broadcast, all_to_all) copies bytes: any dtype works.
  WorkPtr DoAllGather(const at::Tensor& output, const at::Tensor& input) override {
    constexpr const char* kOp = "all_gather_into_tensor";
    CheckOnDevice(kOp, "output", output);
    CheckOnDevice(kOp, "input", input);
    const std::string what = Describe(kOp, input);
    if (input.numel() == 0) return MakeCompletedWork(what);
    return Enqueue(what, {output, input}, [&](ncclComm_t comm, cudaStream_t stream) {
      FSDP_NCCL_CHECK(ncclAllGather(input.data_ptr(), output.data_ptr(), input.nbytes(), ncclUint8, comm, stream));
    });
  }

  WorkPtr DoReduceScatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op) override {
    constexpr const char* kOp = "reduce_scatter_tensor";
    CheckOnDevice(kOp, "output", output);
    CheckOnDevice(kOp, "input", input);
    const ncclDataType_t type = ToNcclType(kOp, input);
    const std::string what = Describe(absl::StrCat(kOp, "(", op.ToString(), ")"), input);
    if (output.numel() == 0) return MakeCompletedWork(what);
    return Enqueue(what, {output, input}, [&](ncclComm_t comm, cudaStream_t stream) {
      NcclRedOp red(kOp, op, input, type, comm);
      FSDP_NCCL_CHECK(
          ncclReduceScatter(input.data_ptr(), output.data_ptr(), output.numel(), type, red.get(), comm, stream));
      red.Release();
    });
  }

  WorkPtr DoAllReduce(const at::Tensor& tensor, ReduceOp op) override {
    constexpr const char* kOp = "all_reduce";
    CheckOnDevice(kOp, "tensor", tensor);
    const ncclDataType_t type = ToNcclType(kOp, tensor);
    const std::string what = Describe(absl::StrCat(kOp, "(", op.ToString(), ")"), tensor);
    if (tensor.numel() == 0) return MakeCompletedWork(what);
    return Enqueue(what, {tensor}, [&](ncclComm_t comm, cudaStream_t stream) {
      NcclRedOp red(kOp, op, tensor, type, comm);
      FSDP_NCCL_CHECK(
          ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), type, red.get(), comm, stream));
      red.Release();
    });
  }

  WorkPtr DoBroadcast(const at::Tensor& tensor, int root) override {
    constexpr const char* kOp = "broadcast";
    CheckOnDevice(kOp, "tensor", tensor);
    const std::string what = Describe(absl::StrCat(kOp, "(root=", root, ")"), tensor);
    if (tensor.numel() == 0) return MakeCompletedWork(what);
    return Enqueue(what, {tensor}, [&](ncclComm_t comm, cudaStream_t stream) {
      FSDP_NCCL_CHECK(
          ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.nbytes(), ncclUint8, root, comm, stream));
    });
  }

  WorkPtr DoAllToAll(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& output_split_sizes,
                     const std::vector<int64_t>& input_split_sizes) override {
    constexpr const char* kOp = "all_to_all_single";
    CheckOnDevice(kOp, "output", output);
    CheckOnDevice(kOp, "input", input);
    const std::string what = Describe(absl::StrCat(kOp, "(in [", absl::StrJoin(input_split_sizes, ","), "], out [",
                                                   absl::StrJoin(output_split_sizes, ","), "])"),
                                      input);
    // Validated: output and input agree beyond dim 0, so one row size serves both.
    const size_t row_bytes = input.element_size() * static_cast<size_t>(c10::multiply_integers(input.sizes().slice(1)));
    return Enqueue(what, {output, input}, [&](ncclComm_t comm, cudaStream_t stream) {
      const char* send = static_cast<const char*>(input.data_ptr());
      char* recv = static_cast<char*>(output.data_ptr());
      NcclGroup group;
      for (int peer = 0; peer < size(); ++peer) {
        const size_t send_bytes = input_split_sizes[peer] * row_bytes;
        const size_t recv_bytes = output_split_sizes[peer] * row_bytes;
        // Zero-byte pieces are skipped on both sides (peer's matching count is zero too).
        if (send_bytes > 0) FSDP_NCCL_CHECK(ncclSend(send, send_bytes, ncclUint8, peer, comm, stream));
        if (recv_bytes > 0) FSDP_NCCL_CHECK(ncclRecv(recv, recv_bytes, ncclUint8, peer, comm, stream));
        send += send_bytes;
        recv += recv_bytes;
      }
      group.End();
    });
  }

  WorkPtr DoBarrier() override {
    const std::string what = Describe("barrier", at::Tensor());
    return Enqueue(what, {}, [&](ncclComm_t comm, cudaStream_t stream) {
      void* buffer = comm_->BarrierBuffer();
      FSDP_NCCL_CHECK(ncclAllReduce(buffer, buffer, 1, ncclInt32, ncclSum, comm, stream));
    });
  }

  std::shared_ptr<ProcessGroup> DoNewSubgroup(const std::vector<int>& ranks) override {
    const std::string what = absl::StrCat("new_subgroup on ", WhoAmI());
    if (watch_.comm != nullptr) watch_.comm->ThrowIfFailed(what);
    const auto it = std::find(ranks.begin(), ranks.end(), rank());
    const bool member = it != ranks.end();
    DeviceGuard guard(comm_->device());
    ncclComm_t child = nullptr;
    // Collective over this group (not watched: it blocks until every rank joined). Key =
    // parent rank keeps the sorted `ranks` order.
    comm_->Use(what, [&](ncclComm_t comm) {
      FSDP_NCCL_CHECK(ncclCommSplit(comm, member ? 0 : NCCL_SPLIT_NOCOLOR, rank(), &child,
                                    /*config=*/nullptr));
    });
    if (!member) return nullptr;
    TORCH_CHECK(child != nullptr, "new_subgroup on ", WhoAmI(),
                ": ncclCommSplit returned no communicator for a member");
    return std::make_shared<NcclProcessGroup>(NcclComm::Adopt(child, comm_->device(), timeout()),
                                              static_cast<int>(it - ranks.begin()), static_cast<int>(ranks.size()),
                                              timeout(), store_, watch_.watchdog);
  }

 private:
  void CheckOnDevice(const char* op, const char* arg, const at::Tensor& t) const {
    TORCH_CHECK(t.is_cuda(), op, ": ", arg, " must be a CUDA tensor for the nccl backend, got ", arg, " on ",
                t.device().str());
    TORCH_CHECK(t.device().index() == comm_->device(), op, ": ", arg, " must be on cuda:", comm_->device(),
                " (this rank's NCCL device), got ", arg, " on ", t.device().str());
  }

  // "<op> <tensor> #<seq> on nccl rank r/W"; seq numbers this group's collectives, the
  // same on every rank, so mismatched calls can be matched up from the messages.
  std::string Describe(const std::string& op_text, const at::Tensor& t) {
    const uint64_t seq = next_seq_++;
    return absl::StrCat(op_text, t.defined() ? " " : "", t.defined() ? DescribeTensor(t) : "", " #", seq, " on ",
                        WhoAmI());
  }

  // Runs `launch` on the group's stream after the default stream's queued work and returns
  // a Work on the completion event. `tensors` stay alive until the collective finished.
  // With the watchdog on, the collective is watched from its enqueue with the group's
  // timeout; a failed communicator fails it before anything is enqueued (sticky error).
  template <typename Launch>
  WorkPtr Enqueue(const std::string& what, std::vector<at::Tensor> tensors, Launch&& launch) {
    if (watch_.comm != nullptr) watch_.comm->ThrowIfFailed(what);
    DeviceGuard guard(comm_->device());
    comm_->WaitForDefaultStream();
    comm_->Use(what, [&](ncclComm_t comm) { launch(comm, comm_->stream()); });
    std::shared_ptr<CudaEvent> done = comm_->RecordCompletion(std::move(tensors));
    std::shared_ptr<Watchdog::Collective> watched;
    if (watch_.watchdog != nullptr) {
      // Throws if the communicator failed since the check above: the result is lost.
      watched = watch_.watchdog->Watch(watch_.comm, what, timeout(), MakeWatchPoll(comm_, done));
    }
    return std::make_shared<NcclWork>(what, timeout(), comm_, std::move(done), watch_, std::move(watched));
  }

  std::shared_ptr<NcclComm> comm_;
  NcclWatch watch_;
  // Kept for the group's lifetime: rank 0 serves the rendezvous store.
  c10::intrusive_ptr<c10d::Store> store_;
  uint64_t next_seq_ = 0;
};

constexpr const char* kUniqueIdKey = "fsdp/nccl/unique_id";

}  // namespace

ProcessGroupPtr CreateNcclProcessGroupWithTcpStore(const TorchrunEnv& env, const NcclOptions& options) {
  constexpr const char* kFn = "CreateNcclProcessGroupWithTcpStore";
  TORCH_CHECK(options.timeout.count() > 0, kFn, ": NcclOptions.timeout must be positive, got ", options.timeout.count(),
              " ms");
  TORCH_CHECK(options.device_index >= -1, kFn, ": NcclOptions.device_index must be >= -1, got ", options.device_index);
  TORCH_CHECK(!options.watchdog || options.watchdog_poll_interval.count() > 0, kFn,
              ": NcclOptions.watchdog_poll_interval must be positive, got ", options.watchdog_poll_interval.count(),
              " ms");
  const int device = options.device_index >= 0 ? options.device_index : env.local_rank;
  int device_count = 0;
  FSDP_CUDA_CHECK(cudaGetDeviceCount(&device_count));
  TORCH_CHECK(device >= 0 && device < device_count, kFn, ": CUDA device ", device,
              options.device_index >= 0 ? " (NcclOptions.device_index)" : " (LOCAL_RANK)",
              " does not exist: ", device_count, " visible");

  auto store = internal::ConnectTcpStore(env, options.timeout, kFn);

  ncclUniqueId id;
  if (env.rank == 0) {
    FSDP_NCCL_CHECK(ncclGetUniqueId(&id));
    const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
    store->set(kUniqueIdKey, std::vector<uint8_t>(bytes, bytes + sizeof(id)));
  } else {
    const std::vector<uint8_t> bytes = store->get(kUniqueIdKey);  // waits up to the timeout
    TORCH_CHECK(bytes.size() == sizeof(id), kFn, ": the store's ", kUniqueIdKey, " holds ", bytes.size(),
                " bytes, expected sizeof(ncclUniqueId) = ", sizeof(id));
    std::memcpy(&id, bytes.data(), sizeof(id));
  }

  DeviceGuard guard(device);
  ncclComm_t comm = nullptr;
  // Blocks until every rank joined (no timeout of its own).
  FSDP_NCCL_CHECK(ncclCommInitRank(&comm, env.world_size, id, env.rank));
  std::shared_ptr<Watchdog> watchdog;
  if (options.watchdog) {
    WatchdogOptions watchdog_options;
    watchdog_options.poll_interval = options.watchdog_poll_interval;
    watchdog = std::make_shared<Watchdog>(std::move(watchdog_options));
  }
  return std::make_shared<NcclProcessGroup>(NcclComm::Adopt(comm, device, options.timeout), env.rank, env.world_size,
                                            options.timeout, store, std::move(watchdog));
}

ProcessGroupPtr CreateNcclProcessGroupFromEnv(const NcclOptions& options) {
  return CreateNcclProcessGroupWithTcpStore(ReadTorchrunEnv(), options);
}

bool NcclAvailable() { return true; }

}  // namespace fsdp::comm
