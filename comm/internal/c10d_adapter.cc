// The c10d::Backend adapter behind WrapC10dBackend, the Gloo and the NCCL backends.
#include "comm/internal/c10d_adapter.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <algorithm>
#include <chrono>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "torch_compat/c10d_backend.h"

namespace fsdp::comm {
namespace internal {
namespace {}  // namespace

std::string BackendMessage(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string text = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
  if (!text.empty() && text[0] == '[') {
    const size_t close = text.find("] ");
    if (close != std::string::npos && text.rfind(".cc:", close) != std::string::npos) text = text.substr(close + 2);
  }
  if (const size_t advice = text.find(" This is typically caused"); advice != std::string::npos) text.resize(advice);
  return std::string(absl::StripAsciiWhitespace(text));
}

namespace {

// From this size a CPU collective's buffers can move an allocation peak, and the collective
// lasts long enough that a sched_yield is noise (docs/design/measured-choices.md).
constexpr size_t kYieldAfterReleaseBytes = size_t{1} << 20;

class C10dWork final : public Work {
 public:
  C10dWork(DescriptionFn description, Timeout timeout, c10::intrusive_ptr<c10d::Work> work,
           std::shared_ptr<const PeerLiveness> liveness, std::string backend_name, bool on_device,
           bool yield_after_release)
      : Work(std::move(description), timeout),
        work_(std::move(work)),
        liveness_(std::move(liveness)),
        backend_name_(std::move(backend_name)),
        on_device_(on_device),
        yield_after_release_(yield_after_release),
        start_(std::chrono::steady_clock::now()) {}

  bool is_completed() override {
    const c10::intrusive_ptr<c10d::Work> work = Held();
    return !work || work->isCompleted();
  }
  std::exception_ptr exception() override {
    if (error_) return error_;
    const c10::intrusive_ptr<c10d::Work> work = Held();
    return work && work->isCompleted() ? work->exception() : nullptr;
  }

 protected:
  // Gloo's work keeps its tensors, and a reduce-scatter's copy of the whole input, until it
  // is destroyed (PyTorch drops it after wait()).
  //
  // Then, for a collective of large buffers, the host yields its core once. ProcessGroupGloo's
  // worker thread marks a collective complete before it lets go of its own hold on the
  // collective's buffers (its copy of a reduce-scatter input), which it does when its run loop
  // comes round: on busy cores often after the host had allocated the next unit's gradients,
  // one copy above the peak. One yield lets the worker finish first. Small collectives skip
  // it: handing the core to the other rank costs a scheduler slice, for buffers too small to
  // move a peak. Figures and commands: docs/design/measured-choices.md.
  void ReleaseAfterWait() override {
    if (on_device_) return;  // is_completed() must keep asking the device
    c10::intrusive_ptr<c10d::Work> released;
    {
      std::lock_guard<std::mutex> lock(mu_);
      released.swap(work_);
    }
    released.reset();
    if (yield_after_release_) std::this_thread::yield();
  }

  bool WaitFor(Timeout timeout) override {
    const auto wait_start = std::chrono::steady_clock::now();
    const c10::intrusive_ptr<c10d::Work> work = Held();
    if (!work) return true;  // waited and released before
    try {
      // A device collective's wait only makes the current stream wait for it (c10d's
      // ProcessGroupNCCL blocks the host when given a timeout, so none is given); its
      // deadline is the backend's (the watchdog, or TORCH_NCCL_BLOCKING_WAIT).
      if (on_device_) {
        work->wait();
      } else {
        work->wait(timeout);
      }
    } catch (const std::exception& e) {
      const auto now = std::chrono::steady_clock::now();
      // A timeout only when the wait lasted its whole timeout: c10d's Gloo work can throw a
      // peer's lost connection while it still reads as not completed.
      if (!work->isCompleted() && now - wait_start >= timeout) return false;
      // The backend's own failure (e.g. a peer's connection closed or reset): say when, and
      // with liveness (Gloo) record it for the peers' messages and name the peers that are
      // gone by rank (gloo names them by address).
      const auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(now - start_);
      const std::string cause = BackendMessage(e);
      std::string lost;
      if (liveness_ != nullptr) {
        liveness_->RecordFailure(absl::StrCat(description(), " failed: ", cause));
        lost = liveness_->Describe(/*retries=*/2);
      }
      try {
        if (lost.empty()) {
          TORCH_CHECK_WITH(DistBackendError, false, description(), " failed after ", elapsed.count(), " ms: ", cause);
        }
        TORCH_CHECK_WITH(DistBackendError, false, description(), " failed after ", elapsed.count(),
                         " ms: connection lost: ", lost, " (", backend_name_, ": ", cause, ")");
      } catch (...) {
        error_ = std::current_exception();
      }
    }
    return true;
  }
  std::string TimeoutDetail() override { return liveness_ != nullptr ? liveness_->Describe() : ""; }

