#include "checkpoint/file_io.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fsdp::checkpoint {
namespace {

std::string Reason(int error) { return std::strerror(error); }

// Closes the descriptor on every path out of a function.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int Release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

}  // namespace

std::vector<char> ReadFile(const std::string& path, std::string_view caller) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  TORCH_CHECK(fd.get() >= 0, caller, ": cannot open '", path, "' for reading (", Reason(errno), ")");
  struct stat st {};
  TORCH_CHECK(::fstat(fd.get(), &st) == 0, caller, ": cannot stat '", path, "' (", Reason(errno), ")");
  TORCH_CHECK(!S_ISDIR(st.st_mode), caller, ": '", path, "' is a directory, not a checkpoint file");
  std::vector<char> bytes;
  bytes.reserve(S_ISREG(st.st_mode) ? static_cast<size_t>(st.st_size) : 0);
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n >= 0, caller, ": reading '", path, "' failed after ", bytes.size(), " bytes (", Reason(errno), ")");
    if (n == 0) break;
    bytes.insert(bytes.end(), buffer, buffer + n);
  }
  return bytes;
}

void WriteFileAtomically(const std::string& path, const std::vector<char>& bytes, std::string_view caller) {
  TORCH_CHECK(!path.empty(), caller, ": the path is empty");
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid(), ".", counter.fetch_add(1));
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  TORCH_CHECK(fd.get() >= 0, caller, ": cannot create '", tmp, "' to write '", path, "' (", Reason(errno), ")");
  const auto fail = [&](const char* what, int error) {
    ::close(fd.Release());
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, caller, ": writing '", path, "' failed: ", what, " (", Reason(error), ")");
  };
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("write", errno);
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd.get()) != 0) fail("fsync", errno);
  if (::close(fd.Release()) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, caller, ": writing '", path, "' failed: close (", Reason(error), ")");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, caller, ": cannot rename '", tmp, "' to '", path, "' (", Reason(error), ")");
  }
}

}  // namespace fsdp::checkpoint
