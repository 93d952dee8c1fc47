// fr_trace: what PyTorch's `python -m torch.distributed.flight_recorder.fr_trace DIR` says
// about a directory of flight recorder dumps, without Python (tools/fr_trace_lib.h).
//   bazel run //tools:fr_trace -- DIR [--prefix nccl_trace_rank_]
#include <iostream>
#include <string>

#include "comm/main_guard.h"
#include "tools/fr_trace_lib.h"

int main(int argc, char** argv) {
  return fsdp::comm::RunMain([&]() -> int {
    std::string dir, prefix;
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if ((arg == "--prefix" || arg == "-p") && i + 1 < argc) {
        prefix = argv[++i];
      } else if (arg.rfind("--prefix=", 0) == 0) {
        prefix = arg.substr(9);
      } else if (!arg.empty() && arg[0] != '-' && dir.empty()) {
        dir = arg;
      } else {
        std::cerr << "usage: fr_trace DIR [--prefix PREFIX]\n";
        return 2;
      }
    }
    if (dir.empty()) {
      std::cerr << "usage: fr_trace DIR [--prefix PREFIX]\n";
      return 2;
    }
    std::cout << fsdp::tools::DiagnoseFlightDumps(fsdp::tools::ReadFlightDumps(dir, prefix));
    return 0;
  });
}