 private:
  // Another thread may query the work (Event::Query) while the waiting one releases it.
  c10::intrusive_ptr<c10d::Work> Held() {
    std::lock_guard<std::mutex> lock(mu_);
    return work_;
  }

  std::mutex mu_;
  c10::intrusive_ptr<c10d::Work> work_;  // null once released after a successful wait
  std::shared_ptr<const PeerLiveness> liveness_;
  std::string backend_name_;
  bool on_device_;  // CUDA tensors: waited on the device, kept after the wait
  bool yield_after_release_;
  std::chrono::steady_clock::time_point start_;
  std::exception_ptr error_;
};

c10d::ReduceOp ToC10d(ReduceOp op, bool native_avg) {
  switch (op.kind()) {
    case ReduceOpKind::kMax: return c10d::ReduceOp::MAX;
    case ReduceOpKind::kMin: return c10d::ReduceOp::MIN;
    case ReduceOpKind::kAvg: return native_avg ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
    default: return c10d::ReduceOp::SUM;  // PREMUL_SUM is built from SUM (and Gloo's AVG)
  }
}

class C10dProcessGroup final : public ProcessGroup {
 public:
  C10dProcessGroup(c10::intrusive_ptr<c10d::Backend> backend, C10dAdapterOptions options)
      : ProcessGroup(backend->getRank(), backend->getSize(), options.timeout),
        backend_(std::move(backend)),
        options_(std::move(options)),
        // ProcessGroupGloo refuses AVG ("Cannot use ReduceOp.AVG with Gloo").
        native_avg_(backend_->getBackendName() != "gloo"),
        who_(std::make_shared<const std::string>(backend_->getBackendName())) {}

  std::string backend_name() const override { return backend_->getBackendName(); }

 protected:
  WorkPtr DoAllGather(const at::Tensor& output, const at::Tensor& input) override {
    CheckDevice("all_gather_into_tensor", {{"output", output}, {"input", input}});
    DescriptionFn what = Describe("all_gather_into_tensor", input);
    if (input.numel() == 0) return MakeCompletedWork(what);
    at::Tensor out = output.view({-1});
    at::Tensor in = input.view({-1});
    return Wrap(what, torch_compat::AllGatherSingle(*backend_, out, in), input.device(), output.nbytes());
  }

  WorkPtr DoReduceScatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op) override {
    CheckDevice("reduce_scatter_tensor", {{"output", output}, {"input", input}});
    DescriptionFn what = Describe("reduce_scatter_tensor", input, op);
    if (output.numel() == 0) return MakeCompletedWork(what);
    at::Tensor out = output.view({-1});
    // PREMUL_SUM must not modify the caller's input: scale a copy.
    at::Tensor in = op.kind() == ReduceOpKind::kPremulSum ? input.view({-1}).mul(op.factor()) : input.view({-1});
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = ToC10d(op, native_avg_);
    // c10d's work keeps `in` (the scaled copy) alive until the collective finished.
    WorkPtr work =
        Wrap(what, torch_compat::ReduceScatterSingle(*backend_, out, in, opts), input.device(), input.nbytes());
    AddAverageStep(*work, output, op);
    return work;
  }

  WorkPtr DoAllReduce(const at::Tensor& tensor, ReduceOp op) override {
    CheckDevice("all_reduce", {{"tensor", tensor}});
    DescriptionFn what = Describe("all_reduce", tensor, op);
    if (tensor.numel() == 0) return MakeCompletedWork(what);
    if (op.kind() == ReduceOpKind::kPremulSum) tensor.mul_(op.factor());
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = ToC10d(op, native_avg_);
    WorkPtr work = Wrap(what, backend_->allreduce(tensors, opts), tensor.device(), tensor.nbytes());
    AddAverageStep(*work, tensor, op);
    return work;
  }

