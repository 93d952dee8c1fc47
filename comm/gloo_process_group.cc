#include "comm/gloo_process_group.h"

#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <c10/util/Exception.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
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
#include "comm/internal/c10d_adapter.h"
#include "comm/internal/gloo_liveness.h"
#include "comm/internal/tcp_store.h"
#include "comm/main_guard.h"
#include "env/environment.h"

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
  if (const std::optional<std::string> ifname = env::Get(env::kGlooSocketIfname); ifname && !ifname->empty()) {
    for (absl::string_view name : absl::StrSplit(*ifname, ',', absl::SkipWhitespace())) {
      out.interfaces.emplace_back(absl::StripAsciiWhitespace(name));
    }
    TORCH_CHECK(!out.interfaces.empty(), "Gloo: GLOO_SOCKET_IFNAME='", *ifname, "' names no interface");
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

// A write to a socket whose peer died raises SIGPIPE, whose default action ends this process
// before Gloo or the liveness probe can report the lost rank (seen: a survivor of
// comm/fault_test.cc's killed rank "killed by signal 13"). Python ignores SIGPIPE at start-up,
// so under PyTorch a dead peer is an error, never a signal; a C++ program gets the same
// unless it installed its own handler.
void IgnoreSigpipeUnlessHandled() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
}

// A Gloo group over `store` (prefixed for sub-groups); `root_store`: the job's un-prefixed
// store (the failure registry every group of the job shares).
ProcessGroupPtr MakeGlooGroup(c10::intrusive_ptr<c10d::Store> store, int rank, int size, const GlooOptions& options,
                              c10::intrusive_ptr<c10d::Store> root_store) {
  IgnoreSigpipeUnlessHandled();
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
  auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, gloo_options);
  // Gloo's rendezvous completed, so every rank has published its address already.
  std::vector<std::string> addresses(size);
  for (int r = 0; r < size; ++r) {
    const std::vector<uint8_t> bytes = store->get(internal::LivenessKey(r));
    addresses[r].assign(bytes.begin(), bytes.end());
  }
  internal::C10dAdapterOptions adapter;
  adapter.timeout = options.timeout;
  adapter.liveness = std::make_shared<const PeerLiveness>(std::move(addresses), rank, options.timeout, root_store);
  // Whatever ends this process under comm::RunMain, its peers learn it stopped on its own.
  AddErrorExitHook([weak = std::weak_ptr<const PeerLiveness>(adapter.liveness)](const std::string& line) {
    if (auto liveness = weak.lock()) liveness->RecordFailure(line);
  });
  // Sub-groups: a new Gloo group of those ranks over a prefix of this group's store.
  adapter.new_subgroup = [store, options, root_store](const std::vector<int>& ranks, int index, uint64_t serial) {
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
        absl::StrCat("fsdp_subgroup_", serial, "_", absl::StrJoin(ranks, "_")), store);
    return MakeGlooGroup(prefixed, index, static_cast<int>(ranks.size()), options, root_store);
  };
  return internal::MakeC10dProcessGroup(backend, std::move(adapter));
}

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
  return MakeGlooGroup(store, rank, world_size, options, store);
}

ProcessGroupPtr CreateGlooProcessGroupWithTcpStore(const TorchrunEnv& env, const GlooOptions& options) {
  CheckOptions(options);
  auto store = internal::ConnectTcpStore(env, options.timeout, "CreateGlooProcessGroupWithTcpStore");
  return MakeGlooGroup(store, env.rank, env.world_size, options, store);
}

ProcessGroupPtr CreateGlooProcessGroupFromEnv(const GlooOptions& options) {
  return CreateGlooProcessGroupWithTcpStore(ReadTorchrunEnv(), options);
}

}  // namespace fsdp::comm
