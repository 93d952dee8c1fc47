#include "comm/internal/gloo_liveness.h"

#include <arpa/inet.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp::comm::internal {
namespace {

constexpr char kFailedKey[] = "fsdp_failed_process_";  // + liveness address: one per process
constexpr size_t kMaxRecordedMessage = 300;

struct LivenessListeners {
  std::mutex mu;
  std::map<std::string, std::pair<int, std::string>> by_hostname;  // -> (fd, "port@ip")
};
LivenessListeners& Listeners() {
  static auto* listeners = new LivenessListeners;  // never destroyed: ranks may outlive main
  return *listeners;
}

// "port@ip" of this process's liveness listener for `hostname` (created once, never closed).
}  // namespace

std::string LivenessKey(int rank) { return absl::StrCat("fsdp_liveness_rank_", rank); }

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

namespace {

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

// Raises c10's log level to errors while alive (c10d's C10D_WARNING reads it). Only under
// RegistryMutex: the level is process-wide.
class QuietC10dWarnings {
 public:
  QuietC10dWarnings() : saved_(FLAGS_caffe2_log_level) { FLAGS_caffe2_log_level = std::max(saved_, 2); }
  ~QuietC10dWarnings() { FLAGS_caffe2_log_level = saved_; }

 private:
  int saved_;
};

// Every use of a failure registry in this process, one at a time: after a lost peer several
// collectives fail at once on different threads (FSDP's streams), and each records and asks.
std::mutex& RegistryMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}

// The failure record of the process at liveness address `address`, "" when none (or the
// store is gone).
std::string FailureRecord(const c10::intrusive_ptr<c10d::Store>& registry, const std::string& address) {
  if (registry == nullptr) return "";
  std::lock_guard<std::mutex> lock(RegistryMutex());
  // The store's host may be gone too: then c10d's TCPStore client logs each failed call with
  // a C++ stack before it throws. We only ask, so hide that.
  QuietC10dWarnings quiet;
  try {
    const std::string key = kFailedKey + address;
    if (!registry->check({key})) return "";
    const std::vector<uint8_t> bytes = registry->get(key);
    return std::string(bytes.begin(), bytes.end());
  } catch (const std::exception&) {  // no store: it cannot have told us
    return "";
  }
}

}  // namespace

PeerLiveness::PeerLiveness(std::vector<std::string> addresses, int self, Timeout timeout,
                           c10::intrusive_ptr<c10d::Store> registry)
    : addresses_(std::move(addresses)),
      self_(self),
      budget_(std::min(timeout, Timeout(1000))),
      registry_(std::move(registry)) {}

void PeerLiveness::RecordFailure(const std::string& message) const {
  if (registry_ == nullptr) return;
  const std::string text = message.substr(0, kMaxRecordedMessage);
  std::lock_guard<std::mutex> lock(RegistryMutex());
  QuietC10dWarnings quiet;
  try {
    // First writer wins: the process's first failure, not the echoes on its other groups.
    registry_->compareSet(kFailedKey + addresses_[self_], {}, std::vector<uint8_t>(text.begin(), text.end()));
  } catch (const std::exception&) {  // the store's host is gone too: nothing to tell
  }
}

std::string PeerLiveness::Describe(int retries) const {
  std::vector<int> ended = LostRanks(addresses_, self_, budget_);
  for (int i = 0; i < retries && ended.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ended = LostRanks(addresses_, self_, budget_);
  }
  std::vector<int> lost, stopped;
  std::string first_error;
  for (int r : ended) {
    std::string error = FailureRecord(registry_, addresses_[r]);
    // A lost rank never records; give a record in flight a moment before calling it lost.
    for (int i = 0; i < 3 && error.empty(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      error = FailureRecord(registry_, addresses_[r]);
    }
    (error.empty() ? lost : stopped).push_back(r);
    if (!error.empty() && first_error.empty()) first_error = error;
  }
  std::string out;
  if (!lost.empty()) {
    out = absl::StrCat("rank(s) [", absl::StrJoin(lost, ", "),
                       "] of this group gone (their processes ended: their liveness ports refuse connections)");
  }
  if (!stopped.empty()) {
    absl::StrAppend(&out, out.empty() ? "" : "; ", "rank(s) [", absl::StrJoin(stopped, ", "),
                    "] stopped after their own error (", first_error, ")");
  }
  return out;
}

}  // namespace fsdp::comm::internal
