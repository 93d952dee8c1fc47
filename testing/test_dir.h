// A fresh path for a test's files: under Bazel's TEST_TMPDIR (else /tmp), unique per call in
// this process (name, pid, a counter). The path is not created.
#ifndef FSDP_TESTING_TEST_DIR_H_
#define FSDP_TESTING_TEST_DIR_H_

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"

namespace fsdp::testing {

inline std::string NewTestPath(const std::string& name) {
  static std::atomic<int> counter{0};
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/", name, "_", getpid(), "_", counter++);
}

}  // namespace fsdp::testing

#endif  // FSDP_TESTING_TEST_DIR_H_
