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
#include "comm/internal/tcp_store.h"

namespace fsdp::comm {
namespace {

// ------------------------------------------------------------------ rank liveness
//
// Gloo names a lost peer by its transport address. To name it by rank, every process listens
// on one TCP port per hostname (never served: the kernel completes the handshake), and
// each group publishes it in its store under its rank at creation. When a collective fails or
// times out, the ranks whose port refuses connections are gone (a dead process's sockets are
// closed by the kernel); a live but stuck rank still accepts, so it is not named.

constexpr const char* kLivenessKey = "fsdp_liveness_rank_";

struct LivenessListeners {
  std::mutex mu;
  std::map<std::string, std::pair<int, std::string>> by_hostname;  // -> (fd, "port@ip")
};
LivenessListeners& Listeners() {
  static auto* listeners = new LivenessListeners;  // never destroyed: ranks may outlive main
  return *listeners;
}

// "port@ip" of this process's liveness listener for `hostname` (created once, never closed).
std::string LivenessAddress(const std::string& hostname) {
  LivenessListeners& listeners = Listeners();
  std::lock_guard<std::mutex> lock(listeners.mu);
  if (auto it = listeners.by_hostname.find(hostname); it != listeners.by_hostname.end()) return it->second.second;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* info = nullptr;
  const int rc = getaddrinfo(hostname.c_str(), nullptr, &hints, &info);
  TORCH_CHECK(rc == 0 && info != nullptr, "Gloo liveness listener: cannot resolve hostname '", hostname,
              "': ", gai_strerror(rc));
  sockaddr_storage addr{};
  std::memcpy(&addr, info->ai_addr, info->ai_addrlen);
  const socklen_t addr_len = info->ai_addrlen;
  freeaddrinfo(info);
  // CLOEXEC: processes this one spawns must not keep the port open after it died.
  const int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  TORCH_CHECK(fd >= 0, "Gloo liveness listener: socket() failed: ", std::strerror(errno));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), addr_len) != 0 || listen(fd, SOMAXCONN) != 0) {
    const int err = errno;
    close(fd);
    TORCH_CHECK(false, "Gloo liveness listener: bind/listen on hostname '", hostname, "' failed: ", std::strerror(err));
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  char ip[INET6_ADDRSTRLEN] = {};
  int port = 0;
  if (addr.ss_family == AF_INET6) {
    const auto* a6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    inet_ntop(AF_INET6, &a6->sin6_addr, ip, sizeof(ip));
    port = ntohs(a6->sin6_port);
  } else {
    const auto* a4 = reinterpret_cast<const sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &a4->sin_addr, ip, sizeof(ip));
    port = ntohs(a4->sin_port);
  }
  const std::string address = absl::StrCat(port, "@", ip);
  listeners.by_hostname[hostname] = {fd, address};
  return address;
}

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

// Closes the peers' probe connections queued on this process's listeners (so the backlog
// does not fill up; a full one would only make probes of this process inconclusive).
void DrainLivenessListeners() {
  LivenessListeners& listeners = Listeners();
  std::lock_guard<std::mutex> lock(listeners.mu);
  for (const auto& [hostname, listener] : listeners.by_hostname) {
    for (int c; (c = accept4(listener.first, nullptr, nullptr, SOCK_CLOEXEC)) >= 0;) close(c);
  }
}

// Starts a non-blocking connect to "port@ip"; -1 if it cannot even start.
int StartProbe(const std::string& address, bool* refused) {
  *refused = false;
  const size_t at = address.find('@');
  int port = 0;
  if (at == std::string::npos || !absl::SimpleAtoi(address.substr(0, at), &port)) return -1;
  const std::string ip = address.substr(at + 1);
  sockaddr_storage addr{};
  socklen_t len = 0;
  if (ip.find(':') != std::string::npos) {
    auto* a6 = reinterpret_cast<sockaddr_in6*>(&addr);
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons(port);
    if (inet_pton(AF_INET6, ip.c_str(), &a6->sin6_addr) != 1) return -1;
    len = sizeof(sockaddr_in6);
  } else {
    auto* a4 = reinterpret_cast<sockaddr_in*>(&addr);
    a4->sin_family = AF_INET;
    a4->sin_port = htons(port);
    if (inet_pton(AF_INET, ip.c_str(), &a4->sin_addr) != 1) return -1;
    len = sizeof(sockaddr_in);
  }
  const int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0 || errno == EINPROGRESS) return fd;
  *refused = errno == ECONNREFUSED || errno == ECONNRESET;
  close(fd);
  return -1;
}