  WorkPtr DoBroadcast(const at::Tensor& tensor, int root) override {
    CheckDevice("broadcast", {{"tensor", tensor}});
    DescriptionFn what = Describe("broadcast", tensor, std::nullopt, root);
    if (tensor.numel() == 0) return MakeCompletedWork(what);
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    return Wrap(what, backend_->broadcast(tensors, opts), tensor.device(), tensor.nbytes());
  }

  WorkPtr DoAllToAll(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& output_split_sizes,
                     const std::vector<int64_t>& input_split_sizes) override {
    CheckDevice("all_to_all_single", {{"output", output}, {"input", input}});
    DescriptionFn what = [text = absl::StrCat("all_to_all_single(in [", absl::StrJoin(input_split_sizes, ","),
                                              "], out [", absl::StrJoin(output_split_sizes, ","), "]) ",
                                              DescribeTensor(input), " on ", WhoAmI())] { return text; };
    at::Tensor out = output;
    at::Tensor in = input;
    std::vector<int64_t> out_splits = output_split_sizes;
    std::vector<int64_t> in_splits = input_split_sizes;
    return Wrap(what, torch_compat::AllToAllSingle(*backend_, out, in, out_splits, in_splits), input.device(),
                std::max(input.nbytes(), output.nbytes()));
  }

  WorkPtr DoBarrier() override {
    return Wrap([text = absl::StrCat("barrier on ", WhoAmI())] { return text; }, backend_->barrier(),
                c10::Device(options_.tensor_device_type.value_or(c10::DeviceType::CPU)), /*bytes=*/0);
  }

  // c10d's send / recv (ProcessGroupGloo: a pair-wise buffer; ProcessGroupNCCL: ncclSend /
  // ncclRecv on a communicator of the two ranks).
  WorkPtr DoSend(const at::Tensor& tensor, int dst, int tag) override {
    CheckDevice("send", {{"tensor", tensor}});
    DescriptionFn what = [text = absl::StrCat("send ", DescribeTensor(tensor), " to rank ", dst, " tag ", tag, " on ",
                                              WhoAmI())] { return text; };
    std::vector<at::Tensor> tensors{tensor};
    return Wrap(what, backend_->send(tensors, dst, tag), tensor.device(), tensor.nbytes());
  }

  WorkPtr DoRecv(const at::Tensor& tensor, int src, int tag) override {
    CheckDevice("recv", {{"tensor", tensor}});
    DescriptionFn what = [text = absl::StrCat("recv ", DescribeTensor(tensor), " from rank ", src, " tag ", tag, " on ",
                                              WhoAmI())] { return text; };
    std::vector<at::Tensor> tensors{tensor};
    return Wrap(what, backend_->recv(tensors, src, tag), tensor.device(), tensor.nbytes());
  }

  c10::Device DoObjectCollectiveDevice() const override {
    return options_.object_collective_device.value_or(c10::Device(c10::kCPU));
  }

