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
