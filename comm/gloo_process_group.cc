#include "comm/gloo_process_group.h"

#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <c10/util/Exception.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "comm/internal/gloo_liveness.h"
#include "comm/internal/tcp_store.h"
#include "comm/main_guard.h"

namespace fsdp::comm {
namespace {

using internal::PeerLiveness;

// Where the transport binds (PyTorch's rule, GlooOptions::hostname) and the host the
// liveness listener binds to (the same address, so peers that reach one reach the other).
struct TransportChoice {
  std::vector<std::string> interfaces;  // GLOO_SOCKET_IFNAME's, when hostname is empty
  std::string liveness_host;
};

// The first IPv4 (else IPv6) address of network interface `iface`.
std::string InterfaceAddress(const std::string& iface) {
  ifaddrs* list = nullptr;
  TORCH_CHECK(getifaddrs(&list) == 0, "Gloo: getifaddrs failed: ", std::strerror(errno));
  std::string v4, v6;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || iface != a->ifa_name) continue;
    char ip[INET6_ADDRSTRLEN] = {};
    if (a->ifa_addr->sa_family == AF_INET && v4.empty()) {
      inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, ip, sizeof(ip));
      v4 = ip;
    } else if (a->ifa_addr->sa_family == AF_INET6 && v6.empty()) {
      inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(a->ifa_addr)->sin6_addr, ip, sizeof(ip));
      v6 = ip;
    }
  }
  freeifaddrs(list);
  TORCH_CHECK(!v4.empty() || !v6.empty(), "Gloo: GLOO_SOCKET_IFNAME names interface '", iface,
              "', which has no IP address on this host (see `ip addr`)");
  return v4.empty() ? v6 : v4;
}

TransportChoice ChooseTransport(const std::string& hostname) {
  TransportChoice out;
  if (!hostname.empty()) {
    out.liveness_host = hostname;
    return out;
  }
  if (const char* env = std::getenv("GLOO_SOCKET_IFNAME"); env != nullptr && *env != '\0') {
    for (absl::string_view name : absl::StrSplit(env, ',', absl::SkipWhitespace())) {
      out.interfaces.emplace_back(absl::StripAsciiWhitespace(name));
    }
    TORCH_CHECK(!out.interfaces.empty(), "Gloo: GLOO_SOCKET_IFNAME='", env, "' names no interface");
    out.liveness_host = InterfaceAddress(out.interfaces.front());
    return out;
  }
  // createDefaultDevice's rule: this host's name when it resolves to an address we can bind,
  // else loopback.
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0') {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* info = nullptr;
    if (getaddrinfo(name, nullptr, &hints, &info) == 0 && info != nullptr) {
      const int fd = socket(info->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
      const bool usable = fd >= 0 && bind(fd, info->ai_addr, info->ai_addrlen) == 0;
      if (fd >= 0) close(fd);
      freeaddrinfo(info);
      if (usable) {
        out.liveness_host = name;
        return out;
      }
    }
  }
  out.liveness_host = "127.0.0.1";
  return out;
}

// ------------------------------------------------------------------ work

// An error's message without LibTorch's C++ backtrace, and without gloo's source location
// ("[.../pair.cc:561] ") and generic advice (" This is typically caused by ...").
std::string MessageOf(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  std::string text = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
  if (!text.empty() && text[0] == '[') {
    const size_t close = text.find("] ");
    if (close != std::string::npos && text.rfind(".cc:", close) != std::string::npos) text = text.substr(close + 2);
  }
  if (const size_t advice = text.find(" This is typically caused"); advice != std::string::npos) text.resize(advice);
  return std::string(absl::StripAsciiWhitespace(text));
}

class GlooWork final : public Work {
 public:
  GlooWork(std::string description, Timeout timeout, c10::intrusive_ptr<c10d::Work> work,
           std::shared_ptr<const PeerLiveness> liveness)
      : Work(std::move(description), timeout),
        work_(std::move(work)),
        liveness_(std::move(liveness)),
        start_(std::chrono::steady_clock::now()) {}

  bool is_completed() override { return work_->isCompleted(); }
  std::exception_ptr exception() override {
    if (error_) return error_;
    return work_->isCompleted() ? work_->exception() : nullptr;
  }