  std::shared_ptr<ProcessGroup> DoNewSubgroup(const std::vector<int>& ranks) override {
    const uint64_t serial = next_split_++;
    int index = -1;
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i] == rank()) index = static_cast<int>(i);
    }
    if (options_.new_subgroup) return index < 0 ? nullptr : options_.new_subgroup(ranks, index, serial);
    TORCH_CHECK(options_.split_store != nullptr, "new_subgroup on ", WhoAmI(),
                ": the wrapped c10d backend needs a store to split (C10dOptions::store)");
    // c10d's ProcessGroup::splitGroup: every rank calls split(), with the group's ranks;
    // the child's rendezvous keys go under a prefix of their own.
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
        absl::StrCat("fsdp_split_", serial, "_", absl::StrJoin(ranks, "_")), options_.split_store);
    c10::intrusive_ptr<c10d::Backend::Options> parent_options = backend_->getBackendOptions();
    // split() maps the child's ranks to global ranks through the parent's
    // global_ranks_in_group, which a backend built by hand leaves empty. PyTorch 2.11's
    // ProcessGroupGloo stands in the identity only for a process's first Gloo group, and
    // indexed the empty vector otherwise (SIGSEGV, four threads' groups in one process).
    // A group nobody split from is a root group: its global ranks are its ranks.
    if (parent_options && parent_options->global_ranks_in_group.empty()) {
      for (int r = 0; r < size(); ++r) parent_options->global_ranks_in_group.push_back(static_cast<uint64_t>(r));
    }
    c10::intrusive_ptr<c10d::Backend> child =
        backend_->split(prefixed, ranks, torch_compat::CloneBackendOptions(parent_options));
    if (index < 0 || child == nullptr) return nullptr;
    C10dAdapterOptions child_options;
    child_options.timeout = options_.timeout;
    child_options.split_store = options_.split_store;
    child_options.tensor_device_type = options_.tensor_device_type;
    child_options.object_collective_device = options_.object_collective_device;
    return std::make_shared<C10dProcessGroup>(child, std::move(child_options));
  }

 private:
  using DescriptionFn = Work::DescriptionFn;

  // "all_reduce(SUM) Float[6] on gloo rank 1/4", built only when an error (or a trace) asks:
  // a collective that succeeds builds no string.
  DescriptionFn Describe(const char* op, const at::Tensor& t, std::optional<ReduceOp> reduce = std::nullopt,
                         int root = -1) const {
    return [op, reduce, root, dtype = t.scalar_type(), sizes = c10::DimVector(t.sizes()), device = t.device(),
            who = who_, r = rank(), w = size()] {
      std::string text = op;
      if (reduce) absl::StrAppend(&text, "(", reduce->ToString(), ")");
      if (root >= 0) absl::StrAppend(&text, "(root=", root, ")");
      absl::StrAppend(&text, " ", c10::toString(dtype), "[", absl::StrJoin(sizes, ", "), "]",
                      device.is_cpu() ? "" : absl::StrCat("@", device.str()), " on ", *who, " rank ", r, "/", w);
      return text;
    };
  }

  // A tensor on another device type than the backend's (a CPU tensor given to NCCL).
  void CheckDevice(const char* op, std::initializer_list<std::pair<const char*, const at::Tensor&>> tensors) const {
    if (!options_.tensor_device_type) return;
    for (const auto& [name, t] : tensors) {
      TORCH_CHECK(t.device().type() == *options_.tensor_device_type, op, ": ", name, " must be a ",
                  c10::DeviceTypeName(*options_.tensor_device_type), " tensor (", *who_, "), got ",
                  c10::toString(t.scalar_type()), t.sizes(), " on ", t.device().str());
    }
  }

  // `device`: where the collective's tensors are. A CPU collective's work is dropped after its
  // wait; a device one's is kept, so that is_completed() keeps saying whether it finished on
  // the device (its wait only ordered the current stream after it). `bytes`: its largest
  // buffer (C10dWork::ReleaseAfterWait yields from kYieldAfterReleaseBytes on).
  WorkPtr Wrap(DescriptionFn what, c10::intrusive_ptr<c10d::Work> work, c10::Device device, size_t bytes) {
    return std::make_shared<C10dWork>(std::move(what), timeout(), std::move(work), options_.liveness, *who_,
                                      /*on_device=*/!device.is_cpu(),
                                      /*yield_after_release=*/device.is_cpu() && bytes >= kYieldAfterReleaseBytes);
  }

  // Gloo has no AVG: reduce with SUM, divide once the data arrived.
  void AddAverageStep(Work& work, const at::Tensor& result, ReduceOp op) {
    if (op.kind() != ReduceOpKind::kAvg || native_avg_) return;
    const double world = size();
    work.AddCompletionStep([result, world] { result.div_(world); });
  }

  c10::intrusive_ptr<c10d::Backend> backend_;
  C10dAdapterOptions options_;
  bool native_avg_;
  std::shared_ptr<const std::string> who_;  // the backend's name, shared with lazy descriptions
  uint64_t next_split_ = 0;
};

}  // namespace

ProcessGroupPtr MakeC10dProcessGroup(c10::intrusive_ptr<c10d::Backend> backend, C10dAdapterOptions options) {
  TORCH_CHECK(backend != nullptr, "WrapC10dBackend: backend is null");
  TORCH_CHECK(options.timeout.count() > 0, "WrapC10dBackend: timeout must be positive, got ", options.timeout.count(),
              " ms");
  return std::make_shared<C10dProcessGroup>(std::move(backend), std::move(options));
}

}  // namespace internal
}  // namespace fsdp::comm
