// The one place checkpoint files touch the file system: read a whole file, write one
// atomically. Every error is a c10::Error that starts with the caller's name and names the
// path and the operating system's reason.
#ifndef FSDP_CHECKPOINT_FILE_IO_H_
#define FSDP_CHECKPOINT_FILE_IO_H_

#include <string>
#include <string_view>
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

}  // namespace fsdp::checkpoint

#endif  // FSDP_CHECKPOINT_FILE_IO_H_
