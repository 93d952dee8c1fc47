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

}  // namespace

std::vector<char> ReadFile(const std::string& path, std::string_view caller) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
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

ScopedFd::~ScopedFd() {
  if (fd_ >= 0) ::close(fd_);
}

AtomicFile::AtomicFile(std::string path, std::string_view caller) : path_(std::move(path)), caller_(caller) {
  TORCH_CHECK(!path_.empty(), caller_, ": the path is empty");
  static std::atomic<uint64_t> counter{0};
  tmp_ = absl::StrCat(path_, ".tmp.", ::getpid(), ".", counter.fetch_add(1));
  fd_ = ScopedFd(::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  TORCH_CHECK(fd_.get() >= 0, caller_, ": cannot create '", tmp_, "' to write '", path_, "' (", Reason(errno), ")");
}

AtomicFile::~AtomicFile() {
  if (fd_.get() >= 0) {  // not committed: an error left it behind
    ::close(fd_.Release());
    ::unlink(tmp_.c_str());
  }
}

void AtomicFile::Write(const char* data, size_t size) {
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::write(fd_.get(), data + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) Fail("write", errno);
    done += static_cast<size_t>(n);
  }
  size_ += static_cast<int64_t>(size);
}

void AtomicFile::Commit() {
  if (::fsync(fd_.get()) != 0) Fail("fsync", errno);
  // Another process may have truncated (or written to) the temporary meanwhile: a checkpoint
  // whose `.metadata` points past a file's end must never look complete.
  struct stat st {};
  if (::fstat(fd_.get(), &st) != 0) Fail("fstat", errno);
  TORCH_CHECK(st.st_size == size_, caller_, ": writing '", path_, "' failed: its temporary '", tmp_, "' holds ",
              st.st_size, " bytes after ", size_, " were written (truncated or changed by another process?)");
  if (::close(fd_.Release()) != 0) {
    const int error = errno;
    ::unlink(tmp_.c_str());
    TORCH_CHECK(false, caller_, ": writing '", path_, "' failed: close (", Reason(error), ")");
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp_.c_str());
    TORCH_CHECK(false, caller_, ": cannot rename '", tmp_, "' to '", path_, "' (", Reason(error), ")");
  }
}

void AtomicFile::Fail(const char* what, int error) {
  TORCH_CHECK(false, caller_, ": writing '", path_, "' failed: ", what, " (", Reason(error), ")");
}

void WriteFileAtomically(const std::string& path, const std::vector<char>& bytes, std::string_view caller) {
  AtomicFile file(path, caller);
  file.Write(bytes);
  file.Commit();
}

void PreadFully(int fd, uint64_t offset, size_t size, char* out, const std::string& path, std::string_view caller) {
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::pread(fd, out + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, caller, ": reading bytes [", offset, ", ", offset + size, ") of '", path, "' failed after ",
                done, " bytes (", n == 0 ? "end of file: truncated?" : Reason(errno), ")");
    done += static_cast<size_t>(n);
  }
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  return !dir.empty() && dir.back() == '/' ? dir + name : dir + "/" + name;
}

}  // namespace fsdp::checkpoint
