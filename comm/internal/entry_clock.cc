#include "comm/internal/entry_clock.h"

#include <fstream>
#include <string>

namespace fsdp::comm::internal {

bool TscKeepsTime() {
#if defined(__x86_64__)
  static const bool tsc = [] {
    std::ifstream f("/sys/devices/system/clocksource/clocksource0/current_clocksource");
    std::string source;
    return static_cast<bool>(f >> source) && source == "tsc";
  }();
  return tsc;
#else
  return false;
#endif
}

}  // namespace fsdp::comm::internal