 protected:
  bool WaitFor(Timeout timeout) override {
    const auto wait_start = std::chrono::steady_clock::now();
    try {
      work_->wait(timeout);
    } catch (const std::exception& e) {
      const auto now = std::chrono::steady_clock::now();
      // A timeout only when the wait lasted its whole timeout: c10d's Gloo work can throw a
      // peer's lost connection while it still reads as not completed.
      if (!work_->isCompleted() && now - wait_start >= timeout) return false;
      // Gloo's own failure (a peer's connection closed or reset): say when, record it for the
      // peers' messages, and name the peers that are gone by rank (gloo names them by address).
      const auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(now - start_);
      const std::string cause = MessageOf(e);
      liveness_->RecordFailure(absl::StrCat(description(), " failed: ", cause));
      const std::string lost = liveness_->Describe(/*retries=*/2);
      try {
        if (lost.empty()) {
          TORCH_CHECK_WITH(DistBackendError, false, description(), " failed after ", elapsed.count(), " ms: ", cause);
        }
        TORCH_CHECK_WITH(DistBackendError, false, description(), " failed after ", elapsed.count(),
                         " ms: connection lost: ", lost, " (gloo: ", cause, ")");
      } catch (...) {
        error_ = std::current_exception();
      }
    }
    return true;
  }
  std::string TimeoutDetail() override { return liveness_->Describe(); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::shared_ptr<const PeerLiveness> liveness_;
  std::chrono::steady_clock::time_point start_;
  std::exception_ptr error_;
};

c10d::ReduceOp ToC10d(ReduceOp op) {
  switch (op.kind()) {
    case ReduceOpKind::kMax: return c10d::ReduceOp::MAX;
    case ReduceOpKind::kMin: return c10d::ReduceOp::MIN;
    default: return c10d::ReduceOp::SUM;  // AVG and PREMUL_SUM are built from SUM
  }
}

class GlooProcessGroup final : public ProcessGroup {
 public:
  // `root_store`: the job's un-prefixed store (the failure registry of every group); null:
  // `store` is the root.
  GlooProcessGroup(c10::intrusive_ptr<c10d::Store> store, int rank, int size, const GlooOptions& options,
                   c10::intrusive_ptr<c10d::Store> root_store = nullptr)
      : ProcessGroup(rank, size, options.timeout),
        store_(store),
        root_store_(root_store ? root_store : store),
        options_(options) {
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
    const TransportChoice transport = ChooseTransport(options.hostname);
    if (!transport.interfaces.empty()) {
      for (const std::string& iface : transport.interfaces) {
        gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(iface));
      }
    } else if (options.hostname.empty()) {
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    } else {
      gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(options.hostname));
    }
    gloo_options->threads = options.threads;
    const std::string address = internal::LivenessAddress(transport.liveness_host);
    store->set(internal::LivenessKey(rank), std::vector<uint8_t>(address.begin(), address.end()));
    backend_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, gloo_options);
    // Gloo's rendezvous completed, so every rank has published its address already.
    std::vector<std::string> addresses(size);
    for (int r = 0; r < size; ++r) {
      const std::vector<uint8_t> bytes = store->get(internal::LivenessKey(r));
      addresses[r].assign(bytes.begin(), bytes.end());
    }
    liveness_ = std::make_shared<const PeerLiveness>(std::move(addresses), rank, options.timeout, root_store_);
    // Whatever ends this process under comm::RunMain, its peers learn it stopped on its own.
    AddErrorExitHook([weak = std::weak_ptr<const PeerLiveness>(liveness_)](const std::string& line) {
      if (auto liveness = weak.lock()) liveness->RecordFailure(line);
    });
  }

  std::string backend_name() const override { return "gloo"; }

 protected:
  WorkPtr DoAllGather(const at::Tensor& output, const at::Tensor& input) override {
    const std::string what = Describe("all_gather_into_tensor", input);
    if (input.numel() == 0) return MakeCompletedWork(what);
    at::Tensor out = output.view({-1});
    at::Tensor in = input.view({-1});
    return Wrap(what, backend_->all_gather_single(out, in));
  }

  WorkPtr DoReduceScatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op) override {
    const std::string what = Describe(absl::StrCat("reduce_scatter_tensor(", op.ToString(), ")"), input);
    if (output.numel() == 0) return MakeCompletedWork(what);
    at::Tensor out = output.view({-1});
    // PREMUL_SUM must not modify the caller's input: scale a copy.
    at::Tensor in = op.kind() == ReduceOpKind::kPremulSum ? input.view({-1}).mul(op.factor()) : input.view({-1});
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = ToC10d(op);
    // c10d's work keeps `in` (the scaled copy) alive until the collective finished.
    WorkPtr work = Wrap(what, backend_->reduce_scatter_single(out, in, opts));
    AddAverageStep(*work, output, op);
    return work;
  }

  WorkPtr DoAllReduce(const at::Tensor& tensor, ReduceOp op) override {
    const std::string what = Describe(absl::StrCat("all_reduce(", op.ToString(), ")"), tensor);
    if (tensor.numel() == 0) return MakeCompletedWork(what);
    if (op.kind() == ReduceOpKind::kPremulSum) tensor.mul_(op.factor());
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = ToC10d(op);
    WorkPtr work = Wrap(what, backend_->allreduce(tensors, opts));
    AddAverageStep(*work, tensor, op);
    return work;
  }

  WorkPtr DoBroadcast(const at::Tensor& tensor, int root) override {
    const std::string what = Describe(absl::StrCat("broadcast(root=", root, ")"), tensor);
    if (tensor.numel() == 0) return MakeCompletedWork(what);
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    return Wrap(what, backend_->broadcast(tensors, opts));
  }

  WorkPtr DoAllToAll(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& output_split_sizes,
                     const std::vector<int64_t>& input_split_sizes) override {
    const std::string what = Describe(absl::StrCat("all_to_all_single(in [", absl::StrJoin(input_split_sizes, ","),
                                                   "], out [", absl::StrJoin(output_split_sizes, ","), "])"),
                                      input);
    at::Tensor out = output;
    at::Tensor in = input;
    std::vector<int64_t> out_splits = output_split_sizes;
    std::vector<int64_t> in_splits = input_split_sizes;
    return Wrap(what, backend_->all_to_all_single(out, in, out_splits, in_splits));
  }

  WorkPtr DoBarrier() override { return Wrap(absl::StrCat("barrier on ", WhoAmI()), backend_->barrier()); }

  std::shared_ptr<ProcessGroup> DoNewSubgroup(const std::vector<int>& ranks) override {
    const uint64_t index = next_split_++;
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i] != rank()) continue;
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
          absl::StrCat("fsdp_subgroup_", index, "_", absl::StrJoin(ranks, "_")), store_);
      return std::make_shared<GlooProcessGroup>(prefixed, static_cast<int>(i), static_cast<int>(ranks.size()),
                                                options_, root_store_);
    }
    return nullptr;
  }

 private:
  std::string Describe(const std::string& op_text, const at::Tensor& t) const {
    return absl::StrCat(op_text, " ", DescribeTensor(t), " on ", WhoAmI());
  }

  WorkPtr Wrap(const std::string& what, c10::intrusive_ptr<c10d::Work> work) {
    return std::make_shared<GlooWork>(what, timeout(), std::move(work), liveness_);
  }

  // Gloo has no AVG: reduce with SUM, divide once the data arrived.
  void AddAverageStep(Work& work, const at::Tensor& result, ReduceOp op) {
    if (op.kind() != ReduceOpKind::kAvg) return;
    const double world = size();
    work.AddCompletionStep([result, world] { result.div_(world); });
  }

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Store> root_store_;
  GlooOptions options_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> backend_;
  std::shared_ptr<const PeerLiveness> liveness_;
  uint64_t next_split_ = 0;
};