// The ranks (of `addresses`, indexed by rank; those of this process skipped) whose liveness
// port refuses or resets connections within `budget`.
std::vector<int> LostRanks(const std::vector<std::string>& addresses, int self, Timeout budget) {
  DrainLivenessListeners();
  std::vector<int> lost;
  std::vector<pollfd> fds;
  std::vector<int> fd_rank;
  for (int r = 0; r < static_cast<int>(addresses.size()); ++r) {
    if (addresses[r] == addresses[self]) continue;  // this process (ranks as threads): alive
    bool refused = false;
    const int fd = StartProbe(addresses[r], &refused);
    if (refused) lost.push_back(r);
    if (fd < 0) continue;
    fds.push_back({fd, POLLOUT, 0});
    fd_rank.push_back(r);
  }
  const auto deadline = std::chrono::steady_clock::now() + budget;
  size_t pending = fds.size();
  while (pending > 0) {
    const auto left = std::chrono::duration_cast<Timeout>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 || poll(fds.data(), fds.size(), static_cast<int>(left.count())) <= 0) break;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(fds[i].fd, SOL_SOCKET, SO_ERROR, &err, &len);
      // Reset: the listener closed with our connection queued (the process was exiting).
      if (err == ECONNREFUSED || err == ECONNRESET) lost.push_back(fd_rank[i]);
      close(fds[i].fd);
      fds[i].fd = -1;  // poll ignores negative descriptors
      --pending;
    }
  }
  for (const pollfd& p : fds) {
    if (p.fd >= 0) close(p.fd);  // no answer in time: inconclusive
  }
  std::sort(lost.begin(), lost.end());
  return lost;
}

// Every rank's liveness address in one group, to name lost peers in errors.
class PeerLiveness {
 public:
  PeerLiveness(std::vector<std::string> addresses, int self, Timeout timeout)
      : addresses_(std::move(addresses)), self_(self), budget_(std::min(timeout, Timeout(1000))) {}

  // "lost rank(s) [2] (...)", or "" when every peer's process is alive (or unknown). After a
  // transport error (`retries` > 0) the peer that closed the connection may still be
  // exiting: probe again a few times, 50 ms apart.
  std::string Describe(int retries = 0) const {
    std::vector<int> lost = LostRanks(addresses_, self_, budget_);
    for (int i = 0; i < retries && lost.empty(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      lost = LostRanks(addresses_, self_, budget_);
    }
    if (lost.empty()) return "";
    return absl::StrCat("lost rank(s) [", absl::StrJoin(lost, ", "),
                        "] of this group: their processes are gone (their liveness ports refuse connections)");
  }

 private:
  std::vector<std::string> addresses_;
  int self_;
  Timeout budget_;
};

// ------------------------------------------------------------------ work

class GlooWork final : public Work {
 public:
  GlooWork(std::string description, Timeout timeout, c10::intrusive_ptr<c10d::Work> work,
           std::shared_ptr<const PeerLiveness> liveness)
      : Work(std::move(description), timeout), work_(std::move(work)), liveness_(std::move(liveness)) {}

  bool is_completed() override { return work_->isCompleted(); }
  std::exception_ptr exception() override {
    if (error_) return error_;
    return work_->isCompleted() ? work_->exception() : nullptr;
  }

 protected:
  bool WaitFor(Timeout timeout) override {
    try {
      work_->wait(timeout);
    } catch (const std::exception& e) {
      if (!work_->isCompleted()) return false;
      // Re-raise gloo's failure with the collective's description in front and the lost
      // peers' ranks (gloo names them by address) behind.
      const std::string lost = liveness_->Describe(/*retries=*/2);
      try {
        TORCH_CHECK_WITH(DistBackendError, false, description(), " failed: ", e.what(), lost.empty() ? "" : "; ", lost);
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
  GlooProcessGroup(c10::intrusive_ptr<c10d::Store> store, int rank, int size, const GlooOptions& options)
      : ProcessGroup(rank, size, options.timeout), store_(store), options_(options) {
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
    const std::string address = LivenessAddress(transport.liveness_host);
    store->set(absl::StrCat(kLivenessKey, rank), std::vector<uint8_t>(address.begin(), address.end()));
    backend_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, gloo_options);
    // Gloo's rendezvous completed, so every rank has published its address already.
    std::vector<std::string> addresses(size);
    for (int r = 0; r < size; ++r) {
      const std::vector<uint8_t> bytes = store->get(absl::StrCat(kLivenessKey, r));
      addresses[r].assign(bytes.begin(), bytes.end());
    }
    liveness_ = std::make_shared<const PeerLiveness>(std::move(addresses), rank, options.timeout);
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
                                                options_);
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
