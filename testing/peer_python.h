// The peer Python (PyTorch 2.15 in the peer venv) that interop tests run scripts with:
// FSDP_PEER_PYTHON, which ./x setup passes to Bazel tests (--test_env in .bazelrc.user) once
// the peer venv exists. Tests skip, with the reason, where it is missing.
#ifndef FSDP_TESTING_PEER_PYTHON_H_
#define FSDP_TESTING_PEER_PYTHON_H_

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace fsdp::testing {

// The peer interpreter, or "" with the reason in `why_not`.
inline std::string PeerPython(std::string* why_not) {
  const char* python = std::getenv("FSDP_PEER_PYTHON");
  if (python == nullptr || *python == '\0') {
    *why_not = "FSDP_PEER_PYTHON is not set (./x setup sets it in .bazelrc.user once the peer venv exists)";
    return "";
  }
  if (::access(python, X_OK) != 0) {
    *why_not = std::string("FSDP_PEER_PYTHON=") + python + " is not an executable";
    return "";
  }
  return python;
}

// For benchmarks run outside Bazel's test environment (./x bench, bazel run): the peer
// venv ./x setup makes in its cache directory (FSDP_CACHE_DIR, else $XDG_CACHE_HOME or
// ~/.cache, then libtorch-fsdp/), unless FSDP_PEER_PYTHON is set; then PeerPython.
// The venv's directory name follows third_party/torch_version.txt's version.
inline constexpr const char* kCachePeerVenv = "peer-venv-torch-2.15.0";
inline std::string PeerPythonOrCacheDefault(std::string* why_not) {
  if (std::getenv("FSDP_PEER_PYTHON") == nullptr) {
    auto env = [](const char* name) -> std::string {
      const char* value = std::getenv(name);
      return value != nullptr ? value : "";
    };
    std::string cache = env("FSDP_CACHE_DIR");
    if (cache.empty()) {
      cache = (env("XDG_CACHE_HOME").empty() ? env("HOME") + "/.cache" : env("XDG_CACHE_HOME")) + "/libtorch-fsdp";
    }
    ::setenv("FSDP_PEER_PYTHON", (cache + "/" + kCachePeerVenv + "/bin/python").c_str(), 0);
  }
  return PeerPython(why_not);
}

// Runs `command` through the shell; returns its wait status (as pclose) and appends its
// output (stdout and stderr) to `output`.
inline int RunCommand(const std::string& command, std::string* output) {
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) output->append(buffer, n);
  return ::pclose(pipe);
}

}  // namespace fsdp::testing

#endif  // FSDP_TESTING_PEER_PYTHON_H_