void CheckOptions(const GlooOptions& options) {
  TORCH_CHECK(options.threads >= 1, "GlooOptions.threads must be >= 1, got ", options.threads);
}

}  // namespace

ProcessGroupPtr CreateGlooProcessGroupWithFileStore(const std::string& store_path, int rank, int world_size,
                                                    const GlooOptions& options) {
  CheckOptions(options);
  TORCH_CHECK(world_size >= 1, "CreateGlooProcessGroupWithFileStore: world_size must be >= 1, got ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "CreateGlooProcessGroupWithFileStore: rank must be in [0, ", world_size,
              "), got ", rank);
  TORCH_CHECK(!store_path.empty(), "CreateGlooProcessGroupWithFileStore: store_path is empty");
  auto store = c10::make_intrusive<c10d::FileStore>(store_path, world_size);
  store->setTimeout(options.timeout);
  return std::make_shared<GlooProcessGroup>(store, rank, world_size, options);
}

ProcessGroupPtr CreateGlooProcessGroupWithTcpStore(const TorchrunEnv& env, const GlooOptions& options) {
  CheckOptions(options);
  auto store = internal::ConnectTcpStore(env, options.timeout, "CreateGlooProcessGroupWithTcpStore");
  return std::make_shared<GlooProcessGroup>(store, env.rank, env.world_size, options);
}

ProcessGroupPtr CreateGlooProcessGroupFromEnv(const GlooOptions& options) {
  return CreateGlooProcessGroupWithTcpStore(ReadTorchrunEnv(), options);
}

}  // namespace fsdp::comm
