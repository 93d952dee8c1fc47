// dcp: inspect and convert PyTorch distributed-checkpoint directories (dcp_cli_lib.h).
//   bazel run //tools:dcp -- ls /path/to/checkpoint
#include <iostream>
#include <string>
#include <vector>

#include "comm/main_guard.h"
#include "tools/dcp_cli_lib.h"

int main(int argc, char** argv) {
  // Any error: one line "[rank R] error: ..." on stderr and exit 1 (comm/main_guard.h).
  return fsdp::comm::RunMain(
      [&]() -> int { return dcp_cli::Run(std::vector<std::string>(argv + 1, argv + argc), std::cout, std::cerr); });
}
