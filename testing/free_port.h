// A TCP port on 127.0.0.1 that was free a moment ago, for MASTER_PORT (a launcher's or a test's
// rendezvous). No LibTorch: tests that only start programs use it too.
//
// Errors: throws std::runtime_error when no socket can be bound. Another process may take the
// port before the caller binds it (as with torchrun's own free-port choice).
#ifndef FSDP_TESTING_FREE_PORT_H_
#define FSDP_TESTING_FREE_PORT_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <stdexcept>

namespace fsdp::testing {

inline int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("FreePort: socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                     ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  if (!bound) throw std::runtime_error("FreePort: no port to bind on 127.0.0.1");
  return ntohs(addr.sin_port);
}

}  // namespace fsdp::testing

#endif  // FSDP_TESTING_FREE_PORT_H_
