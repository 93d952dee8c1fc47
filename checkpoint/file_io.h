// The one place checkpoint files touch the file system: read a whole file, write one
// atomically. Every error is a c10::Error that starts with the caller's name and names the
// path and the operating system's reason.
#ifndef FSDP_CHECKPOINT_FILE_IO_H_
#define FSDP_CHECKPOINT_FILE_IO_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fsdp::checkpoint {

// The bytes of the file at `path`. Errors: "<caller>: cannot open '<path>' for reading
// (<reason>)", or a read that fails part way.
std::vector<char> ReadFile(const std::string& path, std::string_view caller);

// Writes `bytes` to `path` so that a reader sees either the old file or the whole new one:
// the bytes go to a temporary file next to `path` (same directory, so the rename stays on one
// file system), are flushed, and the temporary file is renamed over `path`. On an error the
// temporary file is removed and `path` is untouched. Errors: "<caller>: cannot create
// '<temporary>' to write '<path>' (<reason>)", "<caller>: writing '<path>' failed (<reason>)".
void WriteFileAtomically(const std::string& path, const std::vector<char>& bytes, std::string_view caller);

// `dir` + "/" + `name`, with no doubled slash when `dir` ends in one (a checkpoint directory
// and a file in it).
std::string JoinPath(const std::string& dir, const std::string& name);

// An open file descriptor (or -1), closed when this goes. Move-only.
class ScopedFd {
 public:
  explicit ScopedFd(int fd = -1) : fd_(fd) {}
  ScopedFd(ScopedFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  ScopedFd& operator=(ScopedFd&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd();
  int get() const { return fd_; }
  int Release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// WriteFileAtomically in pieces: Write appends, Commit syncs, checks that the temporary holds
// exactly the bytes written (another process may have truncated it) and renames it over
// `path`. Destroyed without Commit (an error on the way), the temporary is removed and `path`
// is untouched. Errors as WriteFileAtomically's.
class AtomicFile {
 public:
  AtomicFile(std::string path, std::string_view caller);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void Write(const char* data, size_t size);
  void Write(const std::vector<char>& bytes) { Write(bytes.data(), bytes.size()); }
  int64_t size() const { return size_; }  // bytes written so far
  void Commit();

 private:
  [[noreturn]] void Fail(const char* what, int error);
  std::string path_, tmp_;
  std::string caller_;
  ScopedFd fd_;
  int64_t size_ = 0;
};

// Reads exactly bytes [offset, offset + size) of the open file `fd` (named `path` in errors)
// into `out`, retrying short reads. Errors: "<caller>: reading bytes [<a>, <b>) of '<path>'
// failed after <n> bytes (<reason, or end of file: truncated?>)".
void PreadFully(int fd, uint64_t offset, size_t size, char* out, const std::string& path, std::string_view caller);

}  // namespace fsdp::checkpoint

#endif  // FSDP_CHECKPOINT_FILE_IO_H_
